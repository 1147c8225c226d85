package wire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/internal/printable"
)

// The frame layout: [u32 little-endian payload length][u8 type][payload].
const (
	HeaderLen = 5
	// MaxFrame bounds a whole frame, header included, so a peer cannot make the other
	// side allocate more than this for one message.
	MaxFrame   = 64 << 10
	MaxPayload = MaxFrame - HeaderLen
	// MaxDevices bounds the device UUIDs a Welcome lists.
	MaxDevices = 16
	// MaxStateBytes bounds the JSON a State reply may add up to across its frames.
	MaxStateBytes = 16 << 20
)

// MsgType is a frame's type byte.
type MsgType uint8

const (
	MsgHello        MsgType = 1  // importer: version, pid, device, release event
	MsgWelcome      MsgType = 2  // exporter: admitted
	MsgRefused      MsgType = 3  // exporter: not admitted, and why; then close
	MsgPoolHandle   MsgType = 4  // exporter: a pool's handle (fd attached for POSIX fd)
	MsgOpen         MsgType = 5  // importer: lease the buffer under a name
	MsgLease        MsgType = 6  // exporter: the lease answering an Open
	MsgRelease      MsgType = 7  // importer: give a lease back
	MsgReleased     MsgType = 8  // exporter: the lease has ended
	MsgError        MsgType = 9  // exporter: a request failed
	MsgPush         MsgType = 10 // exporter: a lease nobody asked for
	MsgStateRequest MsgType = 11 // importer: describe yourself
	MsgState        MsgType = 12 // exporter: a chunk of the State JSON
	MsgBye          MsgType = 13 // either: no more requests from me
	MsgRevoke       MsgType = 14 // exporter: free your retained import of this record
	MsgRevoked      MsgType = 15 // importer: freed it, as of my release event
	MsgOpenBatch    MsgType = 16 // importer: lease the buffers under these names
	MsgLeaseBatch   MsgType = 17 // exporter: leases answering an OpenBatch, in one or more frames
	MsgReleaseBatch MsgType = 18 // importer: give these leases back; answered by one Released
	MsgChunkHandle  MsgType = 19 // exporter: one chunk of a VMM allocation (fd attached for POSIX fd)
	MsgDropChunks   MsgType = 20 // exporter: the allocation is unpublished; close its chunks
)

var msgNames = [...]string{
	MsgHello: "Hello", MsgWelcome: "Welcome", MsgRefused: "Refused", MsgPoolHandle: "PoolHandle",
	MsgOpen: "Open", MsgLease: "Lease", MsgRelease: "Release", MsgReleased: "Released",
	MsgError: "Error", MsgPush: "Push", MsgStateRequest: "StateRequest", MsgState: "State", MsgBye: "Bye",
	MsgRevoke: "Revoke", MsgRevoked: "Revoked",
	MsgOpenBatch: "OpenBatch", MsgLeaseBatch: "LeaseBatch", MsgReleaseBatch: "ReleaseBatch",
	MsgChunkHandle: "ChunkHandle", MsgDropChunks: "DropChunks",
}

func (t MsgType) String() string {
	if int(t) < len(msgNames) && msgNames[t] != "" {
		return msgNames[t]
	}
	return fmt.Sprintf("type %d", uint8(t))
}

// Message is one decoded frame.
type Message interface {
	Kind() MsgType
	// AppendPayload appends the payload's fixed binary layout to b.
	AppendPayload(b []byte) []byte
}

// Hello flags.
const (
	// HelloLeases: the peer takes leases; Device and HandleTypes are meaningful.
	HelloLeases uint32 = 1 << 0
	// HelloReleaseEvent: ReleaseEvent is an IPC event recorded after each of the
	// peer's frees. A leasing peer without one synchronises its frees before it
	// sends Release (a peer on another host, where IPC events cannot travel).
	HelloReleaseEvent uint32 = 1 << 1
	HelloKnown               = HelloLeases | HelloReleaseEvent
)

type HelloMsg struct {
	Version      uint32
	PID          uint32
	Flags        uint32
	HandleTypes  uint32 // the cudart.HandleType bits the peer can import
	Device       cudart.UUID
	ReleaseEvent cudart.IpcEventHandle
}

const helloLen = 4*4 + 16 + 64

