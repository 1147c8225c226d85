package replica

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"time"

	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// QueryStats asks the owner serving dir for its Stats, as an observer: a connection
// that maps no slab and takes no leases, so it needs no CUDA runtime (cmd/poolstat's).
// The owner's policy admits it as any replica. It fails with an error wrapping
// [kv.ErrOwnerGone] if no owner serves dir.
func QueryStats(ctx context.Context, dir string) (kv.Stats, error) {
	var st kv.Stats
	nc, err := dialPages(ctx, filepath.Join(dir, kvwire.PageSocket), false)
	if err != nil {
		return st, err
	}
	defer func() { _ = nc.Close() }() // cleanup: nothing is left to do if closing fails
	// The deadline only wakes the read; on a closed connection the read fails anyway.
	stop := context.AfterFunc(ctx, func() { _ = nc.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	gone := func(err error) error {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return fmt.Errorf("%w: %w", kv.ErrOwnerGone, err)
	}
	b, err := kvwire.AppendHello(nil, 1, kvwire.Hello{Version: kvwire.Version, Device: kvwire.Observer})
	if err != nil {
		return st, err
	}
	b, err = kvwire.AppendEmpty(b, kvwire.TypeStats, 2)
	if err != nil {
		return st, err
	}
	if _, err := nc.Write(b); err != nil {
		return st, gone(err)
	}
	rd := kvwire.NewReader()
	for {
		h, p, err := rd.Next(nc)
		if err != nil {
			return st, gone(err)
		}
		switch h.Type {
		case kvwire.TypeWelcome:
			continue
		case kvwire.TypeRefused:
			return st, kvwire.ParseError(h.Type, p)
		case kvwire.TypeStatsReply:
			if err := json.Unmarshal(p, &st); err != nil {
				return st, fmt.Errorf("kv/replica: the owner's stats: %w", err)
			}
			b, _ := kvwire.AppendEmpty(nil, kvwire.TypeBye, 0)
			_, _ = nc.Write(b) // the stats are read; an owner that misses the Bye sees the connection close next
			return st, nil
		}
		return st, replyErr(h, p, kvwire.TypeStatsReply)
	}
}
