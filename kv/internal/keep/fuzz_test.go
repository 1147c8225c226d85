package keep

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/protospec"
	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/internal/testlog"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// FuzzDecodeFrame: whatever the bytes, DecodeFrame fails with ErrMalformed, or decodes
// a frame of either protocol within its type's payload lengths that Append encodes
// back to the same bytes.
func FuzzDecodeFrame(f *testing.F) {
	for _, s := range protocolSamples() {
		b, err := Append(nil, s.t, 1, s.m)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		h, m, n, err := DecodeFrame(b)
		if err != nil {
			require.ErrorIs(t, err, ErrMalformed)
			return
		}
		lim, ok := limitOf(h.Type)
		require.True(t, ok, "%s decodes and has no payload limits", h.Type)
		require.True(t, n-kvwire.HeaderLen >= lim.Min && n-kvwire.HeaderLen <= lim.Max, "%s of %d payload bytes, outside %v", h.Type, n-kvwire.HeaderLen, lim)
		again, err := Append(nil, h.Type, h.ID, m)
		require.NoError(t, err, "%s re-encodes", h.Type)
		require.True(t, bytes.Equal(again, b[:n]), "%s re-encodes differently:\n got %x\nwant %x", h.Type, again, b[:n])
	})
}

// fuzzServer is a server on a socket of its own for the connection fuzzers: serve is
// its handler.
func fuzzServer(f *testing.F, serve func(*session.Conn)) (string, *testlog.Buffer) {
	path := filepath.Join(f.TempDir(), "s.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(f, err)
	var log testlog.Buffer
	srv := session.Serve(ln, log.Logger(), "fuzz", session.Limits{}, serve)
	f.Cleanup(srv.Close)
	return path, &log
}

// converse sends b on a new connection to path, closes its writing end and reads
// until the server closes: a server that hangs fails the test at testwait.Bound.
func converse(t *testing.T, path string, b []byte) {
	nc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	defer nc.Close()
	require.NoError(t, nc.SetDeadline(time.Now().Add(testwait.Bound)))
	if len(b) > 0 {
		_, _ = nc.Write(b) // the server may close first: what it read is what counts
	}
	require.NoError(t, nc.CloseWrite())
	_, err = io.Copy(io.Discard, nc)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the server neither answered nor closed the connection within %v", testwait.Bound)
	}
}

// hello is the keeper's Hello, and the requests after it that a seed sends.
func keeperSeed(f *testing.F, msgs ...sample) []byte {
	b, err := Append(nil, TypeHello, 1, Hello{Version: Version, PID: 1, Role: RoleServer})
	require.NoError(f, err)
	for i, m := range msgs {
		b, err = Append(b, m.t, uint32(i+2), m.m)
		require.NoError(f, err)
	}
	return b
}

// FuzzKeeperConn: whatever a connection sends the keeper, the keeper answers or
// closes it, never panics, and keeps nothing from it (no descriptor can come with
// the fuzzer's bytes).
func FuzzKeeperConn(f *testing.F) {
	s := NewServer(nil)
	path, log := fuzzServer(f, s.Serve)
	f.Cleanup(s.Close)
	f.Add([]byte{})
	f.Add(keeperSeed(f))
	f.Add(keeperSeed(f, sample{TypeList, Name{}}, sample{TypeTake, Name{Name: "kv/host/0"}}, sample{TypeDrop, Name{Name: "a"}}))
	f.Add(keeperSeed(f, sample{TypePut, Put{Name: "kv/host/0", Size: 1}}))
	f.Add(keeperSeed(f, sample{TypeHostHello, HostHello{Version: HostVersion}}))
	f.Add(keeperSeed(f, sample{TypeTake, Name{Name: "\x1b[2J"}}))
	f.Fuzz(func(t *testing.T, b []byte) {
		converse(t, path, b)
		assert.Empty(t, s.Kept(), "the keeper kept something from bytes that carry no descriptor")
		assert.NotContains(t, log.String(), "panic")
	})
}

// FuzzHostConn: whatever a connection sends the host tier socket, the owner's side
// answers or closes it and never panics.
func FuzzHostConn(f *testing.F) {
	fd, err := memfdOf(4096)
	require.NoError(f, err)
	f.Cleanup(func() { closeFD(fd) })
	path, log := fuzzServer(f, func(c *session.Conn) {
		_ = ServeHostTier(context.Background(), c, func(m HostHello) (HostTier, int, error) {
			if m.Device != 0 {
				return HostTier{}, -1, ErrNoTier
			}
			return HostTier{Pages: 1, PageBytes: 4096, Bytes: 4096}, fd, nil
		})
	})
	for _, m := range []HostHello{{Version: HostVersion}, {Version: HostVersion, Device: 3}, {Version: 1}} {
		b, err := Append(nil, TypeHostHello, 1, m)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Add([]byte{0, 0, 0, 0}) // version 1's request
	f.Fuzz(func(t *testing.T, b []byte) {
		converse(t, path, b)
		assert.NotContains(t, log.String(), "panic")
	})
}

// memfdOf makes a memfd of size bytes.
func memfdOf(size int64) (int, error) {
	fd, err := unix.MemfdCreate("keep-fuzz", unix.MFD_CLOEXEC)
	if err != nil {
		return -1, err
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		closeFD(fd)
		return -1, err
	}
	return fd, nil
}

// The checked-in seed corpus of FuzzDecodeFrame has a well-formed frame of every type
// of both protocols, and one of each malformed class DecodeFrame names.
func TestSeedCorpusCoversEveryType(t *testing.T) {
	var types []string
	for _, sp := range specs {
		for typ := range sp.limits {
			types = append(types, typ.String())
		}
	}
	protospec.CheckSeedCorpus(t, filepath.Join("testdata", "fuzz", "FuzzDecodeFrame"), func(b []byte) (string, error) {
		h, _, _, err := DecodeFrame(b)
		return h.Type.String(), err
	}, types, []string{"over the limit", "shorter than its header", "reserved bytes", "unknown frame type", "unknown flags",
		"outside", "ends early", "after the", "entries in", "ended inside a frame"})
}
