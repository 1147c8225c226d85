package main

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/cudapool/cudapool/internal/rtselect"
)

// TestMain lets the test binary be the suite's consumer process, as the program is.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == consumerRole {
		os.Exit(consumerMain(os.Args[2:]))
	}
	os.Exit(m.Run())
}

// The whole suite, few samples, on the software device: every operation the table
// needs is reported, with positive figures, and nothing fails.
func TestSuiteOnSoftwareDevice(t *testing.T) {
	rt, _, _, err := rtselect.Open(rtselect.Test)
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	r := &reporter{w: &out}
	allocPairs(r, rt, quickShape)
	sharing(r, rt, rtselect.Test, quickShape)
	if err := rtselect.Err(rt); err != nil {
		t.Errorf("the software device saw violations: %v", err)
	}

	want := map[string]bool{"export/fresh": false, "open/first": false, "open/exported": false,
		"release": false, "sustained/4": false, "read/same-gpu": false, "read/other-gpu": false}
	for _, s := range allocSizes {
		want["alloc/"+s.name] = false
	}
	for _, n := range fanouts {
		want["fanout/"+strconv.Itoa(n)] = false
	}
	sc := bufio.NewScanner(strings.NewReader(out.String()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case f[0] == "fail":
			t.Errorf("failed: %s", sc.Text())
		case f[0] == "result" && f[1] == "cudapool":
			median, err := strconv.ParseFloat(f[4], 64)
			if err != nil || len(f) != 7 || median <= 0 {
				t.Errorf("bad result line %q", sc.Text())
			}
			want[f[2]] = true
		}
	}
	for op, seen := range want {
		if !seen {
			t.Errorf("no result for %s", op)
		}
	}
	if r.failed {
		t.Error("the reporter says something failed")
	}
}
