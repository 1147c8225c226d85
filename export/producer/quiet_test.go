package producer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/internal/proctest"
)

// The library writes nothing to its process's stderr unless asked (WithLogger): a
// second exporter probing a live socket, a connection that is not admitted (garbage
// for a Hello) and a refused Importer log only through a logger the caller set.
func TestNothingOnStderrUnlessAsked(t *testing.T) {
	var stderr bytes.Buffer
	cmd := proctest.Command(t, "quiet", filepath.Join(shortDir(t), "q.sock"))
	cmd.Stderr = &stderr
	err := cmd.Run()
	require.NoError(t, err, "the quiet role: %s", stderr.String())
	require.Empty(t, stderr.String(), "the library wrote to stderr")
}

// roleQuiet: quiet SOCKET. With every logger left at its default, it listens on
// SOCKET, lets a second Listen probe it, sends a connection garbage and waits until
// the exporter hung up on it, and is refused by a second Dial. It writes nothing to
// stderr itself unless one of those steps does not go as expected.
func roleQuiet(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "quiet:", err); return 1 }
	d := cudarttest.New()
	defer d.Close()
	ctx := context.Background()
	ex, err := Listen(args[0], d, WithoutAnnounce())
	if err != nil {
		return fail(err)
	}
	defer ex.Close(ctx)
	if _, err := Listen(args[0], d, WithoutAnnounce()); !errors.Is(err, ErrAddressInUse) {
		return fail(fmt.Errorf("second Listen: %v, want ErrAddressInUse", err))
	}
	nc, err := net.Dial("unix", args[0])
	if err != nil {
		return fail(err)
	}
	nc.SetDeadline(time.Now().Add(time.Minute)) // a hang ends the role, failing the test
	if _, err := nc.Write(bytes.Repeat([]byte{0xff}, 64)); err != nil {
		return fail(err)
	}
	// Until the exporter hangs up (after an answer, if it gives one): it has logged.
	for err == nil {
		_, err = nc.Read(make([]byte, 1<<16))
	}
	nc.Close()
	other := cudarttest.New() // a process of its own: this one's own exporter is refused
	defer other.Close()
	imp, err := consumer.Dial(ctx, args[0], other, 0)
	if err != nil {
		return fail(err)
	}
	defer imp.Close(ctx)
	if _, err := consumer.Dial(ctx, args[0], other, 0); !errors.Is(err, consumer.ErrDuplicateImporter) {
		return fail(fmt.Errorf("second Dial: %v, want ErrDuplicateImporter", err))
	}
	return 0
}
