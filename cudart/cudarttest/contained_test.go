//go:build linux

package cudarttest

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
)

// sharedWithReplica shares 4096 bytes of device 0 holding data with an importer that
// reads them from device 1 (iptr), and gives it room for a replica on device 1, in a
// pool of its own (local) that device 0 may write.
func sharedWithReplica(t *testing.T, data string) (s shared, iptr cudart.DevicePtr, local cudart.MemPool, replica cudart.DevicePtr) {
	s = newShared(t)
	require.NoError(t, s.imp.MemPoolSetAccess(0, s.ipool, []cudart.AccessDesc{{Location: cudart.DeviceLocation(1), Flags: cudart.AccessReadWrite}}))
	_, iptr = s.share(4096, []byte(data))
	local = s.imp.pool(ipcProps(1))
	// The owner device writes the replica: its pool must grant it.
	require.NoError(t, s.imp.MemPoolSetAccess(1, local, []cudart.AccessDesc{{Location: cudart.DeviceLocation(0), Flags: cudart.AccessReadWrite}}))
	replica, err := s.imp.MallocFromPoolAsync(1, 4096, local, 0)
	require.NoError(t, err)
	require.NoError(t, s.imp.StreamSynchronize(1, 0))
	return s, iptr, local, replica
}

// FACTS 14: once the exporter is gone, its memory is still read through the owner
// device, a copy issued there into another device's memory still works, but a read
// from a peer device is contained: it fails with cudaErrorContained and the
// importer's context is lost for good, on every device.
func TestPeerReadOfDeadExportersMemoryLosesTheContext(t *testing.T) {
	s, iptr, local, replica := sharedWithReplica(t, "before the exporter died")

	require.NoError(t, s.exp.Close())
	require.NoError(t, s.imp.MemcpyDtoDAsync(0, replica, iptr, 4096, 0), "a copy through the owner device survives its exporter")
	require.NoError(t, s.imp.StreamSynchronize(0, 0))
	got := make([]byte, 24)
	require.NoError(t, s.imp.MemcpyDtoHAsync(1, got, replica, 0))
	assert.Equal(t, "before the exporter died", string(got))
	s.imp.wantBytes(iptr, []byte("before the exporter died"))
	assert.False(t, s.imp.ContextLost())

	err := s.imp.MemcpyDtoHAsync(1, got, iptr, 0)
	require.ErrorIs(t, err, cudart.ErrContained)
	assert.ErrorIs(t, err, cudart.ErrContextLost)
	assert.True(t, s.imp.ContextLost())

	_, err = s.imp.MallocFromPoolAsync(1, 4096, local, 0)
	assert.ErrorIs(t, err, cudart.ErrContained, "sticky on the device that read")
	assert.ErrorIs(t, err, cudart.ErrContextLost)
	_, err = s.imp.StreamCreate(0, cudart.StreamNonBlocking)
	assert.ErrorIs(t, err, cudart.ErrDevicesUnavailable, "another device of the process answers 46")
	assert.ErrorIs(t, err, cudart.ErrContextLost)
	_, err = s.imp.MemPoolCreate(ipcProps(0))
	assert.ErrorIs(t, err, cudart.ErrContextLost)
	_, err = s.imp.DeviceCount()
	assert.ErrorIs(t, err, cudart.ErrContextLost)

	// Other processes are unaffected (FACTS 14: a third process ran throughout).
	other := newFx(t)
	p := other.pool(ipcProps(1))
	_, err = other.MallocFromPoolAsync(1, 4096, p, 0)
	assert.NoError(t, err)
}

// A peer device reads a live exporter's memory, and the owner device a dead one's,
// without losing anything: only the combination is contained.
func TestPeerReadOfLiveExporterIsFine(t *testing.T) {
	s := newShared(t)
	require.NoError(t, s.imp.MemPoolSetAccess(0, s.ipool, []cudart.AccessDesc{{Location: cudart.DeviceLocation(1), Flags: cudart.AccessRead}}))
	_, iptr := s.share(512, []byte("alive"))
	require.NoError(t, s.imp.EventSynchronize(0, mustEvent(t, s)))
	got := make([]byte, 5)
	require.NoError(t, s.imp.MemcpyDtoHAsync(1, got, iptr, 0))
	assert.Equal(t, "alive", string(got))
	assert.False(t, s.imp.ContextLost())
}

// A copy queued before the exporter dies and run after it is judged as it runs (on the
// GPU host, copies in flight on the peer's stream failed as the producer was killed,
// and those on the owner's stream all succeeded): through the owner device it reads
// the right bytes; on the peer device's stream it is contained, and the context lost.
func TestCopyInFlightAsTheExporterDies(t *testing.T) {
	for _, tc := range []struct {
		name      string
		dev       int
		contained bool
	}{{"owner's stream", 0, false}, {"peer's stream", 1, true}} {
		t.Run(tc.name, func(t *testing.T) {
			s, iptr, _, replica := sharedWithReplica(t, "in flight")
			st, err := s.imp.StreamCreate(tc.dev, cudart.StreamNonBlocking)
			require.NoError(t, err)
			resume, err := s.imp.Stall(tc.dev, st)
			require.NoError(t, err)
			require.NoError(t, s.imp.MemcpyDtoDAsync(tc.dev, replica, iptr, 4096, st), "the exporter lives as the copy is queued")

			require.NoError(t, s.exp.Close())
			resume()
			err = s.imp.StreamSynchronize(tc.dev, st)
			if tc.contained {
				require.ErrorIs(t, err, cudart.ErrContained)
				assert.ErrorIs(t, err, cudart.ErrContextLost)
				assert.True(t, s.imp.ContextLost())
				return
			}
			require.NoError(t, err)
			got := make([]byte, 9)
			require.NoError(t, s.imp.MemcpyDtoHAsync(1, got, replica, 0))
			assert.Equal(t, "in flight", string(got))
			assert.False(t, s.imp.ContextLost())
		})
	}
}
