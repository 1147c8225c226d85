package keep_test

import (
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/internal/testlog"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv/internal/keep"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// A replica that meets an owner of the unframed version 1 (which reads 4 bytes and
// answers JSON) says the owner speaks version 1, naming its own.
func TestAskHostTierOfAVersion1Owner(t *testing.T) {
	path := filepath.Join(t.TempDir(), "host.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	defer ln.Close()
	go func() {
		nc, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		defer nc.Close()
		_, _ = nc.Read(make([]byte, 4))
		_, _ = nc.Write([]byte(`{"device":20,"error":"device 20 has no host tier here"}`))
	}()
	_, fd, err := keep.AskHostTier(bound(t), path, 0)
	assert.Equal(t, -1, fd)
	require.ErrorIs(t, err, keep.ErrRefused)
	assert.ErrorContains(t, err, "the owner speaks host tier socket version 1 (unframed JSON); this replica speaks 2")
}

// A connection that says nothing is closed at the keeper's handshake timeout: a
// silent client holds no handshake slot for longer.
func TestSilentConnectionIsClosedAtTheHandshakeTimeout(t *testing.T) {
	path := filepath.Join(t.TempDir(), keep.Socket)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	var log testlog.Buffer
	s := keep.NewServer(log.Logger())
	srv := session.Serve(ln, log.Logger(), "keep test", session.Limits{HandshakeTimeout: 20 * time.Millisecond}, s.Serve)
	defer srv.Close()
	defer s.Close()
	r := &raw{t: t}
	r.nc, err = net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	defer r.nc.Close()
	require.NoError(t, r.nc.SetDeadline(time.Now().Add(testwait.Bound)))
	r.rd = kvwire.NewReader()
	r.closed("that said nothing")
	assert.Contains(t, log.String(), "no Hello")
}
