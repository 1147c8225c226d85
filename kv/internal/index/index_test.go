package index

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
)

var (
	geo   = kv.Geometry{Layers: 2, KVHeads: 2, HeadDim: 8, TokensPerPage: 4, DType: kv.DTypeFP32, Pages: 16}
	shape = Shape{Geometry: geo, Devices: []int{0, 1}, HostPages: 48, Replicas: 8}
	hdr   = Header{Epoch: 3, Keeper: Proc{PID: 7, Start: 99}, Geometry: geo, Devices: []int{0, 1}}
)

func bound(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	t.Cleanup(cancel)
	return ctx
}

func write(t *testing.T, b []byte) string {
	path := filepath.Join(t.TempDir(), "index")
	require.NoError(t, os.WriteFile(path, b, 0o600))
	return path
}

// An index of records that are well formed but make no sense is refused, saying why;
// one that does is read back as it was written.
func TestLoad(t *testing.T) {
	h1, h2 := kv.Hash{1}, kv.Hash{2}
	alice := Proc{PID: 11, Start: 5}
	good := AppendHeader(nil, hdr)
	good = AppendPage(good, Seal, 0, 3, h1)
	good = AppendPage(good, Seal, 1, 4, h2)
	good = AppendPage(good, Seal, 0, 5, h2)
	good = AppendPage(good, Free, 0, 3, kv.Hash{})
	good = AppendPage(good, Seal, 0, 6, h1)
	good = AppendPage(good, HostSeal, 0, 40, h1) // beyond the slab's 16, under a hash the slab holds too
	good = AppendPage(good, HostSeal, 0, 2, h2)
	good = AppendPage(good, HostFree, 0, 40, kv.Hash{})
	good = AppendPage(good, HostSeal, 1, 9, h1)
	good = AppendPage(good, HostSeal, 1, 48, h2) // beyond this shape's tier of 48: skipped
	good = AppendProc(good, Attach, alice)
	good = AppendProc(good, Attach, Proc{PID: 12})
	good = AppendProc(good, Detach, Proc{PID: 12})
	bob := Grant{Lease: 9, Dev: 1, Holder: Proc{PID: 13, Start: 8}, Pages: []uint32{7, 8}}
	good = AppendGrant(good, &Grant{Lease: 5, Dev: 0, Holder: alice, Pages: []uint32{9}})
	good = AppendGrant(good, &bob)
	good = AppendGrant(good, &Grant{Lease: 4, Dev: 0, Holder: alice, Pages: []uint32{10, 11}})
	good = AppendEnd(good, 5)
	reader := Grant{Lease: 11, Dev: 0, Holder: alice, Pages: []uint32{3, 1}, Read: true, Hashes: []kv.Hash{h2, h1}}
	good = AppendGrant(good, &reader)
	good = AppendGrant(good, &Grant{Lease: 6, Dev: 0, Holder: alice}) // cut short by a crash: never answered
	st, err := Load(write(t, good), shape)
	require.NoError(t, err)
	assert.Equal(t, hdr, st.Header)
	assert.Equal(t, []Page{{5, h2}, {6, h1}}, st.Sealed[0], "least recent first, the freed page gone")
	assert.Equal(t, []Page{{4, h2}}, st.Sealed[1])
	assert.Equal(t, []Proc{alice}, st.Attached)
	assert.Equal(t, []Page{{2, h2}}, st.Host[0], "the evicted host page gone")
	assert.Equal(t, []Page{{9, h1}}, st.Host[1], "the host page beyond the tier skipped")
	assert.Equal(t, []Grant{{Lease: 4, Dev: 0, Holder: alice, Pages: []uint32{10, 11}}, bob, reader}, st.Grants, "the leases not ended, by lease")

	_, err = Load(filepath.Join(t.TempDir(), "none"), shape)
	assert.ErrorIs(t, err, ErrNoIndex)
	for _, tc := range []struct {
		name string
		b    []byte
		why  string
	}{
		{"empty", nil, "the header is missing"},
		{"magic", appendRecord(nil, func(b []byte) []byte { return append(b, "CPKVIDX9"...) }), "bad magic"},
		{"device", AppendPage(AppendHeader(nil, hdr), Seal, 2, 1, h1), "device 2 is not one of [0 1]"},
		{"page", AppendPage(AppendHeader(nil, hdr), Seal, 0, 16, h1), "page 16 of 16"},
		{"type", appendRecord(AppendHeader(nil, hdr), func(b []byte) []byte { return append(b, 99) }), "unknown type 99"},
		{"short page", appendRecord(AppendHeader(nil, hdr), func(b []byte) []byte { return append(b, byte(Seal), 0, 0) }), "2 bytes for a page record"},
		{"long record", appendRecord(AppendHeader(nil, hdr), func(b []byte) []byte { return append(b, make([]byte, 100)...) }), "of 100 bytes, at most 25"},
		{"one hash twice", AppendPage(AppendPage(AppendHeader(nil, hdr), Seal, 0, 1, h1), Seal, 0, 2, h1), "visible under one hash"},
		{"host device", AppendPage(AppendHeader(nil, hdr), HostSeal, 2, 1, h1), "device 2 is not one of [0 1]"},
		{"host hash twice", AppendPage(AppendPage(AppendHeader(nil, hdr), HostSeal, 0, 1, h1), HostSeal, 0, 20, h1), "are sealed under one hash"},
		{"a tail cut", good[:len(good)-1], "truncated"},
		{"grant device", AppendGrant(AppendHeader(nil, hdr), &Grant{Lease: 1, Dev: 2, Pages: []uint32{1}}), "device 2 is not one of [0 1]"},
		{"grant page", AppendGrant(AppendHeader(nil, hdr), &Grant{Lease: 1, Pages: []uint32{1, 16}}), "page 16 of 16"},
		{"stray grant page", appendRecord(AppendHeader(nil, hdr), func(b []byte) []byte {
			return binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint64(append(b, byte(LeasePage)), 3), 1)
		}), "a page of lease 3, which no grant before names"},
		{"stray hash", appendRecord(AppendGrant(AppendHeader(nil, hdr), &Grant{Lease: 3, Pages: []uint32{1}}), func(b []byte) []byte {
			return append(binary.LittleEndian.AppendUint64(append(b, byte(LeaseHash)), 3), h1[:]...)
		}), "a hash of lease 3, which no read lease's page before names"},
		{"short end", appendRecord(AppendHeader(nil, hdr), func(b []byte) []byte { return append(b, byte(LeaseEnd), 1) }), "1 bytes for an end record"},
		{"a bit flipped", func() []byte { b := slices.Clone(good); b[60] ^= 0x40; return b }(), "checksum is wrong"},
	} {
		_, err := Load(write(t, tc.b), shape)
		require.Error(t, err, tc.name)
		assert.ErrorIs(t, err, ErrCorrupt, tc.name)
		assert.Contains(t, err.Error(), tc.why, tc.name)
	}
}

