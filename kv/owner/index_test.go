package owner_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/intercept"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/index"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// tempDir is a directory short enough for the owner's sockets.
func tempDir(t *testing.T) string {
	dir, err := os.MkdirTemp("", "kvo")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// sealPages allocates n pages through r, seals them under n fresh hashes (seed) and
// waits until they are visible.
func sealPages(t *testing.T, r *replica.Replica, n int, seed byte) []kv.Hash {
	w, err := r.Alloc(bound(t), n)
	require.NoError(t, err)
	hashes := make([]kv.Hash, n)
	for i := range hashes {
		hashes[i] = kv.Hash{seed, byte(i), 0x5e}
	}
	res, err := r.Seal(bound(t), w, hashes, 0, replica.WaitVisible())
	require.NoError(t, err)
	require.Equal(t, n, res.Visible)
	return hashes
}

// Only a regular file is an index: Listen with a named pipe at the index's path (which
// made it hang, opening the pipe to read it) or a link there fails at once, saying
// what is there, and leaves it alone.
func TestListenRefusesAnIndexThatIsNoFile(t *testing.T) {
	for _, c := range []struct {
		what string
		make func(path string) error
	}{
		{"a named pipe", func(path string) error { return unix.Mkfifo(path, 0o600) }},
		{"a symbolic link", func(path string) error { return os.Symlink(filepath.Join(t.TempDir(), "elsewhere"), path) }},
		{"a directory", func(path string) error { return os.Mkdir(path, 0o700) }},
	} {
		t.Run(c.what, func(t *testing.T) {
			dir := tempDir(t)
			path := filepath.Join(dir, owner.IndexFile)
			require.NoError(t, c.make(path))
			dev := cudarttest.ForTest(t)
			done := make(chan error, 1)
			go func() {
				o, err := owner.Listen(dir, dev, small, owner.WithIndex(path))
				if err == nil {
					err = o.Close(context.Background())
					if err == nil {
						err = os.ErrExist // no error: a failure of its own below
					}
				}
				done <- err
			}()
			err := testwait.Recv(t, done, "Listen with "+c.what+" at the index's path")
			require.ErrorIs(t, err, index.ErrNotRegular)
			assert.Contains(t, err.Error(), c.what)
			fi, err := os.Lstat(path)
			require.NoError(t, err, "left alone")
			assert.NotZero(t, fi.Mode().Type(), "left alone")
		})
	}
}

// The index is compacted through a file made anew: a link planted at index.new is not
// followed (it was: the file it named was overwritten with the index).
func TestIndexCompactionFollowsNoPlantedLink(t *testing.T) {
	dir := tempDir(t)
	path := filepath.Join(dir, owner.IndexFile)
	victim := filepath.Join(t.TempDir(), "victim")
	require.NoError(t, os.WriteFile(victim, []byte("precious"), 0o600))
	require.NoError(t, os.Symlink(victim, path+".new"))
	o, err := owner.Listen(dir, cudarttest.ForTest(t), small, owner.WithIndex(path))
	require.NoError(t, err)
	require.NoError(t, o.Close(bound(t)))
	b, err := os.ReadFile(victim)
	require.NoError(t, err)
	assert.Equal(t, "precious", string(b), "the link's target is untouched")
	fi, err := os.Lstat(path)
	require.NoError(t, err)
	assert.True(t, fi.Mode().IsRegular(), "the index is a file of its own")
}

// An index of another geometry is dropped, saying why; and an owner that makes its
// own slabs starts them empty, so an index of its own slabs from before (another
// Listen in the same process, whose keeper is the same process) is dropped too: its
// pages were in slabs that are gone (they were made visible again, over fresh slabs).
func TestIndexOfOtherSlabsIsDropped(t *testing.T) {
	dir := tempDir(t)
	path := filepath.Join(dir, owner.IndexFile)
	o, err := owner.Listen(dir, cudarttest.ForTest(t), small, owner.WithIndex(path))
	require.NoError(t, err)
	r, err := replica.Dial(bound(t), dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	sealPages(t, r, 3, 1)
	require.NoError(t, r.Close(bound(t)))
	require.NoError(t, o.Close(bound(t)))

	other := small
	other.Layers++
	o, err = owner.Listen(dir, cudarttest.ForTest(t), other, owner.WithIndex(path))
	require.NoError(t, err)
	rec := o.Recovery()
	assert.Zero(t, rec.Pages)
	assert.Contains(t, rec.Dropped, "the index is of ")
	assert.Contains(t, rec.Dropped, "not "+other.String())
	r, err = replica.Dial(bound(t), dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	sealPages(t, r, 3, 2)
	require.NoError(t, r.Close(bound(t)))
	require.NoError(t, o.Close(bound(t)))

	o, err = owner.Listen(dir, cudarttest.ForTest(t), other, owner.WithIndex(path))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close(bound(t))) })
	st := o.Stats()
	assert.Zero(t, st.Devices[0].Sealed, "no page of slabs that are gone is visible")
	assert.Zero(t, o.Recovery().Pages)
	assert.Contains(t, o.Recovery().Dropped, "this owner makes its own slabs")
}