// Welcome flags.
const (
	// WelcomeRetain: the exporter lets the importer keep its imports mapped past
	// their leases (Release with releaseRetain), and revokes them with Revoke.
	WelcomeRetain uint32 = 1 << 0
	WelcomeKnown         = WelcomeRetain
)

type WelcomeMsg struct {
	Version uint32
	PID     uint32
	Flags   uint32
	Devices []cudart.UUID // at most maxDevices
}

const welcomeLen = 4*4 + MaxDevices*16

type RefusedMsg struct {
	Version uint32
	Reason  string
}

type PoolHandleMsg struct {
	PoolID     uint64
	HandleType cudart.HandleType
	Device     cudart.UUID
	MaxSize    uint64
	Fabric     cudart.FabricHandle // zero unless HandleType is FABRIC
}

const poolHandleLen = 8 + 4 + 16 + 8 + 64

type OpenMsg struct {
	ReqID uint64
	Name  string
}

// Lease flags.
const (
	// LeaseReadyEvent: Ready is an IPC event the consumer's stream must wait on.
	// Without it the exporter waited for the producer's writes before it answered.
	LeaseReadyEvent uint32 = 1 << 0
	// LeaseVMM: the lease is of a VMM allocation (chunk.go): PoolID names the
	// allocation, whose chunks came before it; BufferID and Record are zero.
	LeaseVMM   uint32 = 1 << 1
	LeaseKnown        = LeaseReadyEvent | LeaseVMM
)

type LeaseMsg struct {
	ReqID    uint64
	LeaseID  uint64
	PoolID   uint64
	BufferID uint64
	Size     uint64 // the whole buffer's, which the importer maps
	// Offset and Length are the range of the buffer the lease is for.
	Offset, Length uint64
	Flags          uint32
	Record         cudart.PtrExportData
	Ready          cudart.IpcEventHandle
	Meta           []byte // at most export.MaxMetaLen; its length goes before Record
}

// LeaseLen is a Lease's fixed part; the metadata follows it.
const LeaseLen = 8*7 + 4 + 4 + 64 + 64

// PushMsg is a lease the exporter sends unasked, with the name it was published under.
type PushMsg struct {
	LeaseMsg
	Name string
}

// Release flags.
const (
	// ReleaseNothingImported: the importer imported nothing under the lease (a push it
	// did not want), so the exporter need not wait for any free of it.
	ReleaseNothingImported uint32 = 1 << 0
	// ReleaseRetain: the importer keeps its import mapped; its release event covers
	// its work on the buffer, not a free. The exporter revokes it before the memory
	// goes back to the driver. Only where the Welcome allowed it.
	ReleaseRetain uint32 = 1 << 1
	ReleaseKnown         = ReleaseNothingImported | ReleaseRetain
)

type ReleaseMsg struct {
	ReqID   uint64
	LeaseID uint64
	// Count is how many grants of the lease the importer returns: an exporter asked
	// twice for a buffer a connection already holds grants the same lease again.
	Count uint32
	Flags uint32
}

const releaseLen = 8 + 8 + 4 + 4

type ReleasedMsg struct {
	ReqID   uint64
	LeaseID uint64
}

const releasedLen = 8 + 8

// ErrCode says on the wire which sentinel an Error frame stands for.
type ErrCode uint32

const (
	codeExporter ErrCode = iota + 1
	codeUnknownName
	codeStaleLease
	codeForeignLease // read as export.ErrStaleLease; exporters send codeStaleLease for every case
	codeForgedLease  // read as export.ErrStaleLease; exporters send codeStaleLease for every case
	CodeBufferGone
	codeClosed
	codeHandleType
	codeIMEXRequired
	codeBadRequest
	codeNoLeases
	codeTooManyGrants
	CodeLimit // one past the last code
)

var CodeErrs = [CodeLimit]error{
	codeExporter: export.ErrExporter, codeUnknownName: export.ErrUnknownName, codeStaleLease: export.ErrStaleLease,
	codeForeignLease: export.ErrStaleLease, codeForgedLease: export.ErrStaleLease, CodeBufferGone: export.ErrBufferGone,
	codeClosed: export.ErrExporterGone, codeHandleType: export.ErrHandleType, codeIMEXRequired: export.ErrIMEXRequired,
	codeBadRequest: export.ErrBadRequest, codeNoLeases: export.ErrNoLeases, codeTooManyGrants: export.ErrTooManyGrants,
}

