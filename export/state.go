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

// PoolState is one pool the exporter has published buffers of, with its figures from
// pool.Stats. Error is set, and the figures are what could still be read, when the
// stats failed (the pool was closed, for instance).
type PoolState struct {
	ID               uint64 `json:"id"`
	Name             string `json:"name"`
	Device           int    `json:"device"`
	HandleType       string `json:"handle_type"`
	MaxSize          uint64 `json:"max_size"`
	ReservedCurrent  uint64 `json:"reserved_current"`
	ReservedHigh     uint64 `json:"reserved_high"`
	UsedCurrent      uint64 `json:"used_current"`
	UsedHigh         uint64 `json:"used_high"`
	RoundingOverhead uint64 `json:"rounding_overhead"`
	BuffersLive      int    `json:"buffers_live"`
	BuffersShared    int    `json:"buffers_shared"`
	ActiveLeases     int    `json:"active_leases"`
	DeferredFrees    int    `json:"deferred_frees"`
	FailedFrees      int    `json:"failed_frees"`
	Error            string `json:"error,omitempty"`
}

// NameState is one published name.
type NameState struct {
	Name     string `json:"name"`
	Pool     uint64 `json:"pool"`
	BufferID uint64 `json:"buffer_id"`
	Size     uint64 `json:"size"`
}

// PeerState is one peer that takes leases (PeerInfo). State-only connections, such as
// the one QueryState makes, are not listed.
type PeerState struct {
	PID            int       `json:"pid"`
	UID            uint32    `json:"uid"`
	GID            uint32    `json:"gid"`
	Remote         bool      `json:"remote"`
	Device         string    `json:"device,omitempty"`
	Leases         int       `json:"leases"`
	Grants         int       `json:"grants"`
	BytesLeased    uint64    `json:"bytes_leased"`
	ConnectedSince time.Time `json:"connected_since"`
	AwaitingExit   bool      `json:"awaiting_exit,omitempty"`
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
		st.Published = append(st.Published, NameState{Name: pub.name, Pool: ex.pools[pub.buf.Pool()], BufferID: pub.buf.ID(), Size: pub.buf.Size()})
	}
	ex.mu.Unlock()
	for p, id := range pools {
		st.Pools = append(st.Pools, poolState(p, id))
	}
	for _, i := range ex.Peers() {
		ps := PeerState{PID: i.PID, UID: i.UID, GID: i.GID, Remote: i.Remote, Leases: i.Leases, Grants: i.Grants,
			BytesLeased: i.BytesLeased, ConnectedSince: i.ConnectedSince, AwaitingExit: i.AwaitingExit}
		if i.Device != (cudart.UUID{}) {
			ps.Device = i.Device.String()
		}
		st.Peers = append(st.Peers, ps)
	}
	slices.SortFunc(st.Pools, func(a, b PoolState) int { return cmp.Compare(a.ID, b.ID) })
	slices.SortFunc(st.Published, func(a, b NameState) int { return cmp.Compare(a.Name, b.Name) })
	slices.SortFunc(st.Peers, func(a, b PeerState) int { return cmp.Compare(a.PID, b.PID) })
	return st, nil
}

func poolState(p *pool.Pool, id uint64) PoolState {
	s, err := p.Stats()
	ps := PoolState{
		ID: id, Name: s.Name, Device: s.Device, HandleType: s.HandleType.String(), MaxSize: s.MaxSize,
		ReservedCurrent: s.ReservedCurrent, ReservedHigh: s.ReservedHigh, UsedCurrent: s.UsedCurrent, UsedHigh: s.UsedHigh,
		RoundingOverhead: s.RoundingOverhead(), BuffersLive: s.LiveBuffers, BuffersShared: s.SharedBuffers,
		ActiveLeases: s.ActiveLeases, DeferredFrees: s.DeferredFrees, FailedFrees: s.FailedFrees,
	}
	if err != nil {
		ps.Error = err.Error()
	}
	return ps
}

// QueryState connects to the exporter at socketPath without a device, asks for its
// State and disconnects. The exporter's admission policy applies as to any peer: a
// refusal wraps ErrRefused. It needs no CUDA runtime.
func QueryState(ctx context.Context, socketPath string, opts ...Option) (*State, error) {
	imp, err := dial(ctx, socketPath, nil, -1, applyOptions(opts))
	if err != nil {
		return nil, err
	}
	defer imp.Close(ctx)
	body, err := imp.queryState(ctx)
	if err != nil {
		return nil, err
	}
	var st State
	if err := json.Unmarshal(body, &st); err != nil {
		return nil, fmt.Errorf("%w: State is not valid JSON: %w", ErrProtocol, err)
	}
	return &st, nil
}
