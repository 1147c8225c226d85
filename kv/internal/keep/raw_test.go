package keep_test

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/cudapool/cudapool/kv/internal/keep"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// raw is a connection to the keeper that writes what a test says, frame by frame.
type raw struct {
	t  *testing.T
	nc *net.UnixConn
	rd *kvwire.Reader
}

func dialRaw(t *testing.T, k *keeper) *raw {
	nc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: k.path, Net: "unix"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = nc.Close() })
	require.NoError(t, nc.SetDeadline(time.Now().Add(testwait.Bound)))
	return &raw{t: t, nc: nc, rd: kvwire.NewReader()}
}

func (r *raw) frame(typ keep.Type, m any) []byte {
	b, err := keep.Append(nil, typ, 9, m)
	require.NoError(r.t, err)
	return b
}

func (r *raw) send(b []byte, fds ...int) {
	require.NoError(r.t, unixfd.Send(r.nc, b, fds...))
}

// answer reads the next frame and decodes it.
func (r *raw) answer() (keep.Header, any) {
	h, m, _, err := keep.DecodeFrame(r.next())
	require.NoError(r.t, err)
	return h, m
}

func (r *raw) next() []byte {
	kh, p, err := r.rd.Next(r.nc)
	require.NoError(r.t, err)
	b, err := kvwire.End(append(kvwire.Begin(nil, kh.Type, kh.Flags, kh.ID), p...), 0)
	require.NoError(r.t, err)
	return b
}

func (r *raw) hello() {
	r.send(r.frame(keep.TypeHello, keep.Hello{Version: keep.Version, PID: 1, Role: keep.RoleServer}))
	h, _ := r.answer()
	require.Equal(r.t, keep.TypeWelcome, h.Type)
}

// refused checks that the keeper answered with Refused (code 3, the id of the
// Hello, text) and closed the connection.
func (r *raw) refused(text string) {
	h, m := r.answer()
	require.Equal(r.t, keep.TypeRefused, h.Type)
	assert.Equal(r.t, uint32(9), h.ID, "Refused carries the Hello's id")
	assert.Equal(r.t, keep.Problem{Code: keep.CodeRefused, Text: text}, m)
	r.closed("after Refused")
}

// closed checks that the keeper closed the connection.
func (r *raw) closed(what string) {
	_, _, err := r.rd.Next(r.nc)
	assert.ErrorIs(r.t, err, io.EOF, "the keeper did not close the connection %s", what)
}

// A Hello the keeper does not admit is refused (code 3), with a reason, and the
// connection closed: another version, named with the keeper's, version 1's included,
// whose Hello had no role and 8 bytes (it failed first with "kvwire: malformed frame: a
// Hello payload of 8 bytes, outside 12 to 12", while the keeper decoded the Hello
// before it read the version); a role the protocol does not define; a first frame that
// is not Hello, or one of the page protocol's.
func TestHellosRefused(t *testing.T) {
	v1, err := kvwire.End(append(kvwire.Begin(nil, kvwire.Type(keep.TypeHello), 0, 9), 1, 0, 0, 0, 7, 0, 0, 0), 0)
	require.NoError(t, err)
	page, err := kvwire.AppendHello(nil, 9, kvwire.Hello{Version: kvwire.Version, PID: 1})
	require.NoError(t, err)
	hello := func(m keep.Hello) []byte {
		b, err := keep.Append(nil, keep.TypeHello, 9, m)
		require.NoError(t, err)
		return b
	}
	for _, tc := range []struct {
		name  string
		frame []byte
		why   string
	}{
		{"next version", hello(keep.Hello{Version: keep.Version + 1, PID: 1, Role: keep.RoleServer}), "keeper protocol version 3; this keeper speaks 2"},
		{"version 1", v1, "keeper protocol version 1; this keeper speaks 2"},
		{"unknown role", hello(keep.Hello{Version: keep.Version, PID: 1, Role: 7}), "role(7) is no role of keeper protocol version 2"},
		{"page protocol", page, "the first frame is type(1), not Hello"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := serve(t)
			r := dialRaw(t, k)
			r.send(tc.frame)
			r.refused(tc.why)
			assert.Zero(t, k.s.Clients())
		})
	}
}