// CodeOf is the wire code for err: the first sentinel it wraps, else codeExporter.
func CodeOf(err error) ErrCode {
	switch {
	case errors.Is(err, export.ErrClosed):
		return codeClosed
	case errors.Is(err, export.ErrBufferGone): // an ErrUnknownName too: its own code first
		return CodeBufferGone
	}
	for c := codeExporter + 1; c < CodeLimit; c++ {
		if errors.Is(err, CodeErrs[c]) {
			return c
		}
	}
	return codeExporter
}

type ErrorMsg struct {
	ReqID uint64
	Code  ErrCode
	Text  string
}

// ErrorFor is the Error frame answering request reqID with err, its text cut to fit
// the frame.
func ErrorFor(reqID uint64, err error) *ErrorMsg {
	return &ErrorMsg{ReqID: reqID, Code: CodeOf(err), Text: FitText(err.Error(), MaxPayload-8-4)}
}

// FitText is s cut to at most n bytes on a character boundary, the cut marked with an
// ellipsis.
func FitText(s string, n int) string {
	if len(s) <= n {
		return s
	}
	const mark = "…"
	cut := n - len(mark)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + mark
}

type StateRequestMsg struct{ ReqID uint64 }

// State flags.
const (
	StateMore  uint32 = 1 << 0 // more State frames follow for this request
	StateKnown        = StateMore
)

type StateMsg struct {
	ReqID uint64
	Flags uint32
	JSON  []byte
}

type ByeMsg struct{}

// RevokeMsg asks the importer to free its retained import of Record, and revokedMsg
// says it has, as of the importer's release event.
type RevokeMsg struct{ Record cudart.PtrExportData }

type RevokedMsg struct{ Record cudart.PtrExportData }

const revokeLen = len(cudart.PtrExportData{})

// OpenBatchMsg asks for many names at once: each is a u8 length and its bytes.
type OpenBatchMsg struct {
	ReqID uint64
	Names []string
}

// LeaseBatch flags.
const (
	LeaseBatchMore  uint32 = 1 << 0 // more LeaseBatch frames follow for this request
	LeaseBatchKnown        = LeaseBatchMore
)

// LeaseBatchMsg answers an OpenBatch: its leases, in the order of the names, over as
// many frames as they need, each lease laid out as in Lease (with the batch's ReqID).
type LeaseBatchMsg struct {
	ReqID  uint64
	Flags  uint32
	Leases []LeaseMsg
}

const LeaseBatchHeaderLen = 8 + 4 + 4

// ReleaseBatchMsg gives back grants of many leases; each entry is a Release's lease
// id, count and flags.
type ReleaseBatchMsg struct {
	ReqID   uint64
	Entries []ReleaseMsg // ReqID unused
}

const releaseEntryLen = 8 + 4 + 4

func (*HelloMsg) Kind() MsgType { return MsgHello }

func (*WelcomeMsg) Kind() MsgType { return MsgWelcome }

func (*RefusedMsg) Kind() MsgType { return MsgRefused }

func (*PoolHandleMsg) Kind() MsgType { return MsgPoolHandle }

func (*OpenMsg) Kind() MsgType { return MsgOpen }

func (*LeaseMsg) Kind() MsgType { return MsgLease }

func (*PushMsg) Kind() MsgType { return MsgPush }

func (*ReleaseMsg) Kind() MsgType { return MsgRelease }

func (*ReleasedMsg) Kind() MsgType { return MsgReleased }

func (*ErrorMsg) Kind() MsgType { return MsgError }

func (*StateRequestMsg) Kind() MsgType { return MsgStateRequest }

func (*StateMsg) Kind() MsgType { return MsgState }

func (*ByeMsg) Kind() MsgType { return MsgBye }

func (*RevokeMsg) Kind() MsgType { return MsgRevoke }

func (*RevokedMsg) Kind() MsgType { return MsgRevoked }

func (*OpenBatchMsg) Kind() MsgType { return MsgOpenBatch }

func (*LeaseBatchMsg) Kind() MsgType { return MsgLeaseBatch }

