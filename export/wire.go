package export

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/printable"
)

// ProtocolVersion is the version of the sharing protocol this package speaks. Both
// sides must speak the same one. Version 2 leases a range of a buffer and carries the
// publish's metadata with each lease, and adds retained imports: Welcome's flags,
// Release's retain flag, Revoke and Revoked.
const ProtocolVersion = 2

// The frame layout: [u32 little-endian payload length][u8 type][payload].
const (
	headerLen = 5
	// maxFrame bounds a whole frame, header included, so a peer cannot make the other
	// side allocate more than this for one message.
	maxFrame   = 64 << 10
	maxPayload = maxFrame - headerLen
	// MaxNameLen is the longest name a buffer can be published under, in bytes.
	MaxNameLen = 255
	// MaxMetaLen is the most metadata a publish can carry (WithMeta), in bytes.
	MaxMetaLen = 4096
	// maxDevices bounds the device UUIDs a Welcome lists.
	maxDevices = 16
	// maxStateBytes bounds the JSON a State reply may add up to across its frames.
	maxStateBytes = 16 << 20
)

// msgType is a frame's type byte.
type msgType uint8

const (
	msgHello        msgType = 1  // importer: version, pid, device, release event
	msgWelcome      msgType = 2  // exporter: admitted
	msgRefused      msgType = 3  // exporter: not admitted, and why; then close
	msgPoolHandle   msgType = 4  // exporter: a pool's handle (fd attached for POSIX fd)
	msgOpen         msgType = 5  // importer: lease the buffer under a name
	msgLease        msgType = 6  // exporter: the lease answering an Open
	msgRelease      msgType = 7  // importer: give a lease back
	msgReleased     msgType = 8  // exporter: the lease has ended
	msgError        msgType = 9  // exporter: a request failed
	msgPush         msgType = 10 // exporter: a lease nobody asked for
	msgStateRequest msgType = 11 // importer: describe yourself
	msgState        msgType = 12 // exporter: a chunk of the State JSON
	msgBye          msgType = 13 // either: no more requests from me
	msgRevoke       msgType = 14 // exporter: free your retained import of this record
	msgRevoked      msgType = 15 // importer: freed it, as of my release event
	msgOpenBatch    msgType = 16 // importer: lease the buffers under these names
	msgLeaseBatch   msgType = 17 // exporter: leases answering an OpenBatch, in one or more frames
	msgReleaseBatch msgType = 18 // importer: give these leases back; answered by one Released
)

var msgNames = [...]string{
	msgHello: "Hello", msgWelcome: "Welcome", msgRefused: "Refused", msgPoolHandle: "PoolHandle",
	msgOpen: "Open", msgLease: "Lease", msgRelease: "Release", msgReleased: "Released",
	msgError: "Error", msgPush: "Push", msgStateRequest: "StateRequest", msgState: "State", msgBye: "Bye",
	msgRevoke: "Revoke", msgRevoked: "Revoked",
	msgOpenBatch: "OpenBatch", msgLeaseBatch: "LeaseBatch", msgReleaseBatch: "ReleaseBatch",
}

func (t msgType) String() string {
	if int(t) < len(msgNames) && msgNames[t] != "" {
		return msgNames[t]
	}
	return fmt.Sprintf("type %d", uint8(t))
}

// message is one decoded frame.
type message interface {
	kind() msgType
	// appendPayload appends the payload's fixed binary layout to b.
	appendPayload(b []byte) []byte
}

// Hello flags.
const (
	// helloLeases: the peer takes leases; Device and HandleTypes are meaningful.
	helloLeases uint32 = 1 << 0
	// helloReleaseEvent: ReleaseEvent is an IPC event recorded after each of the
	// peer's frees. A leasing peer without one synchronises its frees before it
	// sends Release (a peer on another host, where IPC events cannot travel).
	helloReleaseEvent uint32 = 1 << 1
	helloKnown               = helloLeases | helloReleaseEvent
)

type helloMsg struct {
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
	// welcomeRetain: the exporter lets the importer keep its imports mapped past
	// their leases (Release with releaseRetain), and revokes them with Revoke.
	welcomeRetain uint32 = 1 << 0
	welcomeKnown         = welcomeRetain
)

