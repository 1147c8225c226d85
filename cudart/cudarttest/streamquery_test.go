package cudarttest_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
)

// StreamQuery says false while work queued on the stream has not run (a stall holds
// it) and true once it has, queueing nothing itself.
func TestStreamQuery(t *testing.T) {
	d := cudarttest.ForTest(t)
	var q cudart.StreamQuerier = d
	s, err := d.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	done, err := q.StreamQuery(0, s)
	require.NoError(t, err)
	assert.True(t, done, "a new stream has nothing queued")
	resume, err := d.Stall(0, s)
	require.NoError(t, err)
	done, err = q.StreamQuery(0, s)
	require.NoError(t, err)
	assert.False(t, done, "a stalled stream")
	resume()
	require.NoError(t, d.StreamSynchronize(0, s))
	done, err = q.StreamQuery(0, s)
	require.NoError(t, err)
	assert.True(t, done, "its work has run")
	_, err = q.StreamQuery(0, cudart.Stream(12345))
	assert.ErrorIs(t, err, cudart.ErrInvalidResourceHandle)
	require.NoError(t, d.StreamDestroy(0, s))
}
