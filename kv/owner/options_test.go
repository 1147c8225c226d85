package owner_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/kv/owner"
)

// Listen's options: a nil one is skipped, WithAnnounceDir announces the slab exporter
// where it says, and WithoutAnnounce, given later, leaves the announcement out.
func TestListenOptions(t *testing.T) {
	for _, c := range []struct {
		name      string
		announced int
		without   bool
	}{{"announced", 1, false}, {"without", 0, true}} {
		t.Run(c.name, func(t *testing.T) {
			dir, ann := filepath.Join(t.TempDir(), "kv"), filepath.Join(t.TempDir(), "ann")
			require.NoError(t, discover.EnsureDir(ann))
			dev := cudarttest.ForTest(t)
			opts := []owner.Option{nil, owner.WithAnnounceDir(ann), nil}
			if c.without {
				opts = append(opts, owner.WithoutAnnounce())
			}
			o, err := owner.Listen(dir, dev, small, opts...)
			require.NoError(t, err)
			as, err := discover.Discover(ann)
			require.NoError(t, err)
			assert.Len(t, as, c.announced, "announcements in %s: %+v", ann, as)
			for _, a := range as {
				assert.Equal(t, filepath.Join(dir, owner.SlabSocket), a.Socket)
			}
			require.NoError(t, o.Close(bound(t)))
			assert.NoError(t, dev.Err(), "the owner's device saw broken rules")
			_, err = os.Stat(filepath.Join(dir, owner.PageSocket))
			assert.ErrorIs(t, err, os.ErrNotExist, "Close left the page socket")
		})
	}
}

// WithDevices keeps its own copy of the devices: changing the caller's slice after
// the option was made changes nothing.
func TestWithDevicesCopiesItsArgument(t *testing.T) {
	devs := []int{0}
	opt := owner.WithDevices(devs...)
	devs[0] = 7 // a device the software device does not have
	dev := cudarttest.ForTest(t)
	o, err := owner.Listen(t.TempDir(), dev, small, opt, owner.WithoutAnnounce())
	require.NoError(t, err)
	st := o.Stats()
	require.Len(t, st.Devices, 1)
	assert.Equal(t, 0, st.Devices[0].Device)
	require.NoError(t, o.Close(bound(t)))
}
