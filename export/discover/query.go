package discover

import (
	"context"
	"encoding/json"
	"fmt"
	"os"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// QueryState connects to the exporter at socketPath as an observer, a connection that
// takes no leases, asks for its State and disconnects. The exporter's admission policy applies as to any peer: a
// refusal wraps [export.ErrRefused]. It needs no CUDA runtime.
func QueryState(ctx context.Context, socketPath string, opts ...QueryOption) (*export.State, error) {
	o := newQueryOptions(opts)
	nc, err := wire.DialSocket(ctx, socketPath, false)
	if err != nil {
		return nil, err
	}
	c, w, err := wire.Handshake(ctx, nc, &wire.HelloMsg{Version: export.ProtocolVersion, PID: uint32(os.Getpid())}, o.HandshakeTimeout)
	if err != nil {
		_ = nc.Close() // cleanup: nothing is left to do if closing fails
		return nil, err
	}
	cl := wire.NewClient(c, o.Log, int(w.PID))
	cl.Handle = func(m wire.Message, _ int) error {
		return wire.ProtocolErr("unexpected %s on a connection for export.State alone", m.Kind())
	}
	cl.Start()
	defer func() { _ = cl.HangUp(ctx) }() // the export.State is read; an exporter that does not answer the Bye is its own business
	body, err := cl.QueryState(ctx)
	if err != nil {
		return nil, err
	}
	var st export.State
	if err := json.Unmarshal(body, &st); err != nil {
		return nil, fmt.Errorf("%w: export.State is not valid JSON: %w", export.ErrProtocol, err)
	}
	return &st, nil
}
