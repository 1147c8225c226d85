package kvwire

import (
	"bytes"
	"errors"
	"io"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/kv"
)

// chunks is a stream that hands out its bytes n at a time, with a timeout-like error
// between reads where cut says.
type chunks struct {
	b   []byte
	n   int
	cut map[int]bool // fail the read that would start at this offset, once
	off int
}

var errCut = errors.New("cut short")

func (c *chunks) Read(p []byte) (int, error) {
	if c.cut[c.off] {
		delete(c.cut, c.off)
		return 0, errCut
	}
	if len(c.b) == 0 {
		return 0, io.EOF
	}
	n := min(c.n, len(p), len(c.b))
	copy(p, c.b[:n])
	c.b = c.b[n:]
	c.off += n
	return n, nil
}

func frames(t *testing.T) []byte {
	t.Helper()
	at := Point{Notifier: 1, Target: 2}
	var b []byte
	must := func(nb []byte, e error) {
		require.NoError(t, e)
		b = nb
	}
	must(AppendHello(b, 1, Hello{Version: Version, PID: 42, Device: 1, Namespace: "ns"}))
	g := kv.Geometry{Layers: 3, KVHeads: 4, HeadDim: 5, TokensPerPage: 6, DType: kv.DTypeFP16, Pages: 7}
	must(AppendWelcome(b, 2, Welcome{Geometry: g, ChunkBytes: 2 << 20, Chunks: 12, Slab: "kv/slab/1@7"}))
	must(AppendLease(b, TypeLeased, 3, 99, []uint32{5, 6, 7}))
	must(AppendSeal(b, 4, true, 99, at, []kv.Hash{{1}, {2}}))
	must(AppendSealed(b, 5, Sealed{Visible: 1, Duplicates: 2, Pending: 3}))
	must(AppendMatch(b, 6, []kv.Hash{{3}}))
	must(AppendRelease(b, 7, at, []uint64{1, 1 << 60}))
	must(AppendError(b, TypeError, 8, CodeNoSpace, "no room"))
	must(AppendEmpty(b, TypeBye, 9))
	return b
}

func checkFrames(t *testing.T, rd *Reader, src io.Reader) {
	t.Helper()
	next := func(want Type, id uint32) *Parser {
		t.Helper()
		h, p, err := rd.Next(src)
		for errors.Is(err, errCut) {
			h, p, err = rd.Next(src)
		}
		require.NoError(t, err)
		require.Equal(t, want, h.Type)
		require.Equal(t, id, h.ID)
		return NewParser(h.Type, p)
	}
	p := next(TypeHello, 1)
	assert.Equal(t, Hello{Version: Version, PID: 42, Device: 1, Namespace: "ns"}, Hello{p.U32(), p.U32(), p.U32(), p.Text()})
	require.NoError(t, p.Done())
	p = next(TypeWelcome, 2)
	assert.Equal(t, kv.Geometry{Layers: 3, KVHeads: 4, HeadDim: 5, TokensPerPage: 6, DType: kv.DTypeFP16, Pages: 7}, p.Geometry())
	assert.Equal(t, uint64(2<<20), p.U64())
	assert.Equal(t, uint32(12), p.U32())
	assert.Equal(t, uint32(0), p.U32())
	assert.Equal(t, "kv/slab/1@7", p.Text())
	require.NoError(t, p.Done())
	p = next(TypeLeased, 3)
	assert.Equal(t, uint64(99), p.U64())
	assert.Equal(t, []uint32{5, 6, 7}, p.U32s(nil))
	require.NoError(t, p.Done())
	h, pl, err := rd.Next(src)
	for errors.Is(err, errCut) {
		h, pl, err = rd.Next(src)
	}
	require.NoError(t, err)
	assert.Equal(t, Header{Type: TypeSeal, Flags: FlagWait, ID: 4}, h)
	p = NewParser(h.Type, pl)
	assert.Equal(t, uint64(99), p.U64())
	assert.Equal(t, Point{Notifier: 1, Target: 2}, p.Point())
	assert.Equal(t, []kv.Hash{{1}, {2}}, p.Hashes())
	require.NoError(t, p.Done())
	p = next(TypeSealed, 5)
	assert.Equal(t, Sealed{1, 2, 3}, Sealed{p.U32(), p.U32(), p.U32()})
	p = next(TypeMatch, 6)
	assert.Equal(t, []kv.Hash{{3}}, p.Hashes())
	p = next(TypeRelease, 7)
	p.Point()
	assert.Equal(t, []uint64{1, 1 << 60}, p.U64s(nil))
	require.NoError(t, p.Done())
	p = next(TypeError, 8)
	assert.Equal(t, CodeNoSpace, p.U16())
	assert.Equal(t, "no room", p.Text())
	p = next(TypeBye, 9)
	require.NoError(t, p.Done())
	_, _, err = rd.Next(src)
	for errors.Is(err, errCut) {
		_, _, err = rd.Next(src)
	}
	assert.ErrorIs(t, err, io.EOF)
}

