package replica

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/keep"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/internal/slabmap"
)

// The slab on the VMM route (package kv, Layout): the replica reserves each region's
// addresses once, for the slab's bound, and maps the chunks whose descriptors the
// owner sends on the connection (Grow frames), in place: the Welcome's at Dial, and
// each growth's as its Grow is read, before any frame after it, so that a reply
// granting a page in a new chunk finds it mapped.

// link is one connection's reading side: its frames, and the descriptor that comes
// with a frame (kvwire.Reader.TakeFD).
type link struct {
	rd *kvwire.Reader
	nc *net.UnixConn
}

func newLink(nc *net.UnixConn) *link { return &link{rd: kvwire.NewReader(), nc: nc} }

// frame reads l's next frame, waiting for it or not ([session.ErrNoFrame]), with the
// descriptor that came with it (-1: none), which the caller owns.
func (l *link) frame(wait bool) (kvwire.Header, []byte, int, error) {
	h, p, err := l.rd.NextWait(l.nc, wait)
	if err != nil {
		return h, p, -1, err
	}
	return h, p, l.rd.TakeFD(), nil
}

// next returns the next frame of l that is neither a Grow nor a Shrink, waiting for it
// or not, mapping the chunk of every Grow before it into m and unmapping what every
// Shrink gives back. A descriptor that came with any other frame is closed. A Grow or
// Shrink that breaks the protocol fails with an error wrapping kvwire.ErrMalformed.
func (l *link) next(m *slabmap.Map, wait bool) (kvwire.Header, []byte, error) {
	for {
		h, p, fd, err := l.frame(wait)
		switch {
		case err == nil && h.Type == kvwire.TypeGrow:
			err = grow(m, p, fd)
		case err == nil && h.Type == kvwire.TypeShrink:
			closeFD(fd)
			err = shrink(m, p)
		default:
			closeFD(fd)
			return h, p, err
		}
		if err != nil {
			return h, nil, err
		}
	}
}

// shrink unmaps the chunks that the Shrink of payload p gives back. Their pages are
// given back: no lease of this replica holds one.
func shrink(m *slabmap.Map, p []byte) error {
	s, err := kvwire.DecodeShrink(p)
	if err != nil {
		return err
	}
	return keepChunks(m, int(s.Chunks))
}

// keepChunks unmaps m's chunks past the first keep; more than m maps fails with an
// error wrapping kvwire.ErrMalformed.
func keepChunks(m *slabmap.Map, keep int) error {
	have := m.Chunks()
	if keep > have {
		return fmt.Errorf("%w: Shrink to %d chunks, where %d are mapped", kvwire.ErrMalformed, keep, have)
	}
	if err := m.Shrink(have - keep); err != nil {
		return fmt.Errorf("kv/replica: unmapping chunks %d to %d: %w", keep, have-1, err)
	}
	return nil
}

// await reads l until m has n chunks mapped: the Grow frames that follow a Welcome.
// Any other frame first fails with an error wrapping kvwire.ErrMalformed.
func (l *link) await(m *slabmap.Map, n int) error {
	for m.Chunks() < n {
		h, p, fd, err := l.frame(true)
		if err != nil {
			return err
		}
		if h.Type != kvwire.TypeGrow {
			closeFD(fd)
			return fmt.Errorf("%w: %s where the Welcome's chunks (%d of %d mapped) were due", kvwire.ErrMalformed, h.Type, m.Chunks(), n)
		}
		if err := grow(m, p, fd); err != nil {
			return err
		}
	}
	return nil
}

// grow maps the chunk of the Grow of payload p, whose descriptor fd came with it (-1:
// none), unless m has it mapped already (a reconnection's Welcome sends every chunk
// again). It closes fd.
func grow(m *slabmap.Map, p []byte, fd int) error {
	defer closeFD(fd)
	g, err := kvwire.DecodeGrow(p)
	if err != nil {
		return err
	}
	have, i := m.Chunks(), int(g.Chunk)
	switch {
	case fd < 0:
		return fmt.Errorf("%w: Grow of chunk %d came without its descriptor", kvwire.ErrMalformed, i)
	case i > have || i >= m.Layout().Chunks():
		return fmt.Errorf("%w: Grow of chunk %d, where %d of %d are mapped", kvwire.ErrMalformed, i, have, m.Layout().Chunks())
	case i < have:
		return nil
	}
	if err := m.Import(i, []int{fd}); err != nil {
		return fmt.Errorf("kv/replica: mapping chunk %d: %w", i, err)
	}
	return nil
}

// closeFD closes fd, a descriptor nobody uses, unless it is -1.
func closeFD(fd int) {
	if fd >= 0 {
		_ = unix.Close(fd) // cleanup: nothing is left to do if closing fails
	}
}

// Layout is how the slab lies in its regions and chunks.
func (r *Replica) Layout() kv.SlabLayout { return r.layout }

// Mapped is how many chunks of the slab are mapped in this process, and the pages
// they hold: a page the owner grants is below it. It grows as the owner's growths
// are read (the next request's reply, at the latest).
func (r *Replica) Mapped() (chunks, pages int) {
	n := r.m.Chunks()
	return n, r.layout.MappedPages(n)
}

// Regions are the regions' addresses in this process, on the replica's device:
// region r (kv.SlabLayout.Region) at Regions()[r], a tensor [Pages, TokensPerPage,
// KVHeads, HeadDim] of which the first MappedPages are mapped. They are the
// [Replica]'s own: do not modify them.
func (r *Replica) Regions() []cudart.DevicePtr { return r.m.Bases() }

// holdKeeper connects to the keeper of the slab's chunks (pid, as the Welcome named
// it) on the directory's keep.sock, as a holder, and holds the connection while the
// replica maps the slab: the keeper stays while anyone does, an owner or not, so that
// a restarted owner finds the slab. Once the keeper hangs up (it stopped or died), the
// slab is gone for every later owner, and the replica stops (stranded), as its
// connection does. It fails where no keeper answers there, or another than the
// Welcome's; then nothing is held.
func (r *Replica) holdKeeper(ctx context.Context, pid int) error {
	c, err := keep.Dial(ctx, filepath.Join(r.dir, keep.Socket), keep.RoleHolder)
	if err != nil {
		return fmt.Errorf("kv/replica: the slab's keeper (pid %d): %w", pid, err)
	}
	if c.KeeperPID() != pid {
		_ = c.Close() // cleanup: the mismatch is the error returned
		return fmt.Errorf("%w: the keeper on %s is pid %d, not the slab's (pid %d)", kv.ErrOwnerGone, keep.Socket, c.KeeperPID(), pid)
	}
	stop := make(chan struct{})
	r.stopKeeper = sync.OnceFunc(func() {
		close(stop)
		_ = c.Close() // cleanup: nothing is left to do if closing fails
	})
	go func() {
		<-c.Done()
		select {
		case <-stop:
			return // the replica let go
		default:
		}
		r.mu.Lock()
		r.stranded = true
		nc := r.nc
		r.mu.Unlock()
		close(r.keeperGone)
		r.failConn(nc, fmt.Errorf("the slab's keeper (pid %d) hung up, and the slab is gone with it: %w", pid, c.Err()))
	}()
	return nil
}

// mappedPages is the pages mapped, the bound a reply's pages are checked against:
// the Grow frames before the reply have been mapped.
func (r *Replica) mappedPages() int { return r.layout.MappedPages(r.m.Chunks()) }