type welcomeMsg struct {
	Version uint32
	PID     uint32
	Flags   uint32
	Devices []cudart.UUID // at most maxDevices
}

const welcomeLen = 4*4 + maxDevices*16

type refusedMsg struct {
	Version uint32
	Reason  string
}

type poolHandleMsg struct {
	PoolID     uint64
	HandleType cudart.HandleType
	Device     cudart.UUID
	MaxSize    uint64
	Fabric     cudart.FabricHandle // zero unless HandleType is FABRIC
}

const poolHandleLen = 8 + 4 + 16 + 8 + 64

type openMsg struct {
	ReqID uint64
	Name  string
}

// Lease flags.
const (
	// leaseReadyEvent: Ready is an IPC event the consumer's stream must wait on.
	// Without it the exporter waited for the producer's writes before it answered.
	leaseReadyEvent uint32 = 1 << 0
	leaseKnown             = leaseReadyEvent
)

type leaseMsg struct {
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
	Meta           []byte // at most MaxMetaLen; its length goes before Record
}

// leaseLen is a Lease's fixed part; the metadata follows it.
const leaseLen = 8*7 + 4 + 4 + 64 + 64

// pushMsg is a lease the exporter sends unasked, with the name it was published under.
type pushMsg struct {
	leaseMsg
	Name string
}

// Release flags.
const (
	// releaseNothingImported: the importer imported nothing under the lease (a push it
	// did not want), so the exporter need not wait for any free of it.
	releaseNothingImported uint32 = 1 << 0
	// releaseRetain: the importer keeps its import mapped; its release event covers
	// its work on the buffer, not a free. The exporter revokes it before the memory
	// goes back to the driver. Only where the Welcome allowed it.
	releaseRetain uint32 = 1 << 1
	releaseKnown         = releaseNothingImported | releaseRetain
)

type releaseMsg struct {
	ReqID   uint64
	LeaseID uint64
	// Count is how many grants of the lease the importer returns: an exporter asked
	// twice for a buffer a connection already holds grants the same lease again.
	Count uint32
	Flags uint32
}

const releaseLen = 8 + 8 + 4 + 4

type releasedMsg struct {
	ReqID   uint64
	LeaseID uint64
}

const releasedLen = 8 + 8

// errCode says on the wire which sentinel an Error frame stands for.
type errCode uint32

const (
	codeExporter errCode = iota + 1
	codeUnknownName
	codeStaleLease
	codeForeignLease
	codeForgedLease
	codeBufferGone
	codeClosed
	codeHandleType
	codeIMEXRequired
	codeBadRequest
	codeNoLeases
	codeTooManyGrants
	codeLimit // one past the last code
)

var codeErrs = [codeLimit]error{
	codeExporter: ErrExporter, codeUnknownName: ErrUnknownName, codeStaleLease: ErrStaleLease,
	codeForeignLease: ErrForeignLease, codeForgedLease: ErrForgedLease, codeBufferGone: ErrBufferGone,
	codeClosed: ErrExporterGone, codeHandleType: ErrHandleType, codeIMEXRequired: ErrIMEXRequired,
	codeBadRequest: ErrBadRequest, codeNoLeases: ErrNoLeases, codeTooManyGrants: ErrTooManyGrants,
}

// codeOf is the wire code for err: the first sentinel it wraps, else codeExporter.
func codeOf(err error) errCode {
	if errors.Is(err, ErrClosed) {
		return codeClosed
	}
	for c := codeExporter + 1; c < codeLimit; c++ {
		if errors.Is(err, codeErrs[c]) {
			return c
		}
	}
	return codeExporter
}

type errorMsg struct {
	ReqID uint64
	Code  errCode
	Text  string
}

// errorFor is the Error frame answering request reqID with err, its text cut to fit
// the frame.
func errorFor(reqID uint64, err error) *errorMsg {
	return &errorMsg{ReqID: reqID, Code: codeOf(err), Text: fitText(err.Error(), maxPayload-8-4)}
}

