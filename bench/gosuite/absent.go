package main

import "fmt"

// absent lists the suite's operations whose feature is not in the library yet (issue
// 11), with what is missing. The table shows each as "not run (feature absent)";
// when a feature lands, its operations move from here to a measurement.
var absent = []struct{ op, missing string }{
}

// absentRows says, for each operation of absent, that it was not run.
func absentRows(r *reporter) {
	for _, a := range absent {
		fmt.Fprintf(r.w, "absent cudapool %s %s\n", a.op, a.missing)
	}
}
