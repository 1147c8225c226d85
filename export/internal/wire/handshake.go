package wire

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/internal/session"
)

// DialSocket connects to the exporter's socket at path; with wait, it waits for an
// exporter to listen there, until ctx ends ([session.Dial]). It fails with
// [export.ErrExporterGone] where nothing listens, [export.ErrNotSocket] where the file
// is no socket.
func DialSocket(ctx context.Context, path string, wait bool) (net.Conn, error) {
	nc, err := session.Dial(ctx, path, wait)
	switch {
	case err == nil:
		return nc, nil
	case errors.Is(err, session.ErrNotSocket):
		return nil, fmt.Errorf("%w: %w, not an exporter's socket", export.ErrNotSocket, err)
	case errors.Is(err, session.ErrNoListener):
		return nil, fmt.Errorf("%w: %w", export.ErrExporterGone, err)
	}
	return nil, fmt.Errorf("cudapool: dial %s: %w", path, err)
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