// shapeOf is a shape that bounds whatever index the tests' owners write.
func shapeOf(g kv.Geometry, hostPages int) index.Shape {
	return index.Shape{Geometry: g, Devices: []int{0}, HostPages: hostPages, Replicas: 1 << 14}
}

// A host page is journaled once its spill copy has completed, not before (a restart
// would serve the bytes of a copy that never ended under the page's hash), and with
// the spill, not at the next unrelated write of the index (they were: a restart right
// after spills restored 2 of 4, 62 of 72, 10 of 20 spilled pages).
func TestHostPagesAreJournaledWithTheirSpill(t *testing.T) {
	g := small
	g.Pages = 16
	const hostPages = 32
	dir := tempDir(t)
	path := filepath.Join(dir, owner.IndexFile)
	sw := cudarttest.ForTest(t)
	rt := intercept.Wrap(sw)
	var mu sync.Mutex
	resumes := make(chan func(), 1)
	stalled := false
	rt.On.MemcpyBatchAsync.Before(func(dev int, _ []cudart.CopyPiece, s cudart.Stream) error {
		mu.Lock()
		defer mu.Unlock()
		if !stalled { // the first spill's copy stalls until resumed
			stalled = true
			resume, err := sw.Stall(dev, s)
			require.NoError(t, err)
			resumes <- resume
		}
		return nil
	})
	o, err := owner.Listen(dir, rt, g, owner.WithIndex(path), owner.WithHostBytes(hostPages*owner.HostPageBytes(g)))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close(bound(t))) })
	r, err := replica.Dial(bound(t), dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	t.Cleanup(func() { r.Close(bound(t)) })
	sealPages(t, r, 8, 1)

	resume := testwait.Recv(t, resumes, "the spill's copy")
	st, err := index.Load(path, shapeOf(g, hostPages))
	require.NoError(t, err)
	assert.Len(t, st.Sealed[0], 8, "the sealed pages are in the index")
	assert.Empty(t, st.Host[0], "no host page is journaled before its copy has completed")

	resume()
	require.NoError(t, o.WaitSpills(bound(t)))
	spilled := o.Stats().Devices[0].Host.Sealed
	require.NotZero(t, spilled)
	st, err = index.Load(path, shapeOf(g, hostPages))
	require.NoError(t, err)
	assert.Len(t, st.Host[0], spilled, "every spilled page is journaled once WaitSpills returns: a restart now restores them all")
}

// gate holds the index's writer, while shut, in its next write.
type gate struct {
	mu     sync.Mutex
	shut   bool
	open   chan struct{}
	inside chan struct{}
}

func newGate() *gate { return &gate{open: make(chan struct{}), inside: make(chan struct{}, 1)} }

func (g *gate) before() error {
	g.mu.Lock()
	shut, open := g.shut, g.open
	g.mu.Unlock()
	if shut {
		select {
		case g.inside <- struct{}{}:
		default:
		}
		<-open
	}
	return nil
}

func (g *gate) close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.shut = true
}

func (g *gate) reopen() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.shut = false
	close(g.open)
}