// A holder is counted while it is connected, and asks for nothing: each request of its
// is answered with Error (code 3), a Put's descriptor closed and nothing kept, and
// the connection goes on.
func TestHolderMakesNoRequests(t *testing.T) {
	k := serve(t)
	r := dialRaw(t, k)
	r.send(r.frame(keep.TypeHello, keep.Hello{Version: keep.Version, PID: 1, Role: keep.RoleHolder}))
	h, _ := r.answer()
	require.Equal(t, keep.TypeWelcome, h.Type)
	assert.Equal(t, 1, k.s.Holders())
	assert.Equal(t, 1, k.s.Clients(), "a holder is a client the keeper stays for")
	fd := memfd(t, 16, "held")
	r.send(r.frame(keep.TypePut, keep.Put{Name: "kv/host/0", Size: 16}), fd)
	require.NoError(t, unix.Close(fd))
	for _, req := range []struct {
		t keep.Type
		m any
	}{{keep.TypeTake, keep.Name{Name: "kv/host/0"}}, {keep.TypeList, keep.Name{}}, {keep.TypeDrop, keep.Name{Name: "kv/host/0"}}} {
		r.send(r.frame(req.t, req.m))
	}
	for _, want := range []string{"Put", "Take", "List", "Drop"} {
		h, m := r.answer()
		require.Equal(t, keep.TypeError, h.Type, want)
		assert.Equal(t, keep.Problem{Code: keep.CodeRefused, Text: "a holder makes no requests: " + want + " refused"}, m)
	}
	assert.Empty(t, k.s.Kept())
	assert.Zero(t, openMemfds(t), "the holder's Put's descriptor is closed")
	require.NoError(t, r.nc.Close())
	require.Eventually(t, func() bool { return k.s.Clients() == 0 }, testwait.Bound, time.Millisecond, "the holder's connection counted out")
	assert.Zero(t, k.s.Holders())
}

// Each malformed frame closes the connection it came on, and only that one: the reason
// is logged, and nothing is kept from it.
func TestMalformedFramesCloseTheirConnection(t *testing.T) {
	k := serve(t)
	good := dial(t, k)
	fd := memfd(t, 4096, "x")
	defer unix.Close(fd)
	put := func(r *raw) []byte { return r.frame(keep.TypePut, keep.Put{Name: "kv/host/0", Size: 4096}) }
	for _, c := range []struct {
		name string
		send func(r *raw)
		log  string
	}{
		{"unknown type", func(r *raw) {
			b, _ := kvwire.End(kvwire.Begin(nil, 77, 0, 1), 0)
			r.send(b)
		}, "unknown frame type type(77)"},
		{"a payload over its type's", func(r *raw) {
			b, _ := kvwire.End(append(kvwire.Begin(nil, kvwire.Type(keep.TypeList), 0, 1), make([]byte, keep.MaxRequest)...), 0)
			r.send(b)
		}, "a List payload of 277 bytes, outside 2 to 257"},
		{"a frame over the handshake reader's bound", func(r *raw) {
			b, _ := kvwire.End(append(kvwire.Begin(nil, kvwire.Type(keep.TypeList), 0, 1), make([]byte, kvwire.MaxHello)...), 0)
			r.send(b)
		}, "over the limit"},
		{"a Put without its descriptor", func(r *raw) { r.send(put(r)) }, "a Put without its descriptor"},
		{"two descriptors", func(r *raw) { r.send(put(r), fd, fd) }, "unexpected file descriptors"},
		{"unknown flags", func(r *raw) {
			b := r.frame(keep.TypeTake, keep.Name{Name: "a"})
			b[5] = 1
			r.send(b)
		}, "Take with unknown flags 0x1"},
		{"a text past its payload", func(r *raw) {
			b := r.frame(keep.TypeTake, keep.Name{Name: "ab"})
			b[kvwire.HeaderLen] = 9
			r.send(b)
		}, "ends early"},
		{"a reply's type", func(r *raw) { r.send(r.frame(keep.TypeDone, keep.Empty{})) }, "a client sent Done"},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := dialRaw(t, k)
			r.hello()
			c.send(r)
			r.closed("after " + c.name)
			assert.Contains(t, k.log.String(), c.log, "the reason is logged before the connection closes")
		})
	}
	assert.Empty(t, k.s.Kept(), "nothing was kept from a malformed frame")
	require.NoError(t, good.Put(bound(t), "kv/host/0", fd, 4096), "the other connection serves on")
}

// A descriptor sent with a frame that carries none is closed by the keeper, not kept.
func TestStrayDescriptorsAreClosed(t *testing.T) {
	k := serve(t)
	r := dialRaw(t, k)
	r.hello()
	before := openMemfds(t)
	fd := memfd(t, 4096, "stray")
	r.send(r.frame(keep.TypeList, keep.Name{}), fd)
	unix.Close(fd)
	h, m := r.answer()
	require.Equal(t, keep.TypeListed, h.Type)
	assert.Equal(t, keep.Listed{}, m)
	assert.Equal(t, before, openMemfds(t), "the keeper kept a descriptor that came with a List")
}
