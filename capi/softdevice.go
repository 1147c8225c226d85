//go:build cgo && cudapool_softdevice

package main

// Built with -tags cudapool_softdevice, libcudapool links the software device in, for
// its test mode: cudapool_init("test"), and "auto" where there is no GPU, run on it.
// Without the tag the library offers the GPU only.
import _ "github.com/cudapool/cudapool/cudart/choose/softdevice"

func init() { softDeviceLinked = true }