// An index written for another geometry, or other devices, is refused, and the header
// comes back with the error, for its epoch.
func TestLoadRefusesAnotherGeometry(t *testing.T) {
	b := AppendPage(AppendHeader(nil, hdr), Seal, 0, 3, kv.Hash{1})
	path := write(t, b)
	other := shape
	other.Geometry.Layers = 3
	st, err := Load(path, other)
	require.ErrorIs(t, err, ErrOtherShape)
	assert.Contains(t, err.Error(), "the index is of ")
	require.NotNil(t, st)
	assert.Equal(t, hdr, st.Header)
	assert.Nil(t, st.Sealed, "no page of it")

	other = shape
	other.Devices = []int{0}
	_, err = Load(path, other)
	require.ErrorIs(t, err, ErrOtherShape)
	assert.Contains(t, err.Error(), "the index is of devices [0 1], not [0]")
}

// A file longer than its shape bounds is refused with the bound, before it is read
// where its size shows it, else at the record past the bound.
func TestLoadIsBounded(t *testing.T) {
	big := write(t, nil)
	require.NoError(t, os.Truncate(big, shape.maxBytes()+1))
	_, err := Load(big, shape)
	require.ErrorIs(t, err, ErrCorrupt)
	assert.Contains(t, err.Error(), "bytes, over the")

	b := AppendHeader(nil, hdr)
	for range shape.MaxRecords() { // replica records are the shortest: more of them fit the bytes
		b = AppendProc(b, Attach, Proc{PID: 1})
	}
	require.LessOrEqual(t, int64(len(b)), shape.maxBytes())
	_, err = Load(write(t, b), shape)
	require.ErrorIs(t, err, ErrCorrupt)
	assert.Contains(t, err.Error(), fmt.Sprintf("over %d records", shape.MaxRecords()))
}

