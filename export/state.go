package export

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/pool"
)

// StateSchema is the version of the State JSON schema. Fields may be added within a
// version; none is removed or changes meaning.
const StateSchema = 1

// State describes a running exporter: what cmd/poolstat shows, and what its -json
// flag prints. Its JSON form is a stable schema (StateSchema).
type State struct {
	Schema    int           `json:"schema"`
	Name      string        `json:"name"`
	PID       int           `json:"pid"`
	Socket    string        `json:"socket"`
	Started   time.Time     `json:"started"`
	Devices   []DeviceState `json:"devices"`
	Pools     []PoolState   `json:"pools"`
	Published []NameState   `json:"published"`
	Peers     []PeerState   `json:"peers"`
}

// DeviceState is one device of the exporter's runtime.
type DeviceState struct {
	Ordinal int    `json:"ordinal"`
	UUID    string `json:"uuid"`
}

// PoolState is one pool the exporter has published buffers of: its wire id and its
// pool.Stats. Error is set, and the figures are what could still be read, when the
// stats failed (the pool was closed, for instance). Its JSON form keeps the State
// schema's field names (see MarshalJSON).
type PoolState struct {
	ID uint64
	pool.Stats
	Error string
}

// poolStateJSON is PoolState's form in the State schema.
type poolStateJSON struct {
	ID               uint64            `json:"id"`
	Name             string            `json:"name"`
	Device           int               `json:"device"`
	HandleType       cudart.HandleType `json:"handle_type"`
	MaxSize          uint64            `json:"max_size"`
	Granularity      uint64            `json:"granularity"`
	ReservedCurrent  uint64            `json:"reserved_current"`
	ReservedHigh     uint64            `json:"reserved_high"`
	UsedCurrent      uint64            `json:"used_current"`
	UsedHigh         uint64            `json:"used_high"`
	BytesRequested   uint64            `json:"bytes_requested"`
	BytesReserved    uint64            `json:"bytes_reserved"`
	RoundingOverhead uint64            `json:"rounding_overhead"`
	BuffersLive      int               `json:"buffers_live"`
	BuffersShared    int               `json:"buffers_shared"`
	ActiveLeases     int               `json:"active_leases"`
	DeferredFrees    int               `json:"deferred_frees"`
	FailedFrees      int               `json:"failed_frees"`
	FailedFreeBytes  uint64            `json:"failed_free_bytes"`
	Error            string            `json:"error,omitempty"`
}

// MarshalJSON writes the State schema's pool object.
func (p PoolState) MarshalJSON() ([]byte, error) {
	s := p.Stats
	return json.Marshal(poolStateJSON{
		ID: p.ID, Name: s.Name, Device: s.Device, HandleType: s.HandleType, MaxSize: s.MaxSize, Granularity: s.Granularity,
		ReservedCurrent: s.ReservedCurrent, ReservedHigh: s.ReservedHigh, UsedCurrent: s.UsedCurrent, UsedHigh: s.UsedHigh,
		BytesRequested: s.BytesRequested, BytesReserved: s.BytesReserved, RoundingOverhead: s.RoundingOverhead(),
		BuffersLive: s.LiveBuffers, BuffersShared: s.SharedBuffers, ActiveLeases: s.ActiveLeases,
		DeferredFrees: s.DeferredFrees, FailedFrees: s.FailedFrees, FailedFreeBytes: s.FailedFreeBytes, Error: p.Error,
	})
}

// UnmarshalJSON reads the State schema's pool object.
func (p *PoolState) UnmarshalJSON(b []byte) error {
	var j poolStateJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return err
	}
	*p = PoolState{ID: j.ID, Error: j.Error, Stats: pool.Stats{
		Name: j.Name, Device: j.Device, HandleType: j.HandleType, MaxSize: j.MaxSize, Granularity: j.Granularity,
		ReservedCurrent: j.ReservedCurrent, ReservedHigh: j.ReservedHigh, UsedCurrent: j.UsedCurrent, UsedHigh: j.UsedHigh,
		BytesRequested: j.BytesRequested, BytesReserved: j.BytesReserved,
		LiveBuffers: j.BuffersLive, SharedBuffers: j.BuffersShared, ActiveLeases: j.ActiveLeases,
		DeferredFrees: j.DeferredFrees, FailedFrees: j.FailedFrees, FailedFreeBytes: j.FailedFreeBytes,
	}}
	if j.BytesRequested == 0 && j.BytesReserved == 0 {
		// An exporter that sends only the overhead: keep the figure RoundingOverhead gives.
		p.BytesReserved = j.RoundingOverhead
	}
	return nil
}

// NameState is one published name.
type NameState struct {
	Name     string `json:"name"`
	Pool     uint64 `json:"pool"`
	BufferID uint64 `json:"buffer_id"`
	Size     uint64 `json:"size"` // the buffer's
	// Offset and Length are the range published (Range), both 0 for the whole buffer.
	Offset uint64 `json:"offset,omitempty"`
	Length uint64 `json:"length,omitempty"`
	// MetaBytes is the length of the metadata published with it (WithMeta).
	MetaBytes int `json:"meta_bytes,omitempty"`
}

