// Command cmd writes internal/intercept's methods_gen.go from the cudart.Runtime
// interface; `go generate ./internal/intercept` runs it in that folder.
package main

import (
	"fmt"
	"os"

	"github.com/cudapool/cudapool/internal/intercept/internal/gen"
)

func main() {
	src, err := gen.Source(gen.CudartDir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := os.WriteFile(gen.File, src, 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "gen:", err)
		os.Exit(1)
	}
}
