//go:build cudapool_softdevice

package main

// Built with -tags cudapool_softdevice, kvpoold links the software device in, for
// -runtime test and for "auto" where there is no GPU (the tests of capi and python
// build it so). Without the tag it serves GPUs only.
import _ "github.com/cudapool/cudapool/cudart/choose/softdevice"
