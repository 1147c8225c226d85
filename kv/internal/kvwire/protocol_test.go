package kvwire

import (
	"fmt"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/protospec"
	"github.com/cudapool/cudapool/kv"
)

const protocolDoc = "../../../docs/PROTOCOL.md"

func readSpec(t *testing.T) *protospec.Spec {
	t.Helper()
	return protospec.Read(t, protocolDoc, "The KV page protocol")
}

func number(t *testing.T, cell string) uint64 {
	t.Helper()
	return protospec.Number(t, protocolDoc, cell)
}

// protocolConstants are the spec's constants table, by the name it gives each.
var protocolConstants = map[string]uint64{
	"protocol version":        Version,
	"frame header bytes":      HeaderLen,
	"maximum frame bytes":     MaxFrame,
	"maximum Hello bytes":     MaxHello,
	"maximum text bytes":      MaxText,
	"maximum namespace bytes": MaxNamespace,
	"maximum batch":           kv.MaxBatch,
	"point bytes":             PointLen,
	"geometry bytes":          GeometryLen,
	"observer device":         uint64(Observer),
	"maximum listed replicas": kv.MaxListed,
}

// protocolErrors are the sentinels by the names the spec's error table gives them.
var protocolErrors = map[string]error{
	"internal": nil, "ErrNoSpace": kv.ErrNoSpace, "ErrStaleLease": kv.ErrStaleLease, "ErrGeometry": kv.ErrGeometry,
	"ErrTooLarge": kv.ErrTooLarge, "ErrClosed": kv.ErrClosed, "ErrRefused": kv.ErrRefused, "ErrLimit": kv.ErrLimit,
}

// protocolFlags are the flag constants by the spec's "message flag" names.
var protocolFlags = map[string]uint64{"Seal wait": FlagWait}

// sample is one frame of a type, each field set to a value no other field has, so that
// a field at the wrong offset shows. A new frame type needs one.
type sample struct {
	t Type
	m any
}

func fillBytes(b []byte, v byte) {
	for i := range b {
		b[i] = v + byte(i)
	}
}

func protocolSamples() []sample {
	at := Point{Notifier: 0x0c0b0a09, Target: 0x1817161514131211}
	hashes := make([]kv.Hash, 3)
	for i := range hashes {
		fillBytes(hashes[i][:], byte(0x80+16*i))
	}
	geo := kv.Geometry{Layers: 0x0201, KVHeads: 0x0202, HeadDim: 0x0203, TokensPerPage: 0x0204, Pages: 0x0205, DType: kv.DTypeFP32}
	return []sample{
		{TypeHello, Hello{Version: 0x0101, PID: 0x0102, Device: 0x0103, Namespace: "llama/prod"}},
		{TypeWelcome, Welcome{Geometry: geo, ChunkBytes: 0x0211121314151617, Chunks: 0x0221, Keeper: 0x0231, Slab: "kv/slab/0@1f"}},
		{TypeRefused, Problem{Code: 0x0301, Text: "not you"}},
		{TypeAlloc, Alloc{Pages: 0x0401}},
		{TypeLeased, Lease{ID: 0x0501, Pages: []uint32{0x0502, 0x0503}}},
		{TypeSeal, Seal{Wait: true, Lease: 0x0601, Point: at, Hashes: hashes}},
		{TypeSealed, Sealed{Visible: 0x0701, Duplicates: 0x0702, Pending: 0x0703}},
		{TypeMatch, Match{Hashes: hashes}},
		{TypeMatched, Lease{ID: 0x0901, Pages: []uint32{0x0902, 0x0903, 0x0904}}},
		{TypeRelease, Release{Point: at, Leases: []uint64{0x0a01, 0x0a02}}},
		{TypeReleased, Released{Count: 0x0b01}},
		{TypeStats, Empty{}},
		{TypeStatsReply, StatsReply{JSON: []byte(`{"pid":1}`)}},
		{TypeError, Problem{Code: 0x0e01, Text: "no room"}},
		{TypeBye, Bye{Final: true, Point: at}},
		{TypeNotifier, Notifier{ID: 0x1201}},
		{TypeGrow, Grow{Chunk: 0x1301}},
		{TypeShrink, Shrink{Chunks: 0x1401}},
	}
}

