package wire

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/cudapool/cudapool/export"
)

// DialSocket connects to the exporter's socket at path.
func DialSocket(ctx context.Context, path string) (net.Conn, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) {
			// A connect to a file that is no socket is refused too: say what is there.
			if info, serr := os.Stat(path); serr == nil && info.Mode().Type() != fs.ModeSocket {
				return nil, fmt.Errorf("%w: %s (mode %v) is not an exporter's socket", export.ErrNotSocket, path, info.Mode())
			}
			return nil, fmt.Errorf("%w: nothing listens at %s: %w", export.ErrExporterGone, path, err)
		}
		return nil, fmt.Errorf("cudapool: dial %s: %w", path, err)
	}
	return nc, nil
}

// Handshake is the connecting side's half of the handshake: it says h and reads the
// exporter's Welcome, within timeout unless ctx ends first. It fails with ErrRefused
// and the exporter's reason, ErrVersionMismatch, ErrExporterGone if the exporter hung
// up, or ctx's error. The caller closes nc on failure.
func Handshake(ctx context.Context, nc net.Conn, h *HelloMsg, timeout time.Duration) (*Conn, *WelcomeMsg, error) {
	c := NewConn(nc, true)
	deadline := time.Now().Add(timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = nc.SetDeadline(deadline)                                                   // it fails only on a closed connection, which the next read or write reports
	stop := context.AfterFunc(ctx, func() { _ = nc.SetDeadline(time.Unix(1, 0)) }) // it only wakes a blocked call; it fails only on a closed connection
	defer stop()
	if err := c.Send(ctx, h, -1); err != nil {
		return nil, nil, ctxOr(ctx, err)
	}
	m, fd, err := c.Recv()
	if fd >= 0 {
		CloseFDs([]int{fd}) // a pool handle before Welcome: refused below
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			return nil, nil, fmt.Errorf("%w: the exporter closed the connection during the handshake", export.ErrExporterGone)
		}
		return nil, nil, ctxOr(ctx, fmt.Errorf("cudapool: handshake: %w", err))
	}
	switch m := m.(type) {
	case *RefusedMsg:
		if m.Version != export.ProtocolVersion {
			return nil, nil, fmt.Errorf("%w: exporter speaks protocol version %d, this side speaks %d: %s", export.ErrVersionMismatch, m.Version, export.ProtocolVersion, m.Reason)
		}
		return nil, nil, fmt.Errorf("%w: %s", export.ErrRefused, m.Reason)
	case *WelcomeMsg:
		if m.Version != export.ProtocolVersion {
			return nil, nil, fmt.Errorf("%w: exporter speaks protocol version %d, this side speaks %d", export.ErrVersionMismatch, m.Version, export.ProtocolVersion)
		}
		if !stop() {
			return nil, nil, fmt.Errorf("cudapool: handshake: %w", ctx.Err())
		}
		_ = nc.SetDeadline(time.Time{}) // it fails only on a closed connection, which the next read or write reports
		return c, m, nil
	}
	return nil, nil, fmt.Errorf("%w: the exporter answered Hello with %s", export.ErrProtocol, m.Kind())
}

func ctxOr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("cudapool: handshake: %w", ctx.Err())
	}
	return err
}
