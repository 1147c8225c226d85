package peercred

import (
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// listenAndDial returns both ends of a fresh Unix stream connection.
func listenAndDial(t *testing.T) (server, client *net.UnixConn) {
	t.Helper()
	addr := &net.UnixAddr{Name: filepath.Join(t.TempDir(), "s"), Net: "unix"}
	l, err := net.ListenUnix("unix", addr)
	require.NoError(t, err)
	defer func() { _ = l.Close() }() // test cleanup
	client, err = net.DialUnix("unix", nil, addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = client.Close() }) // test cleanup
	server, err = l.AcceptUnix()
	require.NoError(t, err)
	t.Cleanup(func() { _ = server.Close() }) // test cleanup
	return server, client
}

func TestGetIdentifiesConnectingProcess(t *testing.T) {
	server, client := listenAndDial(t)
	for name, c := range map[string]*net.UnixConn{"server side": server, "client side": client} {
		got, err := Get(c)
		require.NoError(t, err, name)
		want := Cred{PID: os.Getpid(), UID: uint32(os.Getuid()), GID: uint32(os.Getgid())}
		assert.Equal(t, want, got, name)
	}
}

func TestGetOnClosedConnFails(t *testing.T) {
	_, client := listenAndDial(t)
	_ = client.Close() // test cleanup
	cred, err := Get(client)
	require.Error(t, err, "Get on a closed conn = %+v", cred)
}
