package choose

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
)

// withoutSoftware runs body as a program that does not link the software device in
// would: the registered device (the test binary's, from choose_test) is put aside.
func withoutSoftware(t *testing.T, body func()) {
	software.Lock()
	saved := software.dev
	software.dev = nil
	software.Unlock()
	defer func() {
		software.Lock()
		software.dev = saved
		software.Unlock()
	}()
	body()
}

func TestWithoutSoftwareDevice(t *testing.T) {
	missing := cudart.WithLibrary("/nonexistent/libcudart.so")
	withoutSoftware(t, func() {
		t.Setenv(RequireGPUEnv, "")
		c, err := Runtime(Software)
		require.ErrorIs(t, err, ErrNoSoftwareDevice)
		assert.Nil(t, c.Runtime)

		// No GPU and no software device: the error says both, and keeps the loader's.
		c, err = Runtime(Auto, missing)
		require.ErrorIs(t, err, ErrNoSoftwareDevice)
		require.ErrorIs(t, err, cudart.ErrNoRuntime)
		assert.Contains(t, err.Error(), cudart.LibraryEnv)
		assert.Nil(t, c.Runtime)

		assert.NoError(t, Violations(nil))
	})
}

type fakeDevice struct{}

func (fakeDevice) New() cudart.Runtime             { return nil }
func (fakeDevice) Violations(cudart.Runtime) error { return nil }

func TestRegisterSoftware(t *testing.T) {
	withoutSoftware(t, func() {
		assert.PanicsWithValue(t, "choose: RegisterSoftware of a nil device", func() { RegisterSoftware(nil) })
		RegisterSoftware(fakeDevice{})
		assert.PanicsWithValue(t, "choose: RegisterSoftware called twice", func() { RegisterSoftware(fakeDevice{}) })
	})
}
