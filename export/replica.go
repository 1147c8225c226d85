package export

import (
	"context"
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/pool"
)

// replicate turns src, a Mapping just opened (s already waits for the producer's
// writes), into a replica: memory of the Importer's device from a (nil: the device's
// default pool), filled from src on s, and src released after the copy. The replica
// holds no lease, and outlives its producer on any GPU.
//
// The copy runs on s, the consumer's own stream and device: it is ordered after the
// producer's writes by the wait Open queued there, and src's release is ordered after
// it by Release's own ordering on s. (cudart's GPU probe of FACTS 14 reports whether a
// copy in flight when the producer is killed survives better through the owner GPU.)
func (imp *Importer) replicate(ctx context.Context, src *Mapping, s cudart.Stream, a pool.Allocator) (*Mapping, error) {
	if a == nil {
		var err error
		if a, err = imp.defaultPool(); err != nil {
			return nil, errors.Join(err, src.Release(ctx, s))
		}
	}
	if a.Device() != imp.dev {
		return nil, errors.Join(fmt.Errorf("the replica's allocator is on device %d, the Importer on %d", a.Device(), imp.dev), src.Release(ctx, s))
	}
	b, err := a.Alloc(ctx, src.size, s)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("allocate the replica: %w", err), src.Release(ctx, s))
	}
	if err := imp.rt.MemcpyDtoDAsync(imp.dev, b.Ptr(), src.ptr, src.size, s); err != nil {
		return nil, errors.Join(fmt.Errorf("copy into the replica: %w", err), a.Free(b, s), src.Release(ctx, s))
	}
	if err := src.Release(ctx, s); err != nil {
		return nil, errors.Join(err, a.Free(b, s))
	}
	r := &Mapping{imp: imp, ptr: b.Ptr(), size: src.size, name: src.name, meta: src.meta, replica: b, replicaFrom: a, refs: 1}
	r.ctx, r.cancel = context.WithCancelCause(context.Background())
	return r, nil
}

// defaultPool is the Importer's device's default pool, made on first use.
func (imp *Importer) defaultPool() (pool.Allocator, error) {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	if imp.localPool == nil {
		p, err := pool.FromDefault(imp.rt, imp.dev)
		if err != nil {
			return nil, fmt.Errorf("the default pool of device %d: %w", imp.dev, err)
		}
		imp.localPool = p
	}
	return imp.localPool, nil
}