// fitText is s cut to at most n bytes on a character boundary, the cut marked with an
// ellipsis.
func fitText(s string, n int) string {
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

type stateRequestMsg struct{ ReqID uint64 }

// State flags.
const (
	stateMore  uint32 = 1 << 0 // more State frames follow for this request
	stateKnown        = stateMore
)

type stateMsg struct {
	ReqID uint64
	Flags uint32
	JSON  []byte
}

type byeMsg struct{}

// revokeMsg asks the importer to free its retained import of Record, and revokedMsg
// says it has, as of the importer's release event.
type revokeMsg struct{ Record cudart.PtrExportData }

type revokedMsg struct{ Record cudart.PtrExportData }

const revokeLen = len(cudart.PtrExportData{})

// MaxBatch is the most names an OpenBatch (Importer.OpenAll) and the most leases a
// ReleaseBatch (Importer.ReleaseAll) may carry.
const MaxBatch = 1024

// openBatchMsg asks for many names at once: each is a u8 length and its bytes.
type openBatchMsg struct {
	ReqID uint64
	Names []string
}

// LeaseBatch flags.
const (
	leaseBatchMore  uint32 = 1 << 0 // more LeaseBatch frames follow for this request
	leaseBatchKnown        = leaseBatchMore
)

// leaseBatchMsg answers an OpenBatch: its leases, in the order of the names, over as
// many frames as they need, each lease laid out as in Lease (with the batch's ReqID).
type leaseBatchMsg struct {
	ReqID  uint64
	Flags  uint32
	Leases []leaseMsg
}

const leaseBatchHeaderLen = 8 + 4 + 4

// releaseBatchMsg gives back grants of many leases; each entry is a Release's lease
// id, count and flags.
type releaseBatchMsg struct {
	ReqID   uint64
	Entries []releaseMsg // ReqID unused
}

const releaseEntryLen = 8 + 4 + 4

func (*helloMsg) kind() msgType        { return msgHello }
func (*welcomeMsg) kind() msgType      { return msgWelcome }
func (*refusedMsg) kind() msgType      { return msgRefused }
func (*poolHandleMsg) kind() msgType   { return msgPoolHandle }
func (*openMsg) kind() msgType         { return msgOpen }
func (*leaseMsg) kind() msgType        { return msgLease }
func (*pushMsg) kind() msgType         { return msgPush }
func (*releaseMsg) kind() msgType      { return msgRelease }
func (*releasedMsg) kind() msgType     { return msgReleased }
func (*errorMsg) kind() msgType        { return msgError }
func (*stateRequestMsg) kind() msgType { return msgStateRequest }
func (*stateMsg) kind() msgType        { return msgState }
func (*byeMsg) kind() msgType          { return msgBye }
func (*revokeMsg) kind() msgType       { return msgRevoke }
func (*revokedMsg) kind() msgType      { return msgRevoked }
func (*openBatchMsg) kind() msgType    { return msgOpenBatch }
func (*leaseBatchMsg) kind() msgType   { return msgLeaseBatch }
func (*releaseBatchMsg) kind() msgType { return msgReleaseBatch }

var le = binary.LittleEndian

func (m *helloMsg) appendPayload(b []byte) []byte {
	b = le.AppendUint32(b, m.Version)
	b = le.AppendUint32(b, m.PID)
	b = le.AppendUint32(b, m.Flags)
	b = le.AppendUint32(b, m.HandleTypes)
	b = append(b, m.Device[:]...)
	return append(b, m.ReleaseEvent[:]...)
}

func (m *welcomeMsg) appendPayload(b []byte) []byte {
	b = le.AppendUint32(b, m.Version)
	b = le.AppendUint32(b, m.PID)
	b = le.AppendUint32(b, m.Flags)
	b = le.AppendUint32(b, uint32(len(m.Devices)))
	var slots [maxDevices]cudart.UUID
	copy(slots[:], m.Devices)
	for _, u := range slots {
		b = append(b, u[:]...)
	}
	return b
}

func (m *refusedMsg) appendPayload(b []byte) []byte {
	return append(le.AppendUint32(b, m.Version), m.Reason...)
}

func (m *poolHandleMsg) appendPayload(b []byte) []byte {
	b = le.AppendUint64(b, m.PoolID)
	b = le.AppendUint32(b, uint32(m.HandleType))
	b = append(b, m.Device[:]...)
	b = le.AppendUint64(b, m.MaxSize)
	return append(b, m.Fabric[:]...)
}

func (m *openMsg) appendPayload(b []byte) []byte {
	return append(le.AppendUint64(b, m.ReqID), m.Name...)
}

func (m *leaseMsg) appendPayload(b []byte) []byte {
	b = le.AppendUint64(b, m.ReqID)
	b = le.AppendUint64(b, m.LeaseID)
	b = le.AppendUint64(b, m.PoolID)
	b = le.AppendUint64(b, m.BufferID)
	b = le.AppendUint64(b, m.Size)
	b = le.AppendUint64(b, m.Offset)
	b = le.AppendUint64(b, m.Length)
	b = le.AppendUint32(b, m.Flags)
	b = le.AppendUint32(b, uint32(len(m.Meta)))
	b = append(b, m.Record[:]...)
	b = append(b, m.Ready[:]...)
	return append(b, m.Meta...)
}

func (m *pushMsg) appendPayload(b []byte) []byte {
	return append(m.leaseMsg.appendPayload(b), m.Name...)
}

func (m *releaseMsg) appendPayload(b []byte) []byte {
	b = le.AppendUint64(b, m.ReqID)
	b = le.AppendUint64(b, m.LeaseID)
	b = le.AppendUint32(b, m.Count)
	return le.AppendUint32(b, m.Flags)
}

func (m *releasedMsg) appendPayload(b []byte) []byte {
	return le.AppendUint64(le.AppendUint64(b, m.ReqID), m.LeaseID)
}

func (m *errorMsg) appendPayload(b []byte) []byte {
	b = le.AppendUint64(b, m.ReqID)
	b = le.AppendUint32(b, uint32(m.Code))
	return append(b, m.Text...)
}

func (m *stateRequestMsg) appendPayload(b []byte) []byte { return le.AppendUint64(b, m.ReqID) }

func (m *stateMsg) appendPayload(b []byte) []byte {
	return append(le.AppendUint32(le.AppendUint64(b, m.ReqID), m.Flags), m.JSON...)
}

func (*byeMsg) appendPayload(b []byte) []byte { return b }

func (m *revokeMsg) appendPayload(b []byte) []byte { return append(b, m.Record[:]...) }

func (m *openBatchMsg) appendPayload(b []byte) []byte {
	b = le.AppendUint64(b, m.ReqID)
	for _, n := range m.Names {
		b = append(append(b, byte(len(n))), n...)
	}
	return b
}

func (m *leaseBatchMsg) appendPayload(b []byte) []byte {
	b = le.AppendUint32(le.AppendUint32(le.AppendUint64(b, m.ReqID), m.Flags), uint32(len(m.Leases)))
	for i := range m.Leases {
		b = m.Leases[i].appendPayload(b)
	}
	return b
}

func (m *releaseBatchMsg) appendPayload(b []byte) []byte {
	b = le.AppendUint32(le.AppendUint64(b, m.ReqID), uint32(len(m.Entries)))
	for _, e := range m.Entries {
		b = le.AppendUint32(le.AppendUint32(le.AppendUint64(b, e.LeaseID), e.Count), e.Flags)
	}
	return b
}
func (m *revokedMsg) appendPayload(b []byte) []byte { return append(b, m.Record[:]...) }

// appendFrame appends m as one whole frame to b.
func appendFrame(b []byte, m message) []byte {
	start := len(b)
	b = append(b, 0, 0, 0, 0, byte(m.kind()))
	b = m.appendPayload(b)
	le.PutUint32(b[start:], uint32(len(b)-start-headerLen))
	return b
}

// parseHeader checks a frame header and returns the payload length it announces.
// A header is refused before its payload is read: an unknown type, or a length the type
// cannot have (an oversized frame among them).
func parseHeader(h []byte) (msgType, int, error) {
	n := le.Uint32(h)
	t := msgType(h[4])
	if n > maxPayload {
		return t, 0, protocolErr("oversized frame: %s payload of %d bytes, the limit is %d", t, n, maxPayload)
	}
	if int(t) >= len(payloadLimits) || payloadLimits[t].max == 0 && t != msgBye {
		return t, 0, protocolErr("unknown message type %d", uint8(t))
	}
	lim := payloadLimits[t]
	if int(n) < lim.min || int(n) > lim.max {
		if lim.min == lim.max {
			return t, 0, protocolErr("%s payload is %d bytes, want %d", t, n, lim.min)
		}
		return t, 0, protocolErr("%s payload is %d bytes, want %d to %d", t, n, lim.min, lim.max)
	}
	return t, int(n), nil
}

// payloadLimits gives each type's smallest and largest payload length.
var payloadLimits = [...]struct{ min, max int }{
	// A Hello of another protocol version may have another length: its version,
	// first, is read before the length is held to this version's.
	msgHello:        {4, maxPayload},
	msgWelcome:      {welcomeLen, welcomeLen},
	msgRefused:      {4 + 1, maxPayload},
	msgPoolHandle:   {poolHandleLen, poolHandleLen},
	msgOpen:         {8 + 1, 8 + MaxNameLen},
	msgLease:        {leaseLen, leaseLen + MaxMetaLen},
	msgRelease:      {releaseLen, releaseLen},
	msgReleased:     {releasedLen, releasedLen},
	msgError:        {8 + 4 + 1, maxPayload},
	msgPush:         {leaseLen + 1, leaseLen + MaxMetaLen + MaxNameLen},
	msgStateRequest: {8, 8},
	msgState:        {8 + 4, maxPayload},
	msgBye:          {0, 0},
	msgRevoke:       {revokeLen, revokeLen},
	msgRevoked:      {revokeLen, revokeLen},
	msgOpenBatch:    {8 + 2, maxPayload},
	msgLeaseBatch:   {leaseBatchHeaderLen + leaseLen, maxPayload},
	msgReleaseBatch: {8 + 4, 8 + 4 + MaxBatch*releaseEntryLen},
}

// decodePayload decodes the payload of a frame whose header parseHeader accepted.
// Every field is checked: unknown flag bits, out-of-range counts, names and texts that
// are not clean UTF-8, and non-zero padding are all refused, so that a frame decodes
// only if encoding what it decoded to gives the same bytes.
func decodePayload(t msgType, p []byte) (message, error) {
	r := reader{b: p}
	switch t {
	case msgHello:
		m := &helloMsg{Version: r.u32()}
		if m.Version != ProtocolVersion {
			return nil, versionErr(m.Version)
		}
		if len(p) != helloLen {
			return nil, protocolErr("%s payload is %d bytes, want %d", t, len(p), helloLen)
		}
		m.PID, m.Flags, m.HandleTypes = r.u32(), r.u32(), r.u32()
		r.bytes(m.Device[:])
		r.bytes(m.ReleaseEvent[:])
		if err := checkFlags(t, m.Flags, helloKnown); err != nil {
			return nil, err
		}
		if m.Flags&helloReleaseEvent != 0 && m.Flags&helloLeases == 0 {
			return nil, protocolErr("Hello has a release event but takes no leases")
		}
		return m, nil
	case msgWelcome:
		m := &welcomeMsg{Version: r.u32(), PID: r.u32(), Flags: r.u32()}
		if err := checkFlags(t, m.Flags, welcomeKnown); err != nil {
			return nil, err
		}
		n := r.u32()
		if n > maxDevices {
			return nil, protocolErr("Welcome lists %d devices, at most %d", n, maxDevices)
		}
		m.Devices = make([]cudart.UUID, n)
		for i := range maxDevices {
			var u cudart.UUID
			r.bytes(u[:])
			if uint32(i) < n {
				m.Devices[i] = u
			} else if u != (cudart.UUID{}) {
				return nil, protocolErr("Welcome has bytes in unused device slot %d", i)
			}
		}
		return m, nil
	case msgRefused:
		m := &refusedMsg{Version: r.u32()}
		var err error
		m.Reason, err = r.text(t, "reason")
		return m, err
	case msgPoolHandle:
		m := &poolHandleMsg{PoolID: r.u64(), HandleType: cudart.HandleType(r.u32())}
		r.bytes(m.Device[:])
		m.MaxSize = r.u64()
		r.bytes(m.Fabric[:])
		switch m.HandleType {
		case cudart.HandleTypePosixFD:
			if m.Fabric != (cudart.FabricHandle{}) {
				return nil, protocolErr("POSIX fd PoolHandle carries fabric bytes")
			}
		case cudart.HandleTypeFabric:
		default:
			return nil, protocolErr("PoolHandle has handle type %v, want posix-fd or fabric", m.HandleType)
		}
		return m, nil
	case msgOpen:
		m := &openMsg{ReqID: r.u64()}
		var err error
		m.Name, err = r.name(t)
		return m, err
	case msgLease:
		m := &leaseMsg{}
		if err := r.lease(m); err != nil {
			return nil, err
		}
		if r.i != len(p) {
			return nil, protocolErr("Lease has %d bytes after its metadata", len(p)-r.i)
		}
		return m, nil
	case msgPush:
		m := &pushMsg{}
		if err := r.lease(&m.leaseMsg); err != nil {
			return nil, err
		}
		if m.ReqID != 0 {
			return nil, protocolErr("Push has request id %d, want 0", m.ReqID)
		}
		var err error
		m.Name, err = r.name(t)
		return m, err
	case msgRelease:
		m := &releaseMsg{ReqID: r.u64(), LeaseID: r.u64(), Count: r.u32(), Flags: r.u32()}
		return m, checkFlags(t, m.Flags, releaseKnown)
	case msgReleased:
		return &releasedMsg{ReqID: r.u64(), LeaseID: r.u64()}, nil
	case msgError:
		m := &errorMsg{ReqID: r.u64(), Code: errCode(r.u32())}
		if m.Code == 0 || m.Code >= codeLimit {
			return nil, protocolErr("Error has unknown code %d", m.Code)
		}
		var err error
		m.Text, err = r.text(t, "text")
		return m, err
	case msgStateRequest:
		return &stateRequestMsg{ReqID: r.u64()}, nil
	case msgState:
		m := &stateMsg{ReqID: r.u64(), Flags: r.u32()}
		m.JSON = bytes.Clone(r.rest()) // the read buffer is reused for the next frame
		return m, checkFlags(t, m.Flags, stateKnown)
	case msgBye:
		return &byeMsg{}, nil
	case msgOpenBatch:
		m := &openBatchMsg{ReqID: r.u64()}
		for r.i < len(p) {
			n := int(p[r.i])
			r.i++
			if n > len(p)-r.i {
				return nil, protocolErr("OpenBatch name %d runs past the frame", len(m.Names))
			}
			name := string(p[r.i : r.i+n])
			r.i += n
			if err := checkName(name); err != nil {
				return nil, protocolErr("OpenBatch: %v", err)
			}
			m.Names = append(m.Names, name)
		}
		if len(m.Names) > MaxBatch {
			return nil, protocolErr("OpenBatch has %d names, at most %d", len(m.Names), MaxBatch)
		}
		return m, nil
	case msgLeaseBatch:
		m := &leaseBatchMsg{ReqID: r.u64(), Flags: r.u32()}
		n := r.u32()
		if err := checkFlags(t, m.Flags, leaseBatchKnown); err != nil {
			return nil, err
		}
		if n == 0 || n > MaxBatch {
			return nil, protocolErr("LeaseBatch has %d leases, want 1 to %d", n, MaxBatch)
		}
		m.Leases = make([]leaseMsg, n)
		for i := range m.Leases {
			if len(p)-r.i < leaseLen {
				return nil, protocolErr("LeaseBatch lease %d runs past the frame", i)
			}
			if err := r.lease(&m.Leases[i]); err != nil {
				return nil, err
			}
			if m.Leases[i].ReqID != m.ReqID {
				return nil, protocolErr("LeaseBatch lease %d has request id %d, want %d", i, m.Leases[i].ReqID, m.ReqID)
			}
		}
		if r.i != len(p) {
			return nil, protocolErr("LeaseBatch has %d bytes after its leases", len(p)-r.i)
		}
		return m, nil
	case msgReleaseBatch:
		m := &releaseBatchMsg{ReqID: r.u64()}
		n := r.u32()
		if int(n)*releaseEntryLen != len(p)-r.i { // no entries: a bad request, answered
			return nil, protocolErr("ReleaseBatch says %d entries in %d bytes", n, len(p)-r.i)
		}
		m.Entries = make([]releaseMsg, n)
		for i := range m.Entries {
			e := &m.Entries[i]
			e.LeaseID, e.Count, e.Flags = r.u64(), r.u32(), r.u32()
			if err := checkFlags(msgRelease, e.Flags, releaseKnown); err != nil {
				return nil, err
			}
		}
		return m, nil
	case msgRevoke:
		m := &revokeMsg{}
		r.bytes(m.Record[:])
		return m, nil
	case msgRevoked:
		m := &revokedMsg{}
		r.bytes(m.Record[:])
		return m, nil
	}
	return nil, protocolErr("unknown message type %d", uint8(t))
}

// reader reads fixed fields from a payload whose length parseHeader has checked, so
// the fixed part is always there.
type reader struct {
	b []byte
	i int
}

func (r *reader) u32() uint32      { v := le.Uint32(r.b[r.i:]); r.i += 4; return v }
func (r *reader) u64() uint64      { v := le.Uint64(r.b[r.i:]); r.i += 8; return v }
func (r *reader) bytes(dst []byte) { r.i += copy(dst, r.b[r.i:]) }
func (r *reader) rest() []byte {
	v := r.b[r.i:]
	r.i = len(r.b)
	return v
}

func (r *reader) lease(m *leaseMsg) error {
	m.ReqID, m.LeaseID, m.PoolID, m.BufferID, m.Size = r.u64(), r.u64(), r.u64(), r.u64(), r.u64()
	m.Offset, m.Length = r.u64(), r.u64()
	m.Flags = r.u32()
	metaLen := r.u32()
	r.bytes(m.Record[:])
	r.bytes(m.Ready[:])
	if err := checkFlags(msgLease, m.Flags, leaseKnown); err != nil {
		return err
	}
	if m.Flags&leaseReadyEvent == 0 && m.Ready != (cudart.IpcEventHandle{}) {
		return protocolErr("Lease carries event bytes without the ready-event flag")
	}
	if err := checkRange(m.Size, m.Offset, m.Length); err != nil {
		return protocolErr("Lease: %v", err)
	}
	if metaLen > MaxMetaLen || int(metaLen) > len(r.b)-r.i {
		return protocolErr("Lease has %d bytes of metadata, %d are there and at most %d allowed", metaLen, len(r.b)-r.i, MaxMetaLen)
	}
	if metaLen > 0 {
		m.Meta = bytes.Clone(r.b[r.i : r.i+int(metaLen)]) // the read buffer is reused
		r.i += int(metaLen)
	}
	return nil
}

// checkRange says why length bytes at offset are not a range of a size-byte buffer.
func checkRange(size, offset, length uint64) error {
	if length == 0 || offset > size || length > size-offset {
		return fmt.Errorf("%w: %d bytes at offset %d of a %d-byte buffer", ErrBadRange, length, offset, size)
	}
	return nil
}

func (r *reader) name(t msgType) (string, error) {
	name := string(r.rest())
	if err := checkName(name); err != nil {
		return "", protocolErr("%s: %v", t, err)
	}
	return name, nil
}

func (r *reader) text(t msgType, field string) (string, error) {
	s := r.rest()
	if !utf8.Valid(s) {
		return "", protocolErr("%s %s is not UTF-8", t, field)
	}
	return string(s), nil
}

// checkName says why name cannot be published, or nil.
func checkName(name string) error {
	if err := printable.Check(name, MaxNameLen); err != nil {
		return fmt.Errorf("%w: %w", ErrBadName, err)
	}
	return nil
}

func checkFlags(t msgType, flags, known uint32) error {
	if flags&^known != 0 {
		return protocolErr("%s has unknown flags %#x", t, flags&^known)
	}
	return nil
}

func protocolErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrProtocol, fmt.Sprintf(format, args...))
}

func versionErr(peer uint32) error {
	return fmt.Errorf("%w: peer speaks protocol version %d, this side speaks %d", ErrVersionMismatch, peer, ProtocolVersion)
}
