package producer_test

import (
	"encoding/binary"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/protospec"
)

const protocolDoc = "../../docs/PROTOCOL.md"

// protocolConstants are the spec's constants table, by the name it gives each.
var protocolConstants = map[string]uint64{
	"protocol version":       export.ProtocolVersion,
	"frame header bytes":     wire.HeaderLen,
	"maximum frame bytes":    wire.MaxFrame,
	"maximum name bytes":     export.MaxNameLen,
	"maximum metadata bytes": export.MaxMetaLen,
	"maximum devices":        wire.MaxDevices,
	"maximum chunks":         export.MaxChunks,
	"maximum State bytes":    wire.MaxStateBytes,
	"connection id bits":     producer.ConnIDBits,
}

// protocolSamples has one message of every type, each field set to a value no other
// field has, so that a field at the wrong offset shows. A new message type needs one.
func protocolSamples() map[wire.MsgType]wire.Message {
	var (
		uuid   = func(b byte) (u cudart.UUID) { fill(u[:], b); return u }
		event  = func(b byte) (h cudart.IpcEventHandle) { fill(h[:], b); return h }
		record = func(b byte) (r cudart.PtrExportData) { fill(r[:], b); return r }
		fabric = func(b byte) (f cudart.FabricHandle) { fill(f[:], b); return f }
	)
	lease := wire.LeaseMsg{ReqID: 0x1101, LeaseID: 0x1102, PoolID: 0x1103, BufferID: 0x1104, Size: 0x110500,
		Offset: 0x1106, Length: 0x1107, Flags: wire.LeaseReadyEvent, Record: record(0x11), Ready: event(0x12),
		Meta: []byte(`{"dtype":"float16"}`)}
	push := wire.PushMsg{LeaseMsg: lease, Name: "pushed"}
	push.ReqID = 0
	return map[wire.MsgType]wire.Message{
		wire.MsgHello: &wire.HelloMsg{Version: export.ProtocolVersion, PID: 0x0101, Flags: wire.HelloLeases | wire.HelloReleaseEvent,
			HandleTypes: uint32(cudart.HandleTypePosixFD | cudart.HandleTypeFabric), Device: uuid(0x01), ReleaseEvent: event(0x02)},
		wire.MsgWelcome:      &wire.WelcomeMsg{Version: export.ProtocolVersion, PID: 0x0201, Flags: wire.WelcomeRetain, Devices: []cudart.UUID{uuid(0x21), uuid(0x22)}},
		wire.MsgRefused:      &wire.RefusedMsg{Version: export.ProtocolVersion, Reason: "not you"},
		wire.MsgPoolHandle:   &wire.PoolHandleMsg{PoolID: 0x0401, HandleType: cudart.HandleTypeFabric, Device: uuid(0x41), MaxSize: 0x0402, Fabric: fabric(0x42)},
		wire.MsgOpen:         &wire.OpenMsg{ReqID: 0x0501, Name: "layer-0"},
		wire.MsgLease:        &lease,
		wire.MsgRelease:      &wire.ReleaseMsg{ReqID: 0x0701, LeaseID: 0x0702, Count: 0x0703, Flags: wire.ReleaseNothingImported},
		wire.MsgReleased:     &wire.ReleasedMsg{ReqID: 0x0801, LeaseID: 0x0802},
		wire.MsgError:        &wire.ErrorMsg{ReqID: 0x0901, Code: wire.CodeBufferGone, Text: "freed"},
		wire.MsgPush:         &push,
		wire.MsgStateRequest: &wire.StateRequestMsg{ReqID: 0x0b01},
		wire.MsgState:        &wire.StateMsg{ReqID: 0x0c01, Flags: wire.StateMore, JSON: []byte(`{"schema":1}`)},
		wire.MsgBye:          &wire.ByeMsg{},
		wire.MsgOpenBatch:    &wire.OpenBatchMsg{ReqID: 0x1001, Names: []string{"block-0", "block-1"}},
		wire.MsgLeaseBatch:   &wire.LeaseBatchMsg{ReqID: 0x1101, Flags: wire.LeaseBatchMore, Leases: []wire.LeaseMsg{lease, lease}},
		wire.MsgReleaseBatch: &wire.ReleaseBatchMsg{ReqID: 0x1201, Entries: []wire.ReleaseMsg{{LeaseID: 0x1202, Count: 0x1203, Flags: wire.ReleaseRetain}, {LeaseID: 0x1204, Count: 1}}},
		wire.MsgRevoke:       &wire.RevokeMsg{Record: record(0x0e)},
		wire.MsgRevoked:      &wire.RevokedMsg{Record: record(0x0f)},
		wire.MsgChunkHandle: &wire.ChunkHandleMsg{AllocID: 0x1302, Size: 0x130300, Index: 0x0304, Count: 0x0305,
			HandleType: cudart.HandleTypeFabric, Device: uuid(0x13), Fabric: fabric(0x14)},
		wire.MsgDropChunks: &wire.DropChunksMsg{AllocID: 0x1401},
	}
}