// The index is written off the owner's lock: with its writer held in a write (a disk
// that stalls), Stats is answered; an Alloc whose pages were evicted waits until the
// evictions are written (a restart would otherwise publish the pages it hands out
// under their old hashes), and is answered once they are; so does a Match, until its
// lease's grant is written (a restart would otherwise hand the pages its reader reads
// to a writer).
func TestIndexWritesOffTheOwnersLock(t *testing.T) {
	g := small
	g.Pages = 8
	gt := newGate()
	t.Cleanup(owner.SetIndexOptions(index.BeforeWrite(gt.before)))
	dir := tempDir(t)
	path := filepath.Join(dir, owner.IndexFile)
	o, err := owner.Listen(dir, cudarttest.ForTest(t), g, owner.WithIndex(path))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close(bound(t))) })
	r, err := replica.Dial(bound(t), dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	t.Cleanup(func() { r.Close(bound(t)) })
	hashes := sealPages(t, r, 8, 1)                                     // the whole slab
	other, err := replica.Dial(bound(t), dir, cudarttest.ForTest(t), 0) // admitted once the index has it: before the writer is held
	require.NoError(t, err)
	t.Cleanup(func() { other.Close(bound(t)) })
	_, err = other.Stats(bound(t)) // served: its admission is in the index (Dial returns at the Welcome, before that)
	require.NoError(t, err)

	gt.close()
	done := make(chan error, 1)
	go func() {
		_, err := r.Stats(bound(t))
		if err == nil {
			o.Stats()
		}
		done <- err
	}()
	require.NoError(t, testwait.Recv(t, done, "Stats while the index's writer is held"))

	allocated := make(chan *replica.Lease, 1)
	go func() {
		w, err := r.Alloc(bound(t), 2) // evicts two visible pages
		assert.NoError(t, err)
		allocated <- w
	}()
	testwait.Recv(t, gt.inside, "the index's writer at the evictions' records")
	select {
	case <-allocated:
		t.Fatal("an Alloc of evicted pages was answered before their evictions were written")
	default:
	}
	// Another replica is served meanwhile (this one's connection serves its requests
	// in order: its next waits for the Alloc's answer).
	_, err = other.Stats(bound(t))
	require.NoError(t, err, "another replica served while the Alloc waits")
	matched := make(chan error, 1)
	go func() {
		m, err := other.Match(bound(t), hashes[6:])
		if err == nil {
			err = other.Release(bound(t), m, 0)
		}
		matched <- err
	}()
	gt.reopen()
	require.NoError(t, testwait.Recv(t, matched, "the Match once its grant is written"))
	w := testwait.Recv(t, allocated, "the Alloc once the evictions are written")
	require.NotNil(t, w)
	st, err := index.Load(path, shapeOf(g, 0))
	require.NoError(t, err)
	assert.Len(t, st.Sealed[0], 6, "the evictions are in the index")
	_, err = r.Seal(bound(t), w, nil, 0)
	require.NoError(t, err)
}

