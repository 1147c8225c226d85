//go:build !cgo

// libcudapool is a C shared library, which only a cgo build makes: without cgo this
// package builds this stub alone, so that CGO_ENABLED=0 go build ./... builds the rest
// of the module, and says so if it is run.

package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "libcudapool needs cgo: go build -buildmode=c-shared -o bin/libcudapool.so ./capi, with CGO_ENABLED=1 and a C compiler")
	os.Exit(2)
}
