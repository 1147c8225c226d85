package exporttest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/internal/proctest"
)

// Promptly bounds how long "at once" may take in these tests: a socket's end reaches
// the reader in microseconds; this only keeps a broken test from hanging.
const Promptly = 5 * time.Second

// KillProducer SIGKILLs a producer child and reaps it.
func KillProducer(t *testing.T, k *proctest.Child) {
	t.Helper()
	k.Kill()
	KilledBySIGKILL(t, k)
}

// RoleLingeringConsumer: lingering-consumer SOCKET
// It connects an Importer on a software device of its own, hands a duplicate of the
// connection to a child that only sleeps (so the socket outlives this process), says
// "ready HOLDERPID" and waits to be killed.
func RoleLingeringConsumer(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "lingering-consumer:", err); return 1 }
	d := cudarttest.New()
	nc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: args[0], Net: "unix"})
	if err != nil {
		return fail(err)
	}
	f, err := nc.File() // the duplicate the holder keeps
	if err != nil {
		return fail(err)
	}
	if _, err := consumer.DialConn(context.Background(), nc, d, 0); err != nil {
		return fail(err)
	}
	holder := exec.Command("sleep", "600")
	holder.ExtraFiles = []*os.File{f}
	if err := holder.Start(); err != nil {
		return fail(err)
	}
	fmt.Println("ready", holder.Process.Pid)
	for range proctest.Commands() {
	}
	return 0
}
