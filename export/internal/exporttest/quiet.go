package exporttest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/producer"
)

// RoleQuiet: quiet SOCKET. With every logger left at its default, it listens on
// SOCKET, lets a second Listen probe it, sends a connection garbage and waits until
// the exporter hung up on it, and is refused by a second Dial. It writes nothing to
// stderr itself unless one of those steps does not go as expected.
func RoleQuiet(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "quiet:", err); return 1 }
	d := cudarttest.New()
	defer func() { _ = d.Close() }() // cleanup: what is tested is above
	ctx := context.Background()
	ex, err := producer.Listen(args[0], d, producer.WithoutAnnounce())
	if err != nil {
		return fail(err)
	}
	defer func() { _ = ex.Close(ctx) }() // cleanup: what is tested is above
	if _, err := producer.Listen(args[0], d, producer.WithoutAnnounce()); !errors.Is(err, producer.ErrAddressInUse) {
		return fail(fmt.Errorf("second Listen: %v, want ErrAddressInUse", err))
	}
	nc, err := net.Dial("unix", args[0])
	if err != nil {
		return fail(err)
	}
	_ = nc.SetDeadline(time.Now().Add(time.Minute)) // a hang ends the role, failing the test
	if _, err := nc.Write(bytes.Repeat([]byte{0xff}, 64)); err != nil {
		return fail(err)
	}
	// Until the exporter hangs up (after an answer, if it gives one): it has logged.
	for err == nil {
		_, err = nc.Read(make([]byte, 1<<16))
	}
	_ = nc.Close()                       // cleanup: what is tested is above
	other := cudarttest.New()            // a process of its own: this one's own exporter is refused
	defer func() { _ = other.Close() }() // cleanup: what is tested is above
	imp, err := consumer.Dial(ctx, args[0], other, 0)
	if err != nil {
		return fail(err)
	}
	defer func() { _ = imp.Close(ctx) }() // cleanup: what is tested is above
	if _, err := consumer.Dial(ctx, args[0], other, 0); !errors.Is(err, consumer.ErrDuplicateImporter) {
		return fail(fmt.Errorf("second Dial: %v, want ErrDuplicateImporter", err))
	}
	return 0
}