func fill(b []byte, v byte) {
	for i := range b {
		b[i] = v + byte(i)
	}
}

// protocolFlags are the flag constants by the spec's "message flag" names, and
// protocolKnownFlags each message's mask of the flags it accepts.
var (
	protocolFlags = map[string]uint32{
		"Hello leases": wire.HelloLeases, "Hello release event": wire.HelloReleaseEvent,
		"Lease ready event":        wire.LeaseReadyEvent,
		"Lease vmm":                wire.LeaseVMM,
		"Release nothing imported": wire.ReleaseNothingImported,
		"Release retain":           wire.ReleaseRetain,
		"LeaseBatch more":          wire.LeaseBatchMore,
		"Welcome retain":           wire.WelcomeRetain,
		"State more":               wire.StateMore,
	}
	protocolKnownFlags = map[string]uint32{"Hello": wire.HelloKnown, "Welcome": wire.WelcomeKnown, "Lease": wire.LeaseKnown, "Release": wire.ReleaseKnown, "State": wire.StateKnown, "LeaseBatch": wire.LeaseBatchKnown}
)

// protocolErrors are the sentinels by the names the spec's error table gives them.
var protocolErrors = map[string]error{
	"ErrExporter": export.ErrExporter, "ErrUnknownName": export.ErrUnknownName, "ErrStaleLease": export.ErrStaleLease,
	"ErrBufferGone":   export.ErrBufferGone,
	"ErrExporterGone": export.ErrExporterGone, "ErrHandleType": export.ErrHandleType, "ErrIMEXRequired": export.ErrIMEXRequired,
	"ErrBadRequest": export.ErrBadRequest, "ErrNoLeases": export.ErrNoLeases, "ErrTooManyGrants": export.ErrTooManyGrants,
}

// derivedFields are spec fields with no Go field of their own: what they hold, from the
// message.
var derivedFields = map[string]func(m wire.Message) uint64{
	"Welcome device_count": func(m wire.Message) uint64 { return uint64(len(m.(*wire.WelcomeMsg).Devices)) },
	"Lease meta_len":       func(m wire.Message) uint64 { return uint64(len(m.(*wire.LeaseMsg).Meta)) },
	"Push meta_len":        func(m wire.Message) uint64 { return uint64(len(m.(*wire.PushMsg).Meta)) },
	"LeaseBatch count":     func(m wire.Message) uint64 { return uint64(len(m.(*wire.LeaseBatchMsg).Leases)) },
	"ReleaseBatch count":   func(m wire.Message) uint64 { return uint64(len(m.(*wire.ReleaseBatchMsg).Entries)) },
}

// listFields are spec fields that repeat a layout the spec gives in words: their
// encoding, element by element.
var listFields = map[string]func(m wire.Message) []byte{
	"OpenBatch names": func(m wire.Message) (b []byte) {
		for _, n := range m.(*wire.OpenBatchMsg).Names {
			b = append(append(b, byte(len(n))), n...)
		}
		return b
	},
	"LeaseBatch leases": func(m wire.Message) (b []byte) {
		for _, l := range m.(*wire.LeaseBatchMsg).Leases {
			b = l.AppendPayload(b)
		}
		return b
	},
	"ReleaseBatch entries": func(m wire.Message) (b []byte) {
		for _, e := range m.(*wire.ReleaseBatchMsg).Entries {
			b = binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint64(b, e.LeaseID), e.Count), e.Flags)
		}
		return b
	},
}

// readSpec reads the export protocol's tables of docs/PROTOCOL.md.
func readSpec(t *testing.T) *protospec.Spec {
	t.Helper()
	return protospec.Read(t, protocolDoc, "The cudapool wire protocol")
}