// A restart after the index compacted keeps every host page and the LRU order: the
// compaction writes the pages least recent first (as a match left them, not as they
// were sealed), so the restarted owner evicts the same pages first.
func TestRestartAfterCompactionKeepsHostPagesAndLRUOrder(t *testing.T) {
	g := small
	g.Pages = 8
	const hostPages = 16
	const comings = 600 // replicas that come and go, below
	dir := tempDir(t)
	path := filepath.Join(dir, owner.IndexFile)
	k, err := owner.Keep(dir, cudarttest.ForTest(t), g)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, k.Close(bound(t))) })
	listen := func() *owner.Owner {
		// The replicas that come and go below are one process's connections, closed
		// one after another: the owner may not have seen the last ones end when the next
		// dials, so the per-process cap is set above their count.
		o, err := owner.Listen(dir, cudarttest.ForTest(t), g, owner.WithKeeper(nil),
			owner.WithIndex(path), owner.WithHostBytes(hostPages*owner.HostPageBytes(g)), owner.WithConnLimit(0, 2*comings))
		require.NoError(t, err)
		return o
	}
	first := listen()
	r, err := replica.Dial(bound(t), dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	a := sealPages(t, r, 4, 1)
	b := sealPages(t, r, 4, 2) // the slab is full
	m, err := r.Match(bound(t), a)
	require.NoError(t, err)
	require.NoError(t, r.Release(bound(t), m, 0)) // a is now more recent than b, sealed after it
	require.NoError(t, first.WaitSpills(bound(t)))
	host := first.Stats().Devices[0].Host.Sealed
	require.NotZero(t, host, "b's least recent pages are copied ahead to the host tier")

	// Replicas that come and go (an Attach and a Detach record each, as the owner sees
	// them) until the index compacts, and nothing else changes: the file shrinks to a
	// snapshot of the state, written least recent page first. How many it takes
	// depends on how many of their records the owner wrote before the next dialed.
	compacted := false
	for i, last := 0, int64(0); i < 10*comings && !compacted; i++ {
		raw := dialRaw(t, dir)
		raw.hello()
		raw.nc.Close()
		fi, err := os.Stat(path)
		require.NoError(t, err)
		compacted, last = fi.Size() < last, fi.Size()
	}
	require.True(t, compacted, "the index never compacted in %d replicas that came and went", 10*comings)
	require.NoError(t, r.Close(bound(t)))
	require.NoError(t, first.Close(bound(t)))

	second := listen()
	t.Cleanup(func() { assert.NoError(t, second.Close(bound(t))) })
	rec := second.Recovery()
	require.True(t, rec.Adopted, "%+v", rec)
	assert.Equal(t, 8, rec.Pages, "%+v", rec)
	assert.Equal(t, host, rec.HostPages, "every host page is restored: %+v", rec)
	r, err = replica.Dial(bound(t), dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	t.Cleanup(func() { r.Close(bound(t)) })
	w, err := r.Alloc(bound(t), 4) // evicts the 4 least recent pages: b's
	require.NoError(t, err)
	require.NoError(t, r.Release(bound(t), w, 0))
	m, err = r.Match(bound(t), a)
	require.NoError(t, err)
	assert.Len(t, m.Pages(), 4)
	assert.Zero(t, second.Stats().Devices[0].Host.Restores, "a, the more recent, stayed in the slab")
	require.NoError(t, r.Release(bound(t), m, 0))
	m, err = r.Match(bound(t), b)
	require.NoError(t, err)
	assert.Len(t, m.Pages(), 4, "b comes back from the host tier")
	assert.Equal(t, uint64(4), second.Stats().Devices[0].Host.Restores)
	require.NoError(t, r.Release(bound(t), m, 0))
}

// A host page evicted is out of the index before it is filled again: at every copy
// into a host page (a spill ahead, or an eviction's copy), the index on disk does not
// hold that page (a crash mid-copy would otherwise restore the page under its old
// hash, holding part of another's bytes). Host tier pressure: 4 host pages under a
// slab of 8, prompts sealed, evicted and restored in turn.
func TestHostPagesLeaveTheIndexBeforeTheyAreRefilled(t *testing.T) {
	g := small
	g.Pages = 8
	const hostPages = 4
	pageBytes := owner.HostPageBytes(g)
	dir := tempDir(t)
	path := filepath.Join(dir, owner.IndexFile)
	rt := intercept.Wrap(cudarttest.ForTest(t))
	var mu sync.Mutex
	var base cudart.DevicePtr
	fills, violations := 0, []string{}
	rt.On.HostDevicePointer.After(func(p cudart.DevicePtr, err error) (cudart.DevicePtr, error) {
		mu.Lock()
		defer mu.Unlock()
		base = p
		return p, err
	})
	rt.On.MemcpyBatchAsync.Before(func(_ int, pieces []cudart.CopyPiece, _ cudart.Stream) error {
		mu.Lock()
		defer mu.Unlock()
		filled := map[uint32]bool{}
		for _, pc := range pieces {
			if base != 0 && pc.Dst >= base && uint64(pc.Dst-base) < hostPages*pageBytes {
				filled[uint32(uint64(pc.Dst-base)/pageBytes)] = true
			}
		}
		if len(filled) == 0 {
			return nil // a restore: into the slab
		}
		var st *index.State
		var err error
		for range 100 { // the writer may be appending newer records: a tail cut short
			if st, err = index.Load(path, shapeOf(g, hostPages)); err == nil {
				break
			}
		}
		if err != nil {
			violations = append(violations, "the index cannot be read: "+err.Error())
			return nil
		}
		fills++
		for _, p := range st.Host[0] {
			if filled[p.Page] {
				violations = append(violations, fmt.Sprintf("host page %d is filled while the index holds it under %x", p.Page, p.Hash[:3]))
			}
		}
		return nil
	})
	o, err := owner.Listen(dir, rt, g, owner.WithIndex(path), owner.WithHostBytes(hostPages*pageBytes))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close(bound(t))) })
	r, err := replica.Dial(bound(t), dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	t.Cleanup(func() { r.Close(bound(t)) })
	var prompts [][]kv.Hash
	for round := range 12 {
		prompts = append(prompts, sealPages(t, r, 4, byte(round+1)))
		require.NoError(t, o.WaitSpills(bound(t)))
		if round >= 2 { // an older prompt back: restored from the host tier where it is there
			m, err := r.Match(bound(t), prompts[round-2])
			require.NoError(t, err)
			require.NoError(t, r.Release(bound(t), m, 0))
		}
	}
	require.NoError(t, o.WaitSpills(bound(t)))
	mu.Lock()
	defer mu.Unlock()
	assert.Empty(t, violations)
	host := o.Stats().Devices[0].Host
	assert.NotZero(t, host.Evictions, "host pages were evicted: %+v", host)
	assert.Greater(t, fills, int(hostPages), "host pages were filled again")
}