// TestFramesRoundTrip reads every frame back, from one read of them all, a byte at a
// time, and with reads cut short between: a cut read loses nothing.
func TestFramesRoundTrip(t *testing.T) {
	all := frames(t)
	checkFrames(t, NewReader(), bytes.NewReader(all))
	checkFrames(t, NewReader(), &chunks{b: bytes.Clone(all), n: 1})
	cut := map[int]bool{}
	for i := 0; i < len(all); i += 7 {
		cut[i] = true
	}
	checkFrames(t, NewReader(), &chunks{b: bytes.Clone(all), n: 5, cut: cut})
}

// TestReaderReusesItsBuffer: frames that together exceed the buffer are read through it.
func TestReaderReusesItsBuffer(t *testing.T) {
	var b []byte
	var err error
	hs := make([]kv.Hash, kv.MaxBatch)
	for i := range 20 {
		hs[0][0] = byte(i)
		b, err = AppendMatch(b, uint32(i+1), hs)
		require.NoError(t, err)
	}
	rd := NewReader()
	src := &chunks{b: b, n: 3000}
	for i := range 20 {
		h, p, err := rd.Next(src)
		require.NoError(t, err)
		require.Equal(t, uint32(i+1), h.ID)
		got := NewParser(h.Type, p).Hashes()
		require.Len(t, got, kv.MaxBatch)
		require.Equal(t, byte(i), got[0][0])
	}
}

func TestSenderRefusesTooLarge(t *testing.T) {
	var at Point
	_, err := AppendMatch(nil, 1, make([]kv.Hash, kv.MaxBatch+1))
	assert.ErrorIs(t, err, kv.ErrTooLarge)
	_, err = AppendSeal(nil, 1, false, 1, at, make([]kv.Hash, kv.MaxBatch+1))
	assert.ErrorIs(t, err, kv.ErrTooLarge)
	_, err = AppendRelease(nil, 1, at, make([]uint64, kv.MaxBatch+1))
	assert.ErrorIs(t, err, kv.ErrTooLarge)
	_, err = AppendLease(nil, TypeMatched, 1, 1, make([]uint32, kv.MaxBatch+1))
	assert.ErrorIs(t, err, kv.ErrTooLarge)
	b := Begin([]byte("keep"), TypeStatsReply, 0, 1)
	b, err = End(append(b, make([]byte, MaxFrame)...), 4)
	assert.ErrorIs(t, err, kv.ErrTooLarge)
	assert.Equal(t, []byte("keep"), b, "a refused frame is cut off, what came before kept")
}

func TestParserRefusesBadPayloads(t *testing.T) {
	p := NewParser(TypeAlloc, []byte{1, 2})
	p.U32()
	assert.ErrorIs(t, p.Done(), ErrMalformed)
	p = NewParser(TypeMatch, []byte{0xff, 0xff, 0, 0})
	assert.Nil(t, p.Hashes())
	assert.ErrorIs(t, p.Done(), kv.ErrTooLarge, "a count over MaxBatch")
	p = NewParser(TypeRefused, []byte{0xff, 0xff})
	p.Text()
	assert.ErrorIs(t, p.Done(), ErrMalformed, "a text over MaxText")
	_, err := ParseGeometry(make([]byte, GeometryLen))
	assert.ErrorIs(t, err, kv.ErrGeometry, "a zero geometry")
	_, err = ParseGeometry(make([]byte, GeometryLen-1))
	assert.ErrorIs(t, err, ErrMalformed)
}

func TestCodes(t *testing.T) {
	for _, sentinel := range []error{kv.ErrNoSpace, kv.ErrStaleLease, kv.ErrGeometry, kv.ErrTooLarge, kv.ErrClosed} {
		err := RemoteError(Code(sentinel), "x")
		assert.ErrorIs(t, err, sentinel)
		var re *kv.RemoteError
		require.ErrorAs(t, err, &re)
	}
	assert.Equal(t, CodeInternal, Code(errors.New("cuda")))
	assert.NoError(t, errors.Unwrap(RemoteError(CodeInternal, "x")))
}
