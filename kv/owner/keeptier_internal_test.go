package owner

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A page server that finds no keeper on keep.sock starts one with WithKeeper's
// start, once, and holds a connection to it; without a start it fails, naming the
// socket.
func TestDialKeeperStartsOne(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "kv")
	_, err := makeDir(dir, false)
	require.NoError(t, err)
	alone := &Owner{dir: dir}
	_, err = alone.dialKeeper()
	assert.ErrorContains(t, err, "the keeper's descriptors")
	assert.ErrorContains(t, err, KeepSocket)

	var k *Keeper
	starts := 0
	o := &Owner{dir: dir, opts: options{StartKeeper: func(context.Context) error {
		starts++
		var err error
		k, err = KeepFiles(dir)
		return err
	}}}
	started, err := o.dialKeeper()
	require.NoError(t, err)
	assert.True(t, started)
	assert.Equal(t, 1, starts)
	assert.Equal(t, 1, k.Clients())
	require.NoError(t, o.keeper.Close())
	require.NoError(t, k.Close(context.Background()))
}