// Only a regular file is an index: a named pipe (which would block a reader and a
// writer), a device, a directory or a link at its path is refused, saying what it is,
// by Load and by Open, and left as it was; none of these calls hangs.
func TestOnlyARegularFile(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	require.NoError(t, unix.Mkfifo(fifo, 0o600))
	sub := filepath.Join(dir, "dir")
	require.NoError(t, os.Mkdir(sub, 0o700))
	target := write(t, AppendHeader(nil, hdr))
	link := filepath.Join(dir, "link")
	require.NoError(t, os.Symlink(target, link))
	for _, c := range []struct{ path, what string }{
		{fifo, "a named pipe"}, {"/dev/null", "a character device"}, {sub, "a directory"}, {link, "a symbolic link"},
	} {
		done := make(chan error, 2)
		go func() {
			_, err := Load(c.path, shape)
			done <- err
			_, err = Open(c.path, hdr, shape, func(b *Batch) uint64 { return b.Queued() })
			done <- err
		}()
		for _, call := range []string{"Load", "Open"} {
			err := testwait.Recv(t, done, call+" of "+c.what)
			require.ErrorIs(t, err, ErrNotRegular, "%s of %s", call, c.what)
			assert.Contains(t, err.Error(), c.what)
		}
	}
	fi, err := os.Lstat(fifo)
	require.NoError(t, err)
	assert.Equal(t, os.ModeNamedPipe, fi.Mode().Type(), "the pipe is left alone")
	fi, err = os.Lstat(link)
	require.NoError(t, err)
	assert.Equal(t, os.ModeSymlink, fi.Mode().Type(), "the link is left alone")
}

// A compaction's new file is made anew: a link planted at its name is removed, not
// followed, and what it pointed to is left as it was.
func TestCompactionFollowsNoPlantedLink(t *testing.T) {
	dir := t.TempDir()
	victim := filepath.Join(t.TempDir(), "victim")
	require.NoError(t, os.WriteFile(victim, []byte("precious"), 0o600))
	path := filepath.Join(dir, "index")
	require.NoError(t, os.Symlink(victim, path+".new"))
	ix, err := Open(path, hdr, shape, func(b *Batch) uint64 {
		b.Seal(0, 1, kv.Hash{1})
		return b.Queued()
	})
	require.NoError(t, err)
	require.NoError(t, ix.Close(bound(t)))
	b, err := os.ReadFile(victim)
	require.NoError(t, err)
	assert.Equal(t, "precious", string(b), "the link's target is untouched")
	fi, err := os.Lstat(path)
	require.NoError(t, err)
	assert.True(t, fi.Mode().IsRegular(), "the index is a file of its own")
	_, err = os.Lstat(path + ".new")
	assert.ErrorIs(t, err, os.ErrNotExist)
	st, err := Load(path, shape)
	require.NoError(t, err)
	assert.Equal(t, []Page{{1, kv.Hash{1}}}, st.Sealed[0])
}

// held is a writer seam: the index's goroutine waits in it until let go.
type held struct {
	in, out chan struct{}
	fail    error
}

func newHeld() *held { return &held{in: make(chan struct{}, 64), out: make(chan struct{})} }

func (h *held) before() error {
	h.in <- struct{}{}
	<-h.out
	return h.fail
}

// Records are queued without waiting for the writer: with the writer held in its
// write, queueing goes on, and a Wait for them returns only once the writer has
// written them.
func TestQueueingNeverWaitsForTheWriter(t *testing.T) {
	path := filepath.Join(t.TempDir(), "index")
	h := newHeld()
	ix, err := Open(path, hdr, shape, func(b *Batch) uint64 { return b.Queued() }, BeforeWrite(h.before))
	require.NoError(t, err)
	first := ix.Seal(0, 1, kv.Hash{1})
	testwait.Recv(t, h.in, "the writer at its first write")
	var last uint64
	for i := range 100 { // the writer is held: none of these waits for it
		ix.Free(0, 1)
		ix.Seal(0, uint32(i%16), kv.Hash{byte(i), 1})
		last = ix.Free(0, uint32(i%16))
	}
	assert.Equal(t, uint64(301), last)
	waited := make(chan error, 1)
	go func() { waited <- ix.Wait(bound(t), first) }()
	select {
	case err := <-waited:
		t.Fatalf("Wait returned (%v) before the record was written", err)
	default:
	}
	close(h.out) // every write from now on goes through
	require.NoError(t, testwait.Recv(t, waited, "Wait for the first record"))
	require.NoError(t, ix.Wait(bound(t), last))
	require.NoError(t, ix.Close(bound(t)))
	st, err := Load(path, shape)
	require.NoError(t, err)
	assert.Empty(t, st.Sealed[0])
}

