package peercred

import (
	"net"
	"os"
	"path/filepath"
	"testing"
)

func TestGetIdentifiesConnectingProcess(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	client, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	server, err := l.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	defer server.Close()

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
	path := filepath.Join(t.TempDir(), "s")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if cred, err := Get(c); err == nil {
		t.Fatalf("Get on a closed conn = %+v, nil; want an error", cred)
	}
}