func TestProtocolConstants(t *testing.T) { readSpec(t).CheckConstants(t, protocolConstants) }

// The versions table ends with the version the code speaks: a bump says what changed.
func TestProtocolVersions(t *testing.T) { readSpec(t).CheckVersions(t, Version) }

// Every frame type the code decodes is in the messages table with its name and the
// payload lengths it may have (PayloadLimits), and the table lists no other.
func TestProtocolMessages(t *testing.T) {
	s := readSpec(t)
	inSpec := map[Type]bool{}
	for _, row := range s.Messages {
		typ := Type(number(t, row[0]))
		inSpec[typ] = true
		assert.Equal(t, typ.String(), row[1], "%s: frame type %d", protocolDoc, typ)
		lim, ok := PayloadLimits[typ]
		if !assert.True(t, ok, "%s lists frame type %d (%s), which the code does not decode", protocolDoc, typ, row[1]) {
			continue
		}
		want := fmt.Sprintf("%d–%d", lim.Min, lim.Max)
		if lim.Min == lim.Max {
			want = strconv.Itoa(lim.Min)
		}
		assert.Equal(t, want, row[3], "%s: payload bytes of %s differ from PayloadLimits", protocolDoc, typ)
	}
	for typ := range PayloadLimits {
		assert.True(t, inSpec[typ], "frame type %d (%s) is not in %s's KV messages table", typ, typ, protocolDoc)
	}
}

// Every layout table is where its sample's fields land when encoded; the sample
// decodes back to itself. A type with a payload has a table.
func TestProtocolLayouts(t *testing.T) {
	s := readSpec(t)
	for _, smp := range protocolSamples() {
		t.Run(smp.t.String(), func(t *testing.T) {
			frame, err := Append(nil, smp.t, 0x77, smp.m)
			require.NoError(t, err)
			payload := frame[HeaderLen:]
			h, back, n, err := DecodeFrame(frame)
			require.NoError(t, err, "the sample of %s does not decode", smp.t)
			assert.Equal(t, len(frame), n)
			assert.Equal(t, Header{Type: smp.t, Flags: h.Flags, ID: 0x77}, h)
			assert.Equal(t, smp.m, back, "the sample of %s decodes to another message", smp.t)
			layout, ok := s.Layouts[smp.t.String()]
			if PayloadLimits[smp.t].Max == 0 {
				assert.False(t, ok, "%s: a layout table for %s, which has no payload", protocolDoc, smp.t)
				return
			}
			require.True(t, ok, "%s has no layout table under \"### %d %s\"", protocolDoc, smp.t, smp.t)
			protospec.CheckLayout(t, protocolDoc, smp.t.String(), *layout, payload, smp.m)
		})
	}
}

// The flags table lists every flag bit each frame type accepts, and no other.
func TestProtocolFlags(t *testing.T) {
	masks := readSpec(t).FlagMasks(t, protocolFlags)
	for typ := range PayloadLimits {
		assert.Equal(t, uint64(KnownFlags(typ)), masks[typ.String()], "%s: the flags of %s differ from those the code accepts", protocolDoc, typ)
	}
}

// The error codes table lists every code, each with its sentinel.
func TestProtocolErrorCodes(t *testing.T) {
	s := readSpec(t)
	inSpec := map[uint16]bool{}
	for _, row := range s.Errors {
		code := uint16(number(t, row[0]))
		inSpec[code] = true
		want, ok := protocolErrors[row[1]]
		if !assert.True(t, ok, "%s names error %q, which protocolErrors (protocol_test.go) does not know", protocolDoc, row[1]) {
			continue
		}
		assert.Equal(t, want, codeErrs[code], "%s: error code %d", protocolDoc, code)
		if want != nil {
			assert.Equal(t, code, Code(want), "%s: the code sent for %s", protocolDoc, row[1])
		}
	}
	assert.True(t, inSpec[CodeInternal], "error code %d is not in %s's KV error codes table", CodeInternal, protocolDoc)
	for code := range codeErrs {
		assert.True(t, inSpec[code], "error code %d (%v) is not in %s's KV error codes table", code, codeErrs[code], protocolDoc)
	}
}
