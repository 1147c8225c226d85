package owner

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/keep"
)

// The keeper holds file descriptors for the page servers that come and go, on
// dir/keep.sock (KeepSocket; the keeper protocol, kv/internal/keep and
// docs/PROTOCOL.md): each under a name, until the page server drops it or the keeper
// stops. It needs no runtime for them (KeepFiles): an fd alone keeps the memory it
// names alive, and the keeper maps nothing. A page server of a keeper's slabs
// (WithKeeper) holds one connection to it for its life, and a replica one while it maps
// the slab (a holder's, which asks nothing): the keeper's Clients, and the page
// server's KeeperGone, or the replica's stop, when the keeper dies.
//
// The host tiers' memory outlives the page server this way: the page server makes each
// device's memfd and puts it in the keeper under "kv/host/DEVICE", or, restarted,
// takes back the one the keeper holds. The page server makes the memfd, not the
// keeper, so that the keeper needs no host tier setting and a new -host-bytes needs
// no new keeper: a memfd of another size is replaced (the old tier dropped, and the
// page server says why in Recovery.Dropped).
//
// The keeper holds the memory only. The host pages' index is journaled with the slab's
// pages in the index file (WithIndex, journal.go): a host page is sealed there
// once its spill copy has completed, and its eviction is written out before the page
// is filled again, so a page whose copy had not completed never comes back. A
// restarted page server that takes back both the index and the kept memfd restores
// those host pages (Recovery.HostPages); with a memfd made anew (none kept, or one of
// another size) the index's host pages are dropped.

// KeepSocket is the keeper's socket, in an owner's directory, that holds file
// descriptors by name (kv/internal/keep).
const KeepSocket = keep.Socket

// KeeperLock is the file a live keeper holds (flock) in its directory.
const KeeperLock = "keeper.lock"

// keptFiles is what a Keeper serves on dir/keep.sock.
type keptFiles struct {
	dir  string
	lock *os.File
	fds  *keep.Server
	srv  *session.Server
}

// KeepFiles makes a [Keeper] on dir that holds file descriptors alone: no slab, and no
// runtime is made or called. The logger and limits of opts apply; the others have no
// effect. A live keeper on dir makes it fail naming it; on failure nothing is left
// behind.
func KeepFiles(dir string, opts ...Option) (*Keeper, error) {
	o := optionsOf(kv.Geometry{}, opts)
	made, err := makeDir(dir, false)
	if err != nil {
		return nil, err
	}
	k := &Keeper{}
	if err := k.files.serve(dir, o); err != nil {
		if made != "" {
			_ = os.RemoveAll(made) // cleanup: what KeepFiles made goes; the first error is the one returned
		}
		return nil, err
	}
	return k, nil
}

// serve takes dir/keeper.lock and serves dir/keep.sock. On failure nothing is left.
func (f *keptFiles) serve(dir string, o options) error {
	lock, err := lockDir(dir, KeeperLock, "a keeper")
	if err != nil {
		return err
	}
	ln, err := listenPages(filepath.Join(dir, KeepSocket), false)
	if err != nil {
		_ = lock.Close() // cleanup: the listen's error is the one returned
		return err
	}
	f.dir, f.lock, f.fds = dir, lock, keep.NewServer(o.Logger)
	f.srv = session.Serve(ln, o.Logger, "kv/owner: the keeper's descriptors", o.Limits, f.fds.Serve)
	return nil
}

// close stops dir/keep.sock and closes the descriptors kept: the memory each names
// lives on while a process holds or maps it. It says false if they were closed
// before.
func (f *keptFiles) close() bool {
	if f.srv == nil {
		return false
	}
	f.srv.Close()
	_ = os.Remove(filepath.Join(f.dir, KeepSocket)) // best effort: the next keeper replaces a stale socket
	f.fds.Close()
	_ = f.lock.Close() // cleanup: closing it is what lets the lock go
	f.srv = nil
	return true
}

// Clients counts the connections to the keeper now: the page servers', and the
// replicas' that map the chunks (each holds one while it maps them).
func (k *Keeper) Clients() int { return k.files.fds.Clients() }

// dialKeeper connects to the keeper's dir/keep.sock for the page server's life,
// within keeperTimeout. Where no keeper listens there, it starts one with
// WithKeeper's start, if it has one, and dials it; started says it did.
func (o *Owner) dialKeeper() (started bool, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), keeperTimeout)
	defer cancel()
	path := filepath.Join(o.dir, KeepSocket)
	c, err := keep.Dial(ctx, path, keep.RoleServer)
	if (errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED)) && o.opts.StartKeeper != nil {
		if err := o.opts.StartKeeper(ctx); err != nil {
			return false, fmt.Errorf("kv/owner: starting the keeper: %w", err)
		}
		started = true
		c, err = keep.Dial(ctx, path, keep.RoleServer)
	}
	if err != nil {
		return started, fmt.Errorf("kv/owner: the keeper's descriptors: %w", err)
	}
	o.keeper = c
	return started, nil
}

// watchKeeper makes KeeperGone's channel, closed once the keeper's keep.sock
// connection ends; the owner then says so, unless it is closing.
func (o *Owner) watchKeeper() {
	gone := make(chan struct{})
	o.keeperGone = gone
	files := o.keeper.Done()
	go func() {
		<-files
		if o.stopped.Err() == nil {
			o.log.Warn("kv: the keeper is gone, and with it the chunks and the host tiers' memory it kept", "pid", o.keeper.KeeperPID(), "err", o.keeper.Err())
		}
		close(gone)
	}()
}

// tierName is the name the keeper keeps device dev's host tier's memfd under.
func tierName(dev int) string { return "kv/host/" + strconv.Itoa(dev) }

// keptTierFD returns the keeper's memfd of dev's host tier if it holds one of size
// bytes (kept true), else makes one with mk and puts it in the keeper, replacing any
// other. dropped says why an old one was not taken back ("" if there was none or it
// was). On failure no descriptor is left open.
func (o *Owner) keptTierFD(ctx context.Context, dev int, size uint64, mk func() (int, error)) (fd int, kept bool, dropped string, err error) {
	name := tierName(dev)
	fail := func(err error) (int, bool, string, error) {
		return -1, false, "", fmt.Errorf("kv/owner: the keeper's host tier of device %d: %w", dev, err)
	}
	fd, had, err := o.keeper.Take(ctx, name)
	switch {
	case errors.Is(err, keep.ErrNotKept):
	case err != nil:
		return fail(err)
	default:
		var st unix.Stat_t
		serr := unix.Fstat(fd, &st)
		if serr == nil && had == size && uint64(st.Size) == size {
			return fd, true, "", nil
		}
		_ = unix.Close(fd) // cleanup: replaced below
		switch {
		case serr != nil:
			dropped = fmt.Sprintf("device %d's host tier kept by the keeper cannot be read (%v): its pages are dropped", dev, serr)
		case had != uint64(st.Size):
			dropped = fmt.Sprintf("device %d's host tier kept by the keeper says %d bytes and has %d: its pages are dropped", dev, had, st.Size)
		default:
			dropped = fmt.Sprintf("device %d's host tier was of %d bytes, now %d: its pages are dropped", dev, had, size)
		}
	}
	if fd, err = mk(); err != nil {
		return -1, false, "", err
	}
	if err := o.keeper.Put(ctx, name, fd, size); err != nil {
		_ = unix.Close(fd) // cleanup: the keeper's refusal is the error returned
		return fail(err)
	}
	return fd, false, dropped, nil
}