func (*ReleaseBatchMsg) Kind() MsgType { return MsgReleaseBatch }

var Le = binary.LittleEndian

func (m *HelloMsg) AppendPayload(b []byte) []byte {
	b = Le.AppendUint32(b, m.Version)
	b = Le.AppendUint32(b, m.PID)
	b = Le.AppendUint32(b, m.Flags)
	b = Le.AppendUint32(b, m.HandleTypes)
	b = append(b, m.Device[:]...)
	return append(b, m.ReleaseEvent[:]...)
}

func (m *WelcomeMsg) AppendPayload(b []byte) []byte {
	b = Le.AppendUint32(b, m.Version)
	b = Le.AppendUint32(b, m.PID)
	b = Le.AppendUint32(b, m.Flags)
	b = Le.AppendUint32(b, uint32(len(m.Devices)))
	var slots [MaxDevices]cudart.UUID
	copy(slots[:], m.Devices)
	for _, u := range slots {
		b = append(b, u[:]...)
	}
	return b
}

func (m *RefusedMsg) AppendPayload(b []byte) []byte {
	return append(Le.AppendUint32(b, m.Version), m.Reason...)
}

func (m *PoolHandleMsg) AppendPayload(b []byte) []byte {
	b = Le.AppendUint64(b, m.PoolID)
	b = Le.AppendUint32(b, uint32(m.HandleType))
	b = append(b, m.Device[:]...)
	b = Le.AppendUint64(b, m.MaxSize)
	return append(b, m.Fabric[:]...)
}

func (m *OpenMsg) AppendPayload(b []byte) []byte {
	return append(Le.AppendUint64(b, m.ReqID), m.Name...)
}

func (m *LeaseMsg) AppendPayload(b []byte) []byte {
	b = Le.AppendUint64(b, m.ReqID)
	b = Le.AppendUint64(b, m.LeaseID)
	b = Le.AppendUint64(b, m.PoolID)
	b = Le.AppendUint64(b, m.BufferID)
	b = Le.AppendUint64(b, m.Size)
	b = Le.AppendUint64(b, m.Offset)
	b = Le.AppendUint64(b, m.Length)
	b = Le.AppendUint32(b, m.Flags)
	b = Le.AppendUint32(b, uint32(len(m.Meta)))
	b = append(b, m.Record[:]...)
	b = append(b, m.Ready[:]...)
	return append(b, m.Meta...)
}

func (m *PushMsg) AppendPayload(b []byte) []byte {
	return append(m.LeaseMsg.AppendPayload(b), m.Name...)
}

func (m *ReleaseMsg) AppendPayload(b []byte) []byte {
	b = Le.AppendUint64(b, m.ReqID)
	b = Le.AppendUint64(b, m.LeaseID)
	b = Le.AppendUint32(b, m.Count)
	return Le.AppendUint32(b, m.Flags)
}

func (m *ReleasedMsg) AppendPayload(b []byte) []byte {
	return Le.AppendUint64(Le.AppendUint64(b, m.ReqID), m.LeaseID)
}

func (m *ErrorMsg) AppendPayload(b []byte) []byte {
	b = Le.AppendUint64(b, m.ReqID)
	b = Le.AppendUint32(b, uint32(m.Code))
	return append(b, m.Text...)
}

func (m *StateRequestMsg) AppendPayload(b []byte) []byte { return Le.AppendUint64(b, m.ReqID) }

func (m *StateMsg) AppendPayload(b []byte) []byte {
	return append(Le.AppendUint32(Le.AppendUint64(b, m.ReqID), m.Flags), m.JSON...)
}

func (*ByeMsg) AppendPayload(b []byte) []byte { return b }

func (m *RevokeMsg) AppendPayload(b []byte) []byte { return append(b, m.Record[:]...) }

func (m *OpenBatchMsg) AppendPayload(b []byte) []byte {
	b = Le.AppendUint64(b, m.ReqID)
	for _, n := range m.Names {
		b = append(append(b, byte(len(n))), n...)
	}
	return b
}

func (m *LeaseBatchMsg) AppendPayload(b []byte) []byte {
	b = Le.AppendUint32(Le.AppendUint32(Le.AppendUint64(b, m.ReqID), m.Flags), uint32(len(m.Leases)))
	for i := range m.Leases {
		b = m.Leases[i].AppendPayload(b)
	}
	return b
}

