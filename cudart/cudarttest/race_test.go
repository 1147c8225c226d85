//go:build linux

package cudarttest

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/cudapool/cudapool/cudart"
	"github.com/stretchr/testify/require"
)

// Many goroutines allocate, fill, check and free in one pool: overlapping allocations
// would show as corrupted patterns, lost bookkeeping as used memory left over.
func TestConcurrentAllocFree(t *testing.T) {
	d := newFx(t)
	p := d.pool(ipcProps(0))
	const workers, rounds = 8, 200
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			var held []cudart.DevicePtr
			var want [][]byte
			for i := range rounds {
				size := 1 + rng.Uint64N(64<<10)
				ptr, err := d.MallocFromPoolAsync(0, size, p, 0)
				if err != nil {
					errs <- err
					return
				}
				pattern := bytes.Repeat([]byte{byte(w), byte(i)}, int(size+1)/2)[:size]
				if err := d.MemcpyHtoDAsync(0, ptr, pattern, 0); err != nil {
					errs <- err
					return
				}
				held, want = append(held, ptr), append(want, pattern)
				if len(held) > 8 || i == rounds-1 {
					for j := range held {
						got := make([]byte, len(want[j]))
						if err := d.MemcpyDtoHAsync(0, got, held[j], 0); err != nil || !bytes.Equal(got, want[j]) {
							errs <- errors.Join(err, errors.New("an allocation's bytes changed under it"))
							return
						}
						if err := d.FreeAsync(0, held[j], 0); err != nil {
							errs <- err
							return
						}
					}
					held, want = held[:0], want[:0]
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, d.sync())
	require.Zero(t, d.attr(p, cudart.PoolUsedMemCurrent), "used after every allocation was freed")
	require.NoError(t, d.Err())
}

// An import racing the exporter's free of the same allocation must end one of two
// ways: the import holds a slot and the exporter saw it (a violation), or the import
// is stale. An import holding memory the exporter freed silently is the bug.
func TestImportRacingExporterFree(t *testing.T) {
	s := newShared(t)
	for range 300 {
		ptr := s.exp.alloc(s.pool, 512)
		rec := s.exp.exportPtr(ptr)
		var freeErr, importErr error
		var iptr cudart.DevicePtr
		var wg sync.WaitGroup
		wg.Go(func() { freeErr = s.exp.FreeAsync(0, ptr, 0) })
		wg.Go(func() { iptr, importErr = s.imp.MemPoolImportPointer(0, s.ipool, rec) })
		wg.Wait()
		require.NoError(t, importErr)
		freeErr = errors.Join(freeErr, s.exp.sync())
		if freeErr != nil {
			require.ErrorIs(t, freeErr, ErrViolation)
		}
		s.imp.mu.Lock()
		p := s.imp.pools[s.ipool]
		imp, _ := p.importAt(uint64(iptr)-p.base, 1)
		stale := imp.stale
		s.imp.mu.Unlock()
		require.True(t, stale || freeErr != nil, "an import outlived the exporter's free unnoticed")
		require.NoError(t, s.imp.FreeAsync(0, iptr, 0))
		require.NoError(t, s.imp.sync())
	}
}
