//go:build cgo

package main

// The package's tests run on the software device, with or without the library's
// cudapool_softdevice tag.
import _ "github.com/cudapool/cudapool/cudart/choose/softdevice"
