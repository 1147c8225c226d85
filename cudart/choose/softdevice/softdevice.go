// Package softdevice links the software device (cudart/cudarttest) into a program that
// imports it, for its side effect:
//
//	import _ "github.com/cudapool/cudapool/cudart/choose/softdevice"
//
// registers it with package choose, whose Software preference and Auto's fallback where
// there is no GPU then run on it. A program without the import links no software device.
package softdevice

import (
	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/cudart/cudarttest"
)

func init() { choose.RegisterSoftware(device{}) }

// device is cudarttest as choose.SoftwareDevice.
type device struct{}

func (device) New() cudart.Runtime { return cudarttest.New() }

func (device) Violations(rt cudart.Runtime) error {
	if d, ok := rt.(*cudarttest.Device); ok {
		return d.Err()
	}
	return nil
}