// number reads a decimal or 0x-hexadecimal cell.
func number(t *testing.T, cell string) uint64 {
	t.Helper()
	return protospec.Number(t, protocolDoc, cell)
}

func TestProtocolConstants(t *testing.T) { readSpec(t).CheckConstants(t, protocolConstants) }

// The versions table ends with the version the code speaks: a bump says what changed.
func TestProtocolVersions(t *testing.T) { readSpec(t).CheckVersions(t, export.ProtocolVersion) }

// Every message type the code decodes is in the messages table, with its name and the
// payload lengths it accepts, and the table lists no other.
func TestProtocolMessages(t *testing.T) {
	s := readSpec(t)
	inSpec := map[wire.MsgType]bool{}
	for _, row := range s.Messages {
		typ := wire.MsgType(number(t, row[0]))
		inSpec[typ] = true
		assert.Equal(t, typ.String(), row[1], "%s: message type %d", protocolDoc, typ)
		if !assert.True(t, known(typ), "%s lists message type %d (%s), which the code does not decode", protocolDoc, typ, row[1]) {
			continue
		}
		lim := wire.PayloadLimits[typ]
		want := fmt.Sprintf("%d–%d", lim.Min, lim.Max)
		if lim.Min == lim.Max {
			want = strconv.Itoa(lim.Min)
		}
		assert.Equal(t, want, row[3], "%s: payload bytes of %s differ from the code's limits", protocolDoc, typ)
	}
	for typ := range wire.MsgType(255) {
		if known(typ) {
			assert.True(t, inSpec[typ], "message type %d (%s) is not in %s's messages table", typ, typ, protocolDoc)
		}
	}
}

// known reports whether the code decodes message type t.
func known(t wire.MsgType) bool {
	return int(t) < len(wire.PayloadLimits) && (wire.PayloadLimits[t].Max > 0 || t == wire.MsgBye)
}

// Every message's layout table is where its sample's fields land when encoded: each
// field at its offset with its size, the offsets contiguous, only the last field of
// variable length; the sample decodes back to itself.
func TestProtocolLayouts(t *testing.T) {
	s := readSpec(t)
	samples := protocolSamples()
	for _, row := range s.Messages {
		typ := wire.MsgType(number(t, row[0]))
		t.Run(typ.String(), func(t *testing.T) {
			sample, ok := samples[typ]
			require.True(t, ok, "no sample of %s in protocolSamples (protocol_test.go)", typ)
			require.Contains(t, s.Layouts, typ.String(), "%s has no layout table under \"### %d %s\"", protocolDoc, typ, typ)
			layout := *s.Layouts[typ.String()]
			payload := sample.AppendPayload(nil)
			off := 0
			lengths := map[string]int{} // the length fields read so far, by name
			fixed, sized := 0, ""       // the offset as the spec writes it: "192 + meta_len"
			for i, f := range layout {
				require.Equal(t, strconv.Itoa(fixed)+sized, f[0], "%s: %s field %s: offset, after the fields before it", protocolDoc, typ, f[2])
				if f[1] == "rest" {
					want := fieldBytes(t, sample, typ.String(), f[2], -1)
					require.Equal(t, len(layout)-1, i, "%s: %s field %s takes the rest, so it must be last", protocolDoc, typ, f[2])
					require.Equal(t, want, payload[off:], "%s: %s field %s, the rest of the payload", protocolDoc, typ, f[2])
					off = len(payload)
					break
				}
				// A size is a number of bytes, or the name of a length field before it.
				size, isLength := lengths[f[1]]
				if isLength {
					sized += " + " + f[1]
				} else {
					size = int(number(t, f[1]))
					fixed += size
				}
				want := fieldBytes(t, sample, typ.String(), f[2], size)
				if _, ok := derivedFields[typ.String()+" "+f[2]]; ok {
					lengths[f[2]] = int(derivedFields[typ.String()+" "+f[2]](sample))
				}
				require.Len(t, want, size, "%s: %s field %s: size, against the Go field", protocolDoc, typ, f[2])
				require.LessOrEqual(t, off+size, len(payload), "%s: %s field %s runs past the encoded payload", protocolDoc, typ, f[2])
				require.Equal(t, want, payload[off:off+size], "%s: %s field %s at offset %d", protocolDoc, typ, f[2], off)
				off += size
			}
			require.Equal(t, len(payload), off, "%s: %s's fields cover %d of the %d bytes the code encodes", protocolDoc, typ, off, len(payload))

			back, err := wire.DecodePayload(typ, payload)
			require.NoError(t, err, "the sample of %s does not decode: fix protocolSamples", typ)
			require.Equal(t, sample, back, "the sample of %s decodes to another message", typ)
		})
	}
}

