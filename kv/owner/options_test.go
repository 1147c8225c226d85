package owner_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/kv/owner"
)

// Listen's options: a nil one is skipped; Close removes the page socket.
func TestListenOptions(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "kv")
	dev := cudarttest.ForTest(t)
	o, err := owner.Listen(dir, dev, small, nil, owner.WithChunkBytes(2<<20), nil)
	require.NoError(t, err)
	assert.Equal(t, uint64(2<<20), o.Layout().ChunkBytes())
	require.NoError(t, o.Close(bound(t)))
	assert.NoError(t, dev.Err(), "the owner's device saw broken rules")
	_, err = os.Stat(filepath.Join(dir, owner.PageSocket))
	assert.ErrorIs(t, err, os.ErrNotExist, "Close left the page socket")
}

// WithDevices keeps its own copy of the devices: changing the caller's slice after
// the option was made changes nothing.
func TestWithDevicesCopiesItsArgument(t *testing.T) {
	devs := []int{0}
	opt := owner.WithDevices(devs...)
	devs[0] = 7 // a device the software device does not have
	dev := cudarttest.ForTest(t)
	o, err := owner.Listen(t.TempDir(), dev, small, opt)
	require.NoError(t, err)
	st := o.Stats()
	require.Len(t, st.Devices, 1)
	assert.Equal(t, 0, st.Devices[0].Device)
	require.NoError(t, o.Close(bound(t)))
}
