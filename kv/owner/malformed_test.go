package owner_test

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

var small = kv.Geometry{Layers: 2, KVHeads: 2, HeadDim: 8, TokensPerPage: 4, DType: kv.DTypeFP32, Pages: 64}

func bound(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	t.Cleanup(cancel)
	return ctx
}

func listen(t testing.TB, g kv.Geometry, devices ...int) (*owner.Owner, string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvo")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	dev := cudarttest.ForTest(t)
	o, err := owner.Listen(dir, dev, g, owner.WithDevices(devices...))
	require.NoError(t, err)
	t.Cleanup(func() {
		assert.NoError(t, o.Close(bound(t)))
		assert.NoError(t, dev.Err(), "the owner's device saw broken rules")
	})
	return o, dir
}

// raw is a connection to the page socket that speaks frames by hand. It reads past
// the Grow frames (the slab's chunks), closing their descriptors.
type raw struct {
	t  *testing.T
	nc *net.UnixConn
	rd *kvwire.Reader
}

func dialRaw(t *testing.T, dir string) *raw {
	nc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: filepath.Join(dir, owner.PageSocket), Net: "unix"})
	require.NoError(t, err)
	t.Cleanup(func() { nc.Close() })
	nc.SetDeadline(time.Now().Add(testwait.Bound))
	rd := kvwire.NewReader()
	t.Cleanup(rd.Close)
	return &raw{t: t, nc: nc, rd: rd}
}

func (r *raw) send(b []byte, err error) {
	require.NoError(r.t, err)
	_, err = r.nc.Write(b)
	require.NoError(r.t, err)
}

func (r *raw) next() (kvwire.Header, []byte, error) {
	for {
		h, p, err := r.rd.Next(r.nc) // a Grow's descriptor is closed by the next Next, or Close
		if err != nil || h.Type != kvwire.TypeGrow {
			return h, p, err
		}
	}
}

// hello says Hello for device 0 and expects Welcome.
func (r *raw) hello() {
	r.send(kvwire.AppendHello(nil, 1, kvwire.Hello{Version: kvwire.Version, PID: uint32(os.Getpid())}))
	h, _, err := r.next()
	require.NoError(r.t, err)
	require.Equal(r.t, kvwire.TypeWelcome, h.Type)
}

// closed expects the owner to close the connection without another frame: the read
// ends at the end of the stream (or a reset), not at this side's own deadline
// (dialRaw's testwait.Bound), which would mean the owner never closed it.
func (r *raw) closed(what string) {
	h, _, err := r.next()
	require.Error(r.t, err, "%s: the owner answered %s instead of closing", what, h.Type)
	require.False(r.t, errors.Is(err, os.ErrDeadlineExceeded), "%s: the owner never closed the connection: the test's own read deadline ended the read (%v)", what, err)
	assert.True(r.t, errors.Is(err, io.EOF) || errors.Is(err, kvwire.ErrMalformed) || isReset(err), "%s: %v", what, err)
}

// isReset says whether err is the owner's close seen as a reset: it closed with
// frames of ours unread.
func isReset(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

func header(n uint32, t kvwire.Type, reserved byte) []byte {
	b := binary.LittleEndian.AppendUint32(nil, n)
	return append(b, byte(t), 0, reserved, 0, 9, 0, 0, 0)
}

// TestMalformedFramesCloseOnlyTheirConnection: every malformed frame closes the
// connection it came on, and a replica beside it is served on.
func TestMalformedFramesCloseOnlyTheirConnection(t *testing.T) {
	_, dir := listen(t, small)
	dev := cudarttest.ForTest(t)
	good, err := replica.Dial(bound(t), dir, dev, 0)
	require.NoError(t, err)
	t.Cleanup(func() { good.Close(bound(t)) })

	alloc := func(n uint32) []byte {
		b, _ := kvwire.AppendU32(nil, kvwire.TypeAlloc, 2, n)
		return b
	}
	for _, c := range []struct {
		name  string
		frame []byte
	}{
		{"oversized", header(1<<20, kvwire.TypeAlloc, 0)},
		{"shorter than its header", header(3, kvwire.TypeAlloc, 0)},
		{"reserved bytes set", append(header(12, kvwire.TypeAlloc, 1), 1, 0, 0, 0)},
		{"unknown type", header(8, 99, 0)},
		{"a Welcome from a replica", header(8, kvwire.TypeWelcome, 0)},
		{"an Alloc cut short", append(header(10, kvwire.TypeAlloc, 0), 1, 0)},
		{"an Alloc too long", func() []byte {
			b := append(alloc(1), 0)
			binary.LittleEndian.PutUint32(b, uint32(len(b)-4))
			return b
		}()},
		{"a Seal with fewer hashes than it says", func() []byte {
			b, _ := kvwire.AppendSeal(nil, 3, false, 1, kvwire.Now, []kv.Hash{{1}})
			binary.LittleEndian.PutUint32(b[kvwire.HeaderLen+8+kvwire.PointLen:], 10)
			return b
		}()},
		{"a Bye with a payload", append(header(9, kvwire.TypeBye, 0), 7)},
		{"a stream that ends inside a frame", header(100, kvwire.TypeMatch, 0)},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := dialRaw(t, dir)
			r.hello()
			_, err := r.nc.Write(c.frame)
			require.NoError(t, err)
			if c.name == "a stream that ends inside a frame" {
				r.nc.CloseWrite()
			}
			r.closed(c.name)
			l, err := good.Alloc(bound(t), 1)
			require.NoError(t, err, "the other replica after %s", c.name)
			require.NoError(t, good.Release(bound(t), l, 0))
		})
	}
}