// fieldBytes is the encoding of the field the spec calls name in message m: the Go
// field of the same name without underscores (ReqID for req_id), or a derived field. A
// list of fixed-size values (Welcome's devices) fills its slots, the unused ones zero:
// size is the spec's size, or -1 for the rest of the payload.
func fieldBytes(t *testing.T, m wire.Message, msg, name string, size int) []byte {
	t.Helper()
	if enc, ok := listFields[msg+" "+name]; ok {
		return enc(m)
	}
	if derive, ok := derivedFields[msg+" "+name]; ok {
		return binary.LittleEndian.AppendUint32(nil, uint32(derive(m)))
	}
	want := strings.ReplaceAll(name, "_", "")
	v := reflect.ValueOf(m).Elem().FieldByNameFunc(func(n string) bool { return strings.EqualFold(n, want) })
	require.True(t, v.IsValid(), "%s: %s has field %s, which %T has not (nor derivedFields)", protocolDoc, msg, name, m)
	switch v.Kind() {
	case reflect.Uint32, reflect.Uint64, reflect.Int32, reflect.Int64, reflect.Int:
		// As many bytes as the Go type has: a uint32, or a named type over one.
		var n uint64
		if v.CanUint() {
			n = v.Uint()
		} else {
			n = uint64(v.Int())
		}
		return binary.LittleEndian.AppendUint64(nil, n)[:v.Type().Size()]
	case reflect.String:
		return []byte(v.String())
	case reflect.Array, reflect.Slice:
		var b []byte
		for i := range v.Len() {
			e := v.Index(i)
			switch e.Kind() {
			case reflect.Uint8:
				b = append(b, byte(e.Uint()))
			case reflect.Array:
				for j := range e.Len() {
					b = append(b, byte(e.Index(j).Uint()))
				}
			default:
				t.Fatalf("%s field %s: %v, a list of what the test cannot encode", msg, name, v.Type())
			}
		}
		if v.Kind() == reflect.Slice && v.Type().Elem().Kind() == reflect.Array && size > len(b) {
			b = append(b, make([]byte, size-len(b))...) // the unused slots
		}
		return b
	}
	t.Fatalf("%s field %s: %v, a type the test cannot encode", msg, name, v.Type())
	return nil
}

// The flags table lists every flag bit each message accepts, and no other.
func TestProtocolFlags(t *testing.T) {
	flags := map[string]uint64{}
	for name, bit := range protocolFlags {
		flags[name] = uint64(bit)
	}
	masks := readSpec(t).FlagMasks(t, flags)
	for msg, known := range protocolKnownFlags {
		assert.Equal(t, uint64(known), masks[msg], "%s: the flags of %s differ from those the code accepts (%#x)", protocolDoc, msg, known)
	}
	for name := range protocolFlags {
		msg, _, _ := strings.Cut(name, " ")
		assert.Contains(t, protocolKnownFlags, msg, "flag %q of a message protocolKnownFlags does not list", name)
	}
}

// The error codes table lists every code the code sends, each with its sentinel.
func TestProtocolErrorCodes(t *testing.T) {
	s := readSpec(t)
	inSpec := map[wire.ErrCode]bool{}
	for _, row := range s.Errors {
		code := wire.ErrCode(number(t, row[0]))
		inSpec[code] = true
		want, ok := protocolErrors[row[1]]
		if !assert.True(t, ok, "%s names error %q, which protocolErrors (protocol_test.go) does not know", protocolDoc, row[1]) {
			continue
		}
		if assert.True(t, code > 0 && code < wire.CodeLimit, "%s lists error code %d, which the code does not send", protocolDoc, code) {
			assert.Equal(t, want, wire.CodeErrs[code], "%s: error code %d", protocolDoc, code)
		}
	}
	for code := wire.ErrCode(1); code < wire.CodeLimit; code++ {
		assert.True(t, inSpec[code], "error code %d (%v) is not in %s's error codes table", code, wire.CodeErrs[code], protocolDoc)
	}
}
