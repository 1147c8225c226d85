//go:build cgo && linux

package cudart_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
)

// A contained error loses the process's context for good (FACTS 14): the failing call
// and every later one, on any device and whatever its code, say the process must
// restart. The fake fails a memset of 226 as the driver fails a read of a dead peer's
// memory over NVLink.
func TestFakeContainedErrorLosesTheContext(t *testing.T) {
	rt := loadFake(t)
	const dev, other = 1, 0
	p, err := rt.MemPoolCreate(cudart.PoolProps{HandleTypes: cudart.HandleTypePosixFD, Location: cudart.DeviceLocation(dev)})
	require.NoError(t, err)
	s, err := rt.StreamCreate(dev, cudart.StreamNonBlocking)
	require.NoError(t, err)
	ptr, err := rt.MallocFromPoolAsync(dev, 1<<20, p, s)
	require.NoError(t, err)

	// Before: an ordinary failure says nothing of the context.
	_, err = rt.MallocFromPoolAsync(dev, 1<<20, 0, s)
	require.Error(t, err)
	assert.NotErrorIs(t, err, cudart.ErrContextLost)

	err = rt.MemsetAsync(dev, ptr, 226, 1<<20, s)
	require.ErrorIs(t, err, cudart.ErrContained)
	assert.ErrorIs(t, err, cudart.ErrContextLost)
	assert.Contains(t, err.Error(), "restart the process")

	_, err = rt.MallocFromPoolAsync(dev, 1<<20, p, s)
	require.ErrorIs(t, err, cudart.ErrContained, "the error is sticky on the device that hit it")
	assert.ErrorIs(t, err, cudart.ErrContextLost)

	_, err = rt.StreamCreate(other, cudart.StreamNonBlocking)
	require.ErrorIs(t, err, cudart.ErrDevicesUnavailable, "another device answers 46 after a contained error")
	assert.ErrorIs(t, err, cudart.ErrContextLost, "46 after a contained error means the context is lost too")
	var e *cudart.Error
	require.True(t, errors.As(err, &e))
	assert.True(t, e.ContextLost)
}

// A 46 of a process that never saw a contained error is only what it says.
func TestDevicesUnavailableAloneKeepsTheContext(t *testing.T) {
	err := cudart.NewError("cudaSetDevice", cudart.ErrDevicesUnavailable)
	assert.ErrorIs(t, err, cudart.ErrDevicesUnavailable)
	assert.NotErrorIs(t, err, cudart.ErrContextLost)
	err = cudart.NewError("cudaMemcpyAsync", cudart.ErrContained)
	assert.ErrorIs(t, err, cudart.ErrContextLost, "226 itself always means the context is lost")
	assert.Equal(t, "cudaErrorContained", cudart.ErrContained.Name())
}