// TestHandshakeRefusals: a first frame other than Hello, another protocol version, a
// device not served: each is refused with the reason, its code and the first frame's
// id, and the connection closed.
func TestHandshakeRefusals(t *testing.T) {
	_, dir := listen(t, small)
	for _, c := range []struct {
		name, reason string
		code         error
		frame        func() ([]byte, error)
	}{
		{"not Hello", "must be Hello", kv.ErrRefused, func() ([]byte, error) { return kvwire.AppendU32(nil, kvwire.TypeAlloc, 7, 1) }},
		{"version", "protocol version 99", kv.ErrRefused, func() ([]byte, error) {
			return kvwire.AppendHello(nil, 7, kvwire.Hello{Version: 99})
		}},
		{"device", "device 1 is not served", kv.ErrGeometry, func() ([]byte, error) {
			return kvwire.AppendHello(nil, 7, kvwire.Hello{Version: kvwire.Version, Device: 1})
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := dialRaw(t, dir)
			r.send(c.frame())
			h, p, err := r.next()
			require.NoError(t, err)
			require.Equal(t, kvwire.TypeRefused, h.Type)
			assert.Equal(t, uint32(7), h.ID, "Refused carries the first frame's id")
			err = kvwire.ParseError(h.Type, p)
			assert.ErrorContains(t, err, c.reason)
			assert.ErrorIs(t, err, c.code)
			r.closed(c.name)
		})
	}
	dev := cudarttest.ForTest(t)
	_, err := replica.Dial(bound(t), dir, dev, 1)
	require.ErrorIs(t, err, kv.ErrGeometry, "a replica for a device the owner does not serve")
}

// TestBatchOverTheLimitIsAnswered: a well-formed frame with more than kv.MaxBatch
// hashes is refused with kv.ErrTooLarge, and the connection goes on.
func TestBatchOverTheLimitIsAnswered(t *testing.T) {
	_, dir := listen(t, small)
	r := dialRaw(t, dir)
	r.hello()
	n := kv.MaxBatch + 1
	b := kvwire.Begin(nil, kvwire.TypeMatch, 0, 5)
	b = binary.LittleEndian.AppendUint32(b, uint32(n))
	b = append(b, make([]byte, 16*n)...)
	b, err := kvwire.End(b, 0)
	require.NoError(t, err)
	r.send(b, nil)
	h, p, err := r.next()
	require.NoError(t, err)
	require.Equal(t, kvwire.TypeError, h.Type)
	assert.Equal(t, uint32(5), h.ID)
	pr := kvwire.NewParser(h.Type, p)
	assert.Equal(t, kvwire.CodeTooLarge, pr.U16())
	r.send(kvwire.AppendU32(nil, kvwire.TypeAlloc, 6, 2))
	h, _, err = r.next()
	require.NoError(t, err)
	assert.Equal(t, kvwire.TypeLeased, h.Type, "the connection goes on")
}

// TestPolicyRefuses: a process the policy does not admit is refused with the reason,
// and an admitted one is served.
func TestPolicyRefuses(t *testing.T) {
	own := uint32(os.Getuid())
	for _, c := range []struct {
		name   string
		policy export.Policy
		reason string
	}{
		{"another uid", export.Policy{AllowUIDs: []uint32{own + 1}}, "is not allowed"},
		{"another gid", export.Policy{AllowGIDs: []uint32{uint32(os.Getgid()) + 1}}, "is not allowed"},
		{"this uid", export.Policy{AllowUIDs: []uint32{own}}, ""},
		{"the zero policy", export.Policy{}, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir, err := os.MkdirTemp("", "kvp")
			require.NoError(t, err)
			t.Cleanup(func() { os.RemoveAll(dir) })
			dev := cudarttest.ForTest(t)
			o, err := owner.Listen(dir, dev, small, owner.WithPolicy(c.policy))
			require.NoError(t, err)
			t.Cleanup(func() { o.Close(bound(t)) })
			r := dialRaw(t, dir)
			r.send(kvwire.AppendHello(nil, 1, kvwire.Hello{Version: kvwire.Version}))
			h, p, err := r.next()
			require.NoError(t, err)
			if c.reason == "" {
				assert.Equal(t, kvwire.TypeWelcome, h.Type)
				return
			}
			require.Equal(t, kvwire.TypeRefused, h.Type)
			err = kvwire.ParseError(h.Type, p)
			assert.ErrorContains(t, err, c.reason)
			assert.ErrorIs(t, err, kv.ErrRefused)
			r.closed(c.name)
		})
	}
}