func (m *ReleaseBatchMsg) AppendPayload(b []byte) []byte {
	b = Le.AppendUint32(Le.AppendUint64(b, m.ReqID), uint32(len(m.Entries)))
	for _, e := range m.Entries {
		b = Le.AppendUint32(Le.AppendUint32(Le.AppendUint64(b, e.LeaseID), e.Count), e.Flags)
	}
	return b
}

func (m *RevokedMsg) AppendPayload(b []byte) []byte { return append(b, m.Record[:]...) }

// AppendFrame appends m as one whole frame to b.
func AppendFrame(b []byte, m Message) []byte {
	start := len(b)
	b = append(b, 0, 0, 0, 0, byte(m.Kind()))
	b = m.AppendPayload(b)
	Le.PutUint32(b[start:], uint32(len(b)-start-HeaderLen))
	return b
}

// parseHeader checks a frame header and returns the payload length it announces.
// A header is refused before its payload is read: an unknown type, or a length the type
// cannot have (an oversized frame among them).
func parseHeader(h []byte) (MsgType, int, error) {
	n := Le.Uint32(h)
	t := MsgType(h[4])
	if n > MaxPayload {
		return t, 0, ProtocolErr("oversized frame: %s payload of %d bytes, the limit is %d", t, n, MaxPayload)
	}
	if int(t) >= len(PayloadLimits) || PayloadLimits[t].Max == 0 && t != MsgBye {
		return t, 0, ProtocolErr("unknown message type %d", uint8(t))
	}
	lim := PayloadLimits[t]
	if int(n) < lim.Min || int(n) > lim.Max {
		if lim.Min == lim.Max {
			return t, 0, ProtocolErr("%s payload is %d bytes, want %d", t, n, lim.Min)
		}
		return t, 0, ProtocolErr("%s payload is %d bytes, want %d to %d", t, n, lim.Min, lim.Max)
	}
	return t, int(n), nil
}

// PayloadLimits gives each type's smallest and largest payload length.
var PayloadLimits = [...]struct{ Min, Max int }{
	// A Hello of another protocol version may have another length: its version,
	// first, is read before the length is held to this version's.
	MsgHello:        {4, MaxPayload},
	MsgWelcome:      {welcomeLen, welcomeLen},
	MsgRefused:      {4 + 1, MaxPayload},
	MsgPoolHandle:   {poolHandleLen, poolHandleLen},
	MsgOpen:         {8 + 1, 8 + export.MaxNameLen},
	MsgLease:        {LeaseLen, LeaseLen + export.MaxMetaLen},
	MsgRelease:      {releaseLen, releaseLen},
	MsgReleased:     {releasedLen, releasedLen},
	MsgError:        {8 + 4 + 1, MaxPayload},
	MsgPush:         {LeaseLen + 1, LeaseLen + export.MaxMetaLen + export.MaxNameLen},
	MsgStateRequest: {8, 8},
	MsgState:        {8 + 4, MaxPayload},
	MsgBye:          {0, 0},
	MsgRevoke:       {revokeLen, revokeLen},
	MsgRevoked:      {revokeLen, revokeLen},
	MsgOpenBatch:    {8 + 2, MaxPayload},
	MsgLeaseBatch:   {LeaseBatchHeaderLen + LeaseLen, MaxPayload},
	MsgReleaseBatch: {8 + 4, 8 + 4 + export.MaxBatch*releaseEntryLen},
	MsgChunkHandle:  {chunkHandleLen, chunkHandleLen},
	MsgDropChunks:   {dropChunksLen, dropChunksLen},
}

