package producer

import (
	"cmp"
	"encoding/json"
	"fmt"
	"os"
	"slices"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/pool"
)

// State returns a snapshot of the exporter. Figures of different pools and peers are
// read one after another, not at one instant.
func (ex *Exporter) State() (*export.State, error) {
	st := &export.State{Schema: export.StateSchema, Name: ex.opts.name, PID: os.Getpid(), Socket: absPath(ex.sock.path),
		Started: ex.started, Devices: []export.DeviceState{}, Pools: []export.PoolState{}, Published: []export.NameState{}, Peers: []export.PeerState{}}
	for i, u := range ex.devices {
		st.Devices = append(st.Devices, export.DeviceState{Ordinal: i, UUID: u.String()})
	}
	ex.mu.Lock()
	pools := make(map[*pool.Pool]uint64, len(ex.pools))
	for p, id := range ex.pools {
		pools[p] = id
	}
	for _, pub := range ex.pubs {
		var ns export.NameState
		if a := pub.alloc; a != nil {
			a.mu.Lock()
			ns = export.NameState{Name: pub.name, Route: export.RouteVMM, BufferID: a.id, Size: a.size, Chunks: len(a.chunks), MetaBytes: len(pub.meta)}
			a.mu.Unlock()
		} else {
			ns = export.NameState{Name: pub.name, Route: export.RoutePool, Pool: ex.pools[pub.buf.Pool()], BufferID: pub.buf.ID(), Size: pub.buf.Size(), MetaBytes: len(pub.meta)}
		}
		if pub.offset != 0 || pub.length != ns.Size {
			ns.Offset, ns.Length = pub.offset, pub.length
		}
		st.Published = append(st.Published, ns)
	}
	ex.mu.Unlock()
	for p, id := range pools {
		st.Pools = append(st.Pools, poolState(p, id))
	}
	st.Peers = append(st.Peers, ex.Peers()...)
	slices.SortFunc(st.Pools, func(a, b export.PoolState) int { return cmp.Compare(a.ID, b.ID) })
	slices.SortFunc(st.Published, func(a, b export.NameState) int { return cmp.Compare(a.Name, b.Name) })
	slices.SortFunc(st.Peers, func(a, b export.PeerState) int { return cmp.Compare(a.PID, b.PID) })
	return st, nil
}

func poolState(p *pool.Pool, id uint64) export.PoolState {
	s, err := p.Stats()
	ps := export.PoolState{ID: id, Stats: s}
	if err != nil {
		ps.Error = err.Error()
	}
	return ps
}

// sendState sends the exporter's State as JSON, in as many frames as it takes.
func (ex *Exporter) sendState(c *wire.Conn, reqID uint64) error {
	st, err := ex.State()
	if err != nil {
		return err
	}
	body, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("producer: state: %w", err)
	}
	const chunk = wire.MaxPayload - 12
	ctx, cancel := bounded()
	defer cancel()
	for {
		n := min(len(body), chunk)
		m := &wire.StateMsg{ReqID: reqID, JSON: body[:n]}
		if n < len(body) {
			m.Flags = wire.StateMore
		}
		if err := c.Send(ctx, m, -1); err != nil {
			return err
		}
		if body = body[n:]; len(body) == 0 {
			return nil
		}
	}
}
