package replica

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/keep"
)

// HostTier is the host tier of the replica's device, as [Dial] mapped it: the owner's
// memfd of pinned host memory, read-only here. Holding it keeps the tier's memory
// alive as long as the replica lives (the memfd is freed when the last process that
// maps it lets go), and lets the replica read host pages by itself: host page p is
// Mem[p*PageBytes:(p+1)*PageBytes], every layer's K then V piece, layer by layer. Which
// hash a host page holds is the owner's to say; a match restores host pages into
// slab pages itself (owner.WithHostBytes).
type HostTier struct {
	Mem       []byte
	Pages     int
	PageBytes uint64
}

// HostTier is the device's host tier, mapped at [Dial] until Close; ok is false where
// the owner has none.
func (r *Replica) HostTier() (t HostTier, ok bool) {
	if r.host == nil {
		return HostTier{}, false
	}
	return *r.host, true
}

// dialHostTier asks the owner serving dir for the memfd of device dev's host tier and
// maps it. Without a host tier socket (an owner without tiers), or where the owner has
// no tier on dev, it returns nil and no error; a socket that answers badly, or refuses
// this process or its version, is an error.
func dialHostTier(ctx context.Context, dir string, dev int) (*HostTier, error) {
	info, fd, err := keep.AskHostTier(ctx, filepath.Join(dir, kv.HostSocket), dev)
	switch {
	case errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, keep.ErrNoTier):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("kv/replica: the host tier's socket: %w", err)
	}
	defer func() { _ = unix.Close(fd) }() // cleanup: the mapping keeps the memory
	if info.PageBytes == 0 || info.Bytes != uint64(info.Pages)*info.PageBytes {
		return nil, fmt.Errorf("kv/replica: the host tier's socket answered an inconsistent tier %+v", info)
	}
	return mapHostTier(fd, info)
}

// mapHostTier maps the tier's memfd read-only once it has checked that it is sealed
// against shrinking (so that no page of the mapping can vanish under a read) and as
// large as info says.
func mapHostTier(fd int, info keep.HostTier) (*HostTier, error) {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return nil, fmt.Errorf("kv/replica: the host tier's memfd: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("kv/replica: the host tier's memfd: %w", err)
	}
	switch {
	case seals&unix.F_SEAL_SHRINK == 0:
		return nil, errors.New("kv/replica: the host tier's memfd is not sealed against shrinking")
	case uint64(st.Size) != info.Bytes || info.Bytes == 0 || info.Bytes > 1<<50:
		return nil, fmt.Errorf("kv/replica: the host tier's memfd has %d bytes, the owner says %d", st.Size, info.Bytes)
	}
	mem, err := unix.Mmap(fd, 0, int(info.Bytes), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("kv/replica: mapping the host tier: %w", err)
	}
	return &HostTier{Mem: mem, Pages: int(info.Pages), PageBytes: info.PageBytes}, nil
}

// unmap unmaps the tier, if mapped.
func (t *HostTier) unmap() error {
	if t == nil || t.Mem == nil {
		return nil
	}
	err := unix.Munmap(t.Mem)
	t.Mem = nil
	return err
}