// DecodePayload decodes the payload of a frame whose header parseHeader accepted.
// Every field is checked: unknown flag bits, out-of-range counts, names and texts that
// are not clean UTF-8, and non-zero padding are all refused, so that a frame decodes
// only if encoding what it decoded to gives the same bytes.
//
// Each type with more than fixed fields to check has its decoder, decode<Type>,
// which returns the message or the [export.ErrProtocol] that says what is wrong;
// a switch, not a table of functions, so that the reader stays on the stack.
func DecodePayload(t MsgType, p []byte) (Message, error) {
	r := reader{b: p}
	switch t {
	case MsgHello:
		return decodeHello(&r)
	case MsgWelcome:
		return decodeWelcome(&r)
	case MsgRefused:
		m := &RefusedMsg{Version: r.u32()}
		var err error
		m.Reason, err = r.text(t, "reason")
		return m, err
	case MsgPoolHandle:
		return decodePoolHandle(&r)
	case MsgOpen:
		m := &OpenMsg{ReqID: r.u64()}
		var err error
		m.Name, err = r.name(t)
		return m, err
	case MsgLease:
		return decodeLease(&r)
	case MsgPush:
		return decodePush(&r)
	case MsgRelease:
		m := &ReleaseMsg{ReqID: r.u64(), LeaseID: r.u64(), Count: r.u32(), Flags: r.u32()}
		return m, checkFlags(t, m.Flags, ReleaseKnown)
	case MsgReleased:
		return &ReleasedMsg{ReqID: r.u64(), LeaseID: r.u64()}, nil
	case MsgError:
		return decodeError(&r)
	case MsgStateRequest:
		return &StateRequestMsg{ReqID: r.u64()}, nil
	case MsgState:
		m := &StateMsg{ReqID: r.u64(), Flags: r.u32()}
		m.JSON = bytes.Clone(r.rest()) // the read buffer is reused for the next frame
		return m, checkFlags(t, m.Flags, StateKnown)
	case MsgBye:
		return &ByeMsg{}, nil
	case MsgOpenBatch:
		return decodeOpenBatch(&r)
	case MsgLeaseBatch:
		return decodeLeaseBatch(&r)
	case MsgReleaseBatch:
		return decodeReleaseBatch(&r)
	case MsgRevoke:
		m := &RevokeMsg{}
		r.bytes(m.Record[:])
		return m, nil
	case MsgRevoked:
		m := &RevokedMsg{}
		r.bytes(m.Record[:])
		return m, nil
	case MsgChunkHandle:
		return decodeChunkHandle(&r)
	case MsgDropChunks:
		return decodeDropChunks(&r)
	}
	return nil, ProtocolErr("unknown message type %d", uint8(t))
}

// decodeHello refuses another protocol version first ([export.ErrVersionMismatch]),
// then a payload of another length than this version's, unknown flags, and a
// release event without leases.
func decodeHello(r *reader) (Message, error) {
	m := &HelloMsg{Version: r.u32()}
	if m.Version != export.ProtocolVersion {
		return nil, versionErr(m.Version)
	}
	if len(r.b) != helloLen {
		return nil, ProtocolErr("%s payload is %d bytes, want %d", MsgHello, len(r.b), helloLen)
	}
	m.PID, m.Flags, m.HandleTypes = r.u32(), r.u32(), r.u32()
	r.bytes(m.Device[:])
	r.bytes(m.ReleaseEvent[:])
	if err := checkFlags(MsgHello, m.Flags, HelloKnown); err != nil {
		return nil, err
	}
	if m.Flags&HelloReleaseEvent != 0 && m.Flags&HelloLeases == 0 {
		return nil, ProtocolErr("Hello has a release event but takes no leases")
	}
	return m, nil
}

// decodeWelcome refuses unknown flags, more than [MaxDevices] devices, and bytes in
// the device slots past the count.
func decodeWelcome(r *reader) (Message, error) {
	m := &WelcomeMsg{Version: r.u32(), PID: r.u32(), Flags: r.u32()}
	if err := checkFlags(MsgWelcome, m.Flags, WelcomeKnown); err != nil {
		return nil, err
	}
	n := r.u32()
	if n > MaxDevices {
		return nil, ProtocolErr("Welcome lists %d devices, at most %d", n, MaxDevices)
	}
	m.Devices = make([]cudart.UUID, n)
	for i := range MaxDevices {
		var u cudart.UUID
		r.bytes(u[:])
		if uint32(i) < n {
			m.Devices[i] = u
		} else if u != (cudart.UUID{}) {
			return nil, ProtocolErr("Welcome has bytes in unused device slot %d", i)
		}
	}
	return m, nil
}