// PeerState is one peer, a connection that takes leases (Exporter.Peers, State.Peers).
// Connections made for State alone, such as QueryState's, are not peers. Leases counts
// the buffers the peer holds, Grants the Opens and Pushes behind them (see the
// glossary in the package documentation).
type PeerState struct {
	PID int    `json:"pid"`
	UID uint32 `json:"uid"`
	GID uint32 `json:"gid"`
	// Remote is set for a peer on a byte stream, which has no credentials.
	Remote bool `json:"remote"`
	// Device is the UUID of the device the peer imports to.
	Device         string    `json:"device,omitempty"`
	Leases         int       `json:"leases"`
	Grants         int       `json:"grants"`
	BytesLeased    uint64    `json:"bytes_leased"`
	ConnectedSince time.Time `json:"connected_since"`
	// AwaitingExit is set for a peer whose connection was lost without Bye while its
	// process lives on: it may still map what it holds, so its leases are kept until
	// the process exits.
	AwaitingExit bool `json:"awaiting_exit,omitempty"`
}

// State returns a snapshot of the exporter. Figures of different pools and peers are
// read one after another, not at one instant.
func (ex *Exporter) State() (*State, error) {
	st := &State{Schema: StateSchema, Name: ex.opts.name, PID: os.Getpid(), Socket: absPath(ex.sock.path),
		Started: ex.started, Devices: []DeviceState{}, Pools: []PoolState{}, Published: []NameState{}, Peers: []PeerState{}}
	for i, u := range ex.devices {
		st.Devices = append(st.Devices, DeviceState{Ordinal: i, UUID: u.String()})
	}
	ex.mu.Lock()
	pools := make(map[*pool.Pool]uint64, len(ex.pools))
	for p, id := range ex.pools {
		pools[p] = id
	}
	for _, pub := range ex.pubs {
		ns := NameState{Name: pub.name, Pool: ex.pools[pub.buf.Pool()], BufferID: pub.buf.ID(), Size: pub.buf.Size(), MetaBytes: len(pub.meta)}
		if pub.offset != 0 || pub.length != pub.buf.Size() {
			ns.Offset, ns.Length = pub.offset, pub.length
		}
		st.Published = append(st.Published, ns)
	}
	ex.mu.Unlock()
	for p, id := range pools {
		st.Pools = append(st.Pools, poolState(p, id))
	}
	st.Peers = append(st.Peers, ex.Peers()...)
	slices.SortFunc(st.Pools, func(a, b PoolState) int { return cmp.Compare(a.ID, b.ID) })
	slices.SortFunc(st.Published, func(a, b NameState) int { return cmp.Compare(a.Name, b.Name) })
	slices.SortFunc(st.Peers, func(a, b PeerState) int { return cmp.Compare(a.PID, b.PID) })
	return st, nil
}

func poolState(p *pool.Pool, id uint64) PoolState {
	s, err := p.Stats()
	ps := PoolState{ID: id, Stats: s}
	if err != nil {
		ps.Error = err.Error()
	}
	return ps
}

// QueryState connects to the exporter at socketPath as an observer, a connection that
// takes no leases, asks for its State and disconnects. The exporter's admission policy applies as to any peer: a
// refusal wraps ErrRefused. It needs no CUDA runtime.
func QueryState(ctx context.Context, socketPath string, opts ...QueryOption) (*State, error) {
	o := newQueryOptions(opts)
	nc, err := dialSocket(ctx, socketPath)
	if err != nil {
		return nil, err
	}
	c, w, err := handshake(ctx, nc, &helloMsg{Version: ProtocolVersion, PID: uint32(os.Getpid())}, o.handshakeTimeout)
	if err != nil {
		nc.Close()
		return nil, err
	}
	cl := newClient(c, o.log, int(w.PID))
	cl.handle = func(m message, _ int) error {
		return protocolErr("unexpected %s on a connection for State alone", m.kind())
	}
	cl.start()
	defer cl.hangUp(ctx)
	body, err := cl.queryState(ctx)
	if err != nil {
		return nil, err
	}
	var st State
	if err := json.Unmarshal(body, &st); err != nil {
		return nil, fmt.Errorf("%w: State is not valid JSON: %w", ErrProtocol, err)
	}
	return &st, nil
}

// sendState sends the exporter's State as JSON, in as many frames as it takes.
func (ex *Exporter) sendState(c *conn, reqID uint64) error {
	st, err := ex.State()
	if err != nil {
		return err
	}
	body, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("export: state: %w", err)
	}
	const chunk = maxPayload - 12
	for {
		n := min(len(body), chunk)
		m := &stateMsg{ReqID: reqID, JSON: body[:n]}
		if n < len(body) {
			m.Flags = stateMore
		}
		if err := c.send(context.Background(), m, -1); err != nil {
			return err
		}
		if body = body[n:]; len(body) == 0 {
			return nil
		}
	}
}