// A write that fails stops the index: its file is removed (no start reads a record of
// it), every Wait past what was written returns the failure, and later records are
// dropped.
func TestAWriteThatFailsStopsTheIndex(t *testing.T) {
	path := filepath.Join(t.TempDir(), "index")
	h := newHeld()
	h.fail = errors.New("disk on fire")
	close(h.out)
	ix, err := Open(path, hdr, shape, func(b *Batch) uint64 { return b.Queued() }, BeforeWrite(h.before))
	require.NoError(t, err)
	seq := ix.Seal(0, 1, kv.Hash{1})
	err = ix.Wait(bound(t), seq)
	require.ErrorIs(t, err, ErrFailed)
	assert.NotErrorIs(t, err, ErrStale)
	assert.Contains(t, err.Error(), "disk on fire")
	_, err = os.Lstat(path)
	assert.ErrorIs(t, err, os.ErrNotExist, "the file is removed")
	assert.ErrorIs(t, ix.Wait(bound(t), ix.Seal(0, 2, kv.Hash{2})), ErrFailed)
	assert.NoError(t, ix.Close(bound(t)), "the failure was the index's to log")
	assert.NoError(t, ix.Close(bound(t)), "a second Close")
}

// A nil index queues nothing and waits for nothing.
func TestNilIndex(t *testing.T) {
	var ix *Index
	assert.Zero(t, ix.Seal(0, 1, kv.Hash{}))
	assert.Zero(t, ix.Queued())
	assert.NoError(t, ix.Wait(context.Background(), 5))
	assert.NoError(t, ix.Close(context.Background()))
}

// Close writes what was queued; a Wait for a record queued after it says the index
// was closed.
func TestCloseWritesTheQueue(t *testing.T) {
	path := filepath.Join(t.TempDir(), "index")
	ix, err := Open(path, hdr, shape, func(b *Batch) uint64 { return b.Queued() })
	require.NoError(t, err)
	for p := range uint32(10) {
		ix.Seal(1, p, kv.Hash{byte(p)})
	}
	require.NoError(t, ix.Close(bound(t)))
	assert.ErrorIs(t, ix.Wait(bound(t), ix.Seal(0, 1, kv.Hash{})), ErrClosed)
	st, err := Load(path, shape)
	require.NoError(t, err)
	assert.Len(t, st.Sealed[1], 10)
}

// model is a caller's state: each device's visible pages and sealed host pages in
// LRU order (least recent first), and the replicas attached; and what a restart would
// rebuild from the journal: the order as of the latest snapshot, then the seals
// since. Its mu is the lock the caller appends under.
type model struct {
	mu          sync.Mutex
	ix          *Index
	lru, host   map[int][]Page
	journal     map[int][]Page // lru as the journal has it
	hostJournal map[int][]Page
	attached    []Proc
	snapshots   int
}

func (m *model) snapshot(b *Batch) uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.snapshots++
	for _, d := range shape.Devices {
		for _, p := range m.lru[d] {
			b.Seal(d, p.Page, p.Hash)
		}
		for _, p := range m.host[d] {
			b.HostSeal(d, p.Page, p.Hash)
		}
		m.journal[d], m.hostJournal[d] = slices.Clone(m.lru[d]), slices.Clone(m.host[d])
	}
	for _, p := range m.attached {
		b.Attach(p)
	}
	return b.Queued()
}

// hashOf is the n'th hash: distinct for distinct n.
func hashOf(n uint32) (h kv.Hash) {
	binary.LittleEndian.PutUint32(h[:], n)
	return h
}

func without(ps []Page, page uint32) []Page {
	return slices.DeleteFunc(ps, func(p Page) bool { return p.Page == page })
}