// decodePoolHandle refuses a handle type and fabric bytes that do not agree.
func decodePoolHandle(r *reader) (Message, error) {
	m := &PoolHandleMsg{PoolID: r.u64(), HandleType: cudart.HandleType(r.u32())}
	r.bytes(m.Device[:])
	m.MaxSize = r.u64()
	r.bytes(m.Fabric[:])
	if err := checkHandle(MsgPoolHandle, m.HandleType, m.Fabric); err != nil {
		return nil, err
	}
	return m, nil
}

// decodeLease refuses what [reader.lease] refuses, and bytes after the metadata.
func decodeLease(r *reader) (Message, error) {
	m := &LeaseMsg{}
	if err := r.lease(m); err != nil {
		return nil, err
	}
	if r.i != len(r.b) {
		return nil, ProtocolErr("Lease has %d bytes after its metadata", len(r.b)-r.i)
	}
	return m, nil
}

// decodePush refuses what [reader.lease] refuses, a request id other than 0, and a
// name that cannot be published.
func decodePush(r *reader) (Message, error) {
	m := &PushMsg{}
	if err := r.lease(&m.LeaseMsg); err != nil {
		return nil, err
	}
	if m.ReqID != 0 {
		return nil, ProtocolErr("Push has request id %d, want 0", m.ReqID)
	}
	var err error
	m.Name, err = r.name(MsgPush)
	return m, err
}

// decodeError refuses an unknown code and a text that is not UTF-8.
func decodeError(r *reader) (Message, error) {
	m := &ErrorMsg{ReqID: r.u64(), Code: ErrCode(r.u32())}
	if m.Code == 0 || m.Code >= CodeLimit {
		return nil, ProtocolErr("Error has unknown code %d", m.Code)
	}
	var err error
	m.Text, err = r.text(MsgError, "text")
	return m, err
}

// decodeOpenBatch reads names, each a length byte and its bytes, to the end of the
// payload; it refuses a name past the end, one that cannot be published, and more
// than [export.MaxBatch] names.
func decodeOpenBatch(r *reader) (Message, error) {
	m := &OpenBatchMsg{ReqID: r.u64()}
	p := r.b
	for r.i < len(p) {
		n := int(p[r.i])
		r.i++
		if n > len(p)-r.i {
			return nil, ProtocolErr("OpenBatch name %d runs past the frame", len(m.Names))
		}
		name := string(p[r.i : r.i+n])
		r.i += n
		if err := CheckName(name); err != nil {
			return nil, ProtocolErr("OpenBatch: %v", err)
		}
		m.Names = append(m.Names, name)
	}
	if len(m.Names) > export.MaxBatch {
		return nil, ProtocolErr("OpenBatch has %d names, at most %d", len(m.Names), export.MaxBatch)
	}
	return m, nil
}

// decodeLeaseBatch refuses unknown flags, a count of leases outside 1 to
// [export.MaxBatch], a lease past the end or of another request id, what
// [reader.lease] refuses, and bytes after the leases.
func decodeLeaseBatch(r *reader) (Message, error) {
	m := &LeaseBatchMsg{ReqID: r.u64(), Flags: r.u32()}
	n := r.u32()
	if err := checkFlags(MsgLeaseBatch, m.Flags, LeaseBatchKnown); err != nil {
		return nil, err
	}
	if n == 0 || n > export.MaxBatch {
		return nil, ProtocolErr("LeaseBatch has %d leases, want 1 to %d", n, export.MaxBatch)
	}
	m.Leases = make([]LeaseMsg, n)
	for i := range m.Leases {
		if len(r.b)-r.i < LeaseLen {
			return nil, ProtocolErr("LeaseBatch lease %d runs past the frame", i)
		}
		if err := r.lease(&m.Leases[i]); err != nil {
			return nil, err
		}
		if m.Leases[i].ReqID != m.ReqID {
			return nil, ProtocolErr("LeaseBatch lease %d has request id %d, want %d", i, m.Leases[i].ReqID, m.ReqID)
		}
	}
	if r.i != len(r.b) {
		return nil, ProtocolErr("LeaseBatch has %d bytes after its leases", len(r.b)-r.i)
	}
	return m, nil
}

