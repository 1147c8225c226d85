package peercred

import (
	"net"
	"os"
	"path/filepath"
	"testing"
)

// listenAndDial returns both ends of a fresh Unix stream connection.
func listenAndDial(t *testing.T) (server, client *net.UnixConn) {
	t.Helper()
	addr := &net.UnixAddr{Name: filepath.Join(t.TempDir(), "s"), Net: "unix"}
	l, err := net.ListenUnix("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	client, err = net.DialUnix("unix", nil, addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	server, err = l.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { server.Close() })
	return server, client
}

func TestGetIdentifiesConnectingProcess(t *testing.T) {
	server, client := listenAndDial(t)
	for name, c := range map[string]*net.UnixConn{"server side": server, "client side": client} {
		got, err := Get(c)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		want := Cred{PID: os.Getpid(), UID: uint32(os.Getuid()), GID: uint32(os.Getgid())}
		if got != want {
			t.Errorf("%s: Get = %+v, want %+v", name, got, want)
		}
	}
}

func TestGetOnClosedConnFails(t *testing.T) {
	_, client := listenAndDial(t)
	client.Close()
	if cred, err := Get(client); err == nil {
		t.Fatalf("Get on a closed conn = %+v, nil; want an error", cred)
	}
}
