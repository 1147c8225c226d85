package main

// The tests run kvpoold on the software device.
import _ "github.com/cudapool/cudapool/cudart/choose/softdevice"