// decodeReleaseBatch refuses a count that does not fill the payload exactly and an
// entry with unknown flags.
func decodeReleaseBatch(r *reader) (Message, error) {
	m := &ReleaseBatchMsg{ReqID: r.u64()}
	n := r.u32()
	if int(n)*releaseEntryLen != len(r.b)-r.i { // no entries: a bad request, answered
		return nil, ProtocolErr("ReleaseBatch says %d entries in %d bytes", n, len(r.b)-r.i)
	}
	m.Entries = make([]ReleaseMsg, n)
	for i := range m.Entries {
		e := &m.Entries[i]
		e.LeaseID, e.Count, e.Flags = r.u64(), r.u32(), r.u32()
		if err := checkFlags(MsgRelease, e.Flags, ReleaseKnown); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// reader reads fixed fields from a payload whose length parseHeader has checked, so
// the fixed part is always there.
type reader struct {
	b []byte
	i int
}

func (r *reader) u32() uint32 { v := Le.Uint32(r.b[r.i:]); r.i += 4; return v }

func (r *reader) u64() uint64 { v := Le.Uint64(r.b[r.i:]); r.i += 8; return v }

func (r *reader) bytes(dst []byte) { r.i += copy(dst, r.b[r.i:]) }

func (r *reader) rest() []byte {
	v := r.b[r.i:]
	r.i = len(r.b)
	return v
}

func (r *reader) lease(m *LeaseMsg) error {
	m.ReqID, m.LeaseID, m.PoolID, m.BufferID, m.Size = r.u64(), r.u64(), r.u64(), r.u64(), r.u64()
	m.Offset, m.Length = r.u64(), r.u64()
	m.Flags = r.u32()
	metaLen := r.u32()
	r.bytes(m.Record[:])
	r.bytes(m.Ready[:])
	if err := checkFlags(MsgLease, m.Flags, LeaseKnown); err != nil {
		return err
	}
	if m.Flags&LeaseReadyEvent == 0 && m.Ready != (cudart.IpcEventHandle{}) {
		return ProtocolErr("Lease carries event bytes without the ready-event flag")
	}
	if m.Flags&LeaseVMM != 0 && (m.Record != (cudart.PtrExportData{}) || m.BufferID != 0) {
		return ProtocolErr("Lease of a VMM allocation carries a buffer id or a pointer's export record")
	}
	if err := CheckRange(m.Size, m.Offset, m.Length); err != nil {
		return ProtocolErr("Lease: %v", err)
	}
	if metaLen > export.MaxMetaLen || int(metaLen) > len(r.b)-r.i {
		return ProtocolErr("Lease has %d bytes of metadata, %d are there and at most %d allowed", metaLen, len(r.b)-r.i, export.MaxMetaLen)
	}
	if metaLen > 0 {
		m.Meta = bytes.Clone(r.b[r.i : r.i+int(metaLen)]) // the read buffer is reused
		r.i += int(metaLen)
	}
	return nil
}

// CheckRange says why length bytes at offset are not a range of a size-byte buffer.
func CheckRange(size, offset, length uint64) error {
	if length == 0 || offset > size || length > size-offset {
		return fmt.Errorf("%w: %d bytes at offset %d of a %d-byte buffer", export.ErrBadRange, length, offset, size)
	}
	return nil
}

func (r *reader) name(t MsgType) (string, error) {
	name := string(r.rest())
	if err := CheckName(name); err != nil {
		return "", ProtocolErr("%s: %v", t, err)
	}
	return name, nil
}

func (r *reader) text(t MsgType, field string) (string, error) {
	s := r.rest()
	if !utf8.Valid(s) {
		return "", ProtocolErr("%s %s is not UTF-8", t, field)
	}
	return string(s), nil
}

// CheckName says why name cannot be published, or nil.
func CheckName(name string) error {
	if err := printable.Check(name, export.MaxNameLen); err != nil {
		return fmt.Errorf("%w: %w", export.ErrBadName, err)
	}
	return nil
}

func checkFlags(t MsgType, flags, known uint32) error {
	if flags&^known != 0 {
		return ProtocolErr("%s has unknown flags %#x", t, flags&^known)
	}
	return nil
}

func ProtocolErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", export.ErrProtocol, fmt.Sprintf(format, args...))
}

func versionErr(peer uint32) error {
	return fmt.Errorf("%w: peer speaks protocol version %d, this side speaks %d", export.ErrVersionMismatch, peer, export.ProtocolVersion)
}