// A seeded simulation of a caller: seals, evictions, touches (which reorder the LRU
// list without a record), host pages, replicas, and waits, with the index compacting
// many times on its goroutine meanwhile. Loaded back, the index holds exactly the
// caller's pages, in the order the journal knows (the latest snapshot's LRU order,
// then the seals since), and its replicas; the file never holds more records than
// its bound.
func TestSimulation(t *testing.T) {
	for seed := range uint64(8) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 0x1dec))
			path := filepath.Join(t.TempDir(), "index")
			m := &model{lru: map[int][]Page{}, host: map[int][]Page{}, journal: map[int][]Page{}, hostJournal: map[int][]Page{}}
			maxRecords := 0
			var err error
			m.ix, err = Open(path, hdr, shape, m.snapshot, BeforeWrite(func() error {
				if fi, err := os.Stat(path); err == nil {
					maxRecords = max(maxRecords, int(fi.Size()/(frame+procPayload-1)))
				}
				return nil
			}))
			require.NoError(t, err)
			next := uint32(0)
			for range 6000 {
				m.mu.Lock()
				d := shape.Devices[rng.IntN(len(shape.Devices))]
				var seq uint64
				switch op := rng.IntN(10); {
				case op < 4: // seal a free page, evicting the least recent if none is free
					if len(m.lru[d]) == geo.Pages {
						victim := m.lru[d][0]
						m.lru[d], m.journal[d] = m.lru[d][1:], without(m.journal[d], victim.Page)
						m.ix.Free(d, victim.Page)
					}
					page := uint32(rng.IntN(geo.Pages))
					for slices.ContainsFunc(m.lru[d], func(p Page) bool { return p.Page == page }) {
						page = (page + 1) % uint32(geo.Pages)
					}
					next++
					p := Page{page, hashOf(next)}
					m.lru[d], m.journal[d] = append(m.lru[d], p), append(m.journal[d], p)
					seq = m.ix.Seal(d, page, p.Hash)
				case op < 6 && len(m.lru[d]) > 0: // a match touches a page: no record
					i := rng.IntN(len(m.lru[d]))
					p := m.lru[d][i]
					m.lru[d] = append(slices.Delete(m.lru[d], i, i+1), p)
				case op < 8: // a host page sealed once its copy completed, or evicted
					page := uint32(rng.IntN(shape.HostPages))
					if slices.ContainsFunc(m.host[d], func(p Page) bool { return p.Page == page }) {
						m.host[d], m.hostJournal[d] = without(m.host[d], page), without(m.hostJournal[d], page)
						seq = m.ix.HostFree(d, page)
					} else {
						next++
						p := Page{page, hashOf(next)}
						m.host[d], m.hostJournal[d] = append(m.host[d], p), append(m.hostJournal[d], p)
						seq = m.ix.HostSeal(d, page, p.Hash)
					}
				case len(m.attached) < shape.Replicas/2 || (rng.IntN(2) == 0 && len(m.attached) < shape.Replicas):
					p := Proc{PID: uint32(rng.IntN(3) + 1), Start: 9}
					m.attached = append(m.attached, p)
					seq = m.ix.Attach(p)
				default:
					i := rng.IntN(len(m.attached))
					seq = m.ix.Detach(m.attached[i])
					m.attached = slices.Delete(m.attached, i, i+1)
				}
				m.mu.Unlock()
				if seq != 0 && rng.IntN(50) == 0 {
					require.NoError(t, m.ix.Wait(bound(t), seq))
				}
			}
			require.NoError(t, m.ix.Close(bound(t)))
			st, err := Load(path, shape)
			require.NoError(t, err)
			assert.Greater(t, m.snapshots, 3, "the index compacted as it grew")
			assert.LessOrEqual(t, maxRecords, shape.MaxRecords(), "never past its bound")
			for _, d := range shape.Devices {
				assert.Equal(t, m.journal[d], st.Sealed[d], "device %d's pages, in the journal's order", d)
				assert.Equal(t, m.hostJournal[d], st.Host[d], "device %d's host pages, in the journal's order", d)
			}
			want := slices.Clone(m.attached)
			slices.SortFunc(want, func(a, b Proc) int { return int(a.PID) - int(b.PID) })
			assert.Equal(t, want, st.Attached)
		})
	}
}
