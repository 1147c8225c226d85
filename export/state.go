package export

import (
	"encoding/json"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/pool"
)

// StateSchema is the version of the [State] JSON schema. Fields may be added within a
// version; none is removed or changes meaning.
const StateSchema = 1

// State describes a running exporter: what cmd/poolstat shows, and what its -json
// flag prints. Its JSON form is a stable schema ([StateSchema]).
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
// [pool.Stats]. Error is set, and the figures are what could still be read, when the
// stats failed (the pool was closed, for instance). Its JSON form keeps the [State]
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

// MarshalJSON writes the [State] schema's pool object.
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

// UnmarshalJSON reads the [State] schema's pool object.
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

// The routes a published name's memory comes by ([NameState].Route).
const (
	// RoutePool is a buffer of an IPC-capable pool (producer.Exporter.Publish).
	RoutePool = "pool"
	// RouteVMM is a VMM allocation of one or more chunks (producer.Exporter.PublishChunks).
	RouteVMM = "vmm"
)

// NameState is one published name.
type NameState struct {
	Name string `json:"name"`
	// Route is how the memory is shared: [RoutePool] or [RouteVMM]. An exporter older
	// than the VMM route sends none: read "" as RoutePool.
	Route string `json:"route,omitempty"`
	// Pool and BufferID name a pool buffer; for a VMM allocation Pool is 0 and
	// BufferID the allocation's id.
	Pool     uint64 `json:"pool"`
	BufferID uint64 `json:"buffer_id"`
	Size     uint64 `json:"size"` // the buffer's, or the VMM allocation's
	// Chunks is how many chunks a VMM allocation has; 0 for a pool buffer.
	Chunks int `json:"chunks,omitempty"`
	// Offset and Length are the range published (Range), both 0 for the whole buffer.
	Offset uint64 `json:"offset,omitempty"`
	Length uint64 `json:"length,omitempty"`
	// MetaBytes is the length of the metadata published with it (WithMeta).
	MetaBytes int `json:"meta_bytes,omitempty"`
}

// PeerState is one peer, a connection that takes leases (Exporter.Peers, State.Peers).
// Connections made for [State] alone, such as QueryState's, are not peers. Leases counts
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
