package keep

import (
	"fmt"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/protospec"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

const protocolDoc = "../../../docs/PROTOCOL.md"

// spec is one of the two protocols of the package, as the document and the code have
// it.
type spec struct {
	title     string
	version   int
	constants map[string]uint64
	limits    map[Type]Limit
	errors    map[string]error
	flags     map[string]uint64
}

var specs = []spec{
	{
		title:   "The keeper protocol",
		version: Version,
		constants: map[string]uint64{
			"protocol version": Version, "frame header bytes": kvwire.HeaderLen, "maximum frame bytes": kvwire.MaxFrame,
			"maximum request bytes": MaxRequest, "maximum name bytes": MaxName, "maximum names kept": MaxKept, "maximum text bytes": kvwire.MaxText,
		},
		limits: PayloadLimits,
		errors: map[string]error{"ErrInternal": ErrInternal, "ErrNotKept": ErrNotKept, "ErrRefused": ErrRefused, "ErrLimit": ErrLimit, "ErrName": ErrName},
		flags:  map[string]uint64{"Listed more": FlagMore},
	},
	{
		title:     "The host tier socket",
		version:   HostVersion,
		constants: map[string]uint64{"protocol version": HostVersion, "frame header bytes": kvwire.HeaderLen, "maximum text bytes": kvwire.MaxText},
		limits:    HostPayloadLimits,
		errors:    map[string]error{"ErrRefused": ErrRefused, "ErrNoTier": ErrNoTier},
		flags:     map[string]uint64{},
	},
}

// sample is one frame of a type, each field set to a value no other field has, so that
// a field at the wrong offset shows. A new frame type needs one.
type sample struct {
	t Type
	m any
}

func protocolSamples() []sample {
	return []sample{
		{TypeHello, Hello{Version: 0x2001, PID: 0x2002, Role: 0x2003}},
		{TypeWelcome, Welcome{Version: 0x2101, PID: 0x2102}},
		{TypeRefused, Problem{Code: 0x2201, Text: "not you"}},
		{TypePut, Put{Name: "kv/host/0", Size: 0x2302_0000_2303}},
		{TypeTake, Name{Name: "kv/chunk/1/2"}},
		{TypeDrop, Name{Name: "kv/chunk/1/3"}},
		{TypeList, Name{Name: "kv/"}},
		{TypeDone, Empty{}},
		{TypeTaken, Taken{Size: 0x2801_0000_2802}},
		{TypeListed, Listed{More: true, Entries: []Entry{{Name: "a", Size: 0x2901}, {Name: "bc", Size: 0x2902}}}},
		{TypeError, Problem{Code: 0x2a01, Text: "no such name"}},
		{TypeHostHello, HostHello{Version: 0x3001, PID: 0x3002, Device: 0x3003}},
		{TypeHostTier, HostTier{Device: 0x3101, Pages: 0x3102, PageBytes: 0x3103_0000_3104, Bytes: 0x3105_0000_3106}},
		{TypeHostRefused, Problem{Code: 0x3201, Text: "no tier"}},
	}
}

func TestProtocolConstants(t *testing.T) {
	for _, sp := range specs {
		t.Run(sp.title, func(t *testing.T) { protospec.Read(t, protocolDoc, sp.title).CheckConstants(t, sp.constants) })
	}
}

// The versions table ends with the version the code speaks: a bump says what changed.
func TestProtocolVersions(t *testing.T) {
	for _, sp := range specs {
		t.Run(sp.title, func(t *testing.T) { protospec.Read(t, protocolDoc, sp.title).CheckVersions(t, sp.version) })
	}
}

// Every frame type the code decodes is in its protocol's messages table with its name
// and payload lengths, and the table lists no other.
func TestProtocolMessages(t *testing.T) {
	for _, sp := range specs {
		t.Run(sp.title, func(t *testing.T) {
			s := protospec.Read(t, protocolDoc, sp.title)
			inSpec := map[Type]bool{}
			for _, row := range s.Messages {
				typ := Type(protospec.Number(t, protocolDoc, row[0]))
				inSpec[typ] = true
				assert.Equal(t, typ.String(), row[1], "%s: frame type %d", protocolDoc, typ)
				lim, ok := sp.limits[typ]
				if !assert.True(t, ok, "%s lists frame type %d (%s), which the code does not decode", protocolDoc, typ, row[1]) {
					continue
				}
				want := fmt.Sprintf("%d–%d", lim.Min, lim.Max)
				if lim.Min == lim.Max {
					want = strconv.Itoa(lim.Min)
				}
				assert.Equal(t, want, row[3], "%s: payload bytes of %s", protocolDoc, typ)
			}
			for typ := range sp.limits {
				assert.True(t, inSpec[typ], "frame type %d (%s) is not in %s's messages table of %q", typ, typ, protocolDoc, sp.title)
			}
		})
	}
}

// Every layout table is where its sample's fields land when encoded; the sample decodes
// back to itself. A type with a payload has a table.
func TestProtocolLayouts(t *testing.T) {
	for _, sp := range specs {
		s := protospec.Read(t, protocolDoc, sp.title)
		for _, smp := range protocolSamples() {
			if _, ok := sp.limits[smp.t]; !ok {
				continue
			}
			t.Run(smp.t.String(), func(t *testing.T) {
				frame, err := Append(nil, smp.t, 0x77, smp.m)
				require.NoError(t, err)
				h, back, n, err := DecodeFrame(frame)
				require.NoError(t, err, "the sample of %s does not decode", smp.t)
				assert.Equal(t, len(frame), n)
				assert.Equal(t, Header{Type: smp.t, Flags: h.Flags, ID: 0x77}, h)
				assert.Equal(t, smp.m, back, "the sample of %s decodes to another message", smp.t)
				layout, ok := s.Layouts[smp.t.String()]
				if sp.limits[smp.t].Max == 0 {
					assert.False(t, ok, "%s: a layout table for %s, which has no payload", protocolDoc, smp.t)
					return
				}
				require.True(t, ok, "%s has no layout table under \"### %d %s\"", protocolDoc, smp.t, smp.t)
				protospec.CheckLayout(t, protocolDoc, smp.t.String(), *layout, frame[kvwire.HeaderLen:], smp.m)
			})
		}
	}
}

// Every frame type has a sample.
func TestProtocolSamplesCoverEveryType(t *testing.T) {
	seen := map[Type]bool{}
	for _, smp := range protocolSamples() {
		seen[smp.t] = true
	}
	for _, sp := range specs {
		for typ := range sp.limits {
			assert.True(t, seen[typ], "no sample of %s", typ)
		}
	}
}

// The flags table lists every flag bit each frame type accepts, and no other.
func TestProtocolFlags(t *testing.T) {
	for _, sp := range specs {
		t.Run(sp.title, func(t *testing.T) {
			masks := protospec.Read(t, protocolDoc, sp.title).FlagMasks(t, sp.flags)
			for typ := range sp.limits {
				assert.Equal(t, uint64(KnownFlags(typ)), masks[typ.String()], "%s: the flags of %s", protocolDoc, typ)
			}
		})
	}
}

// The error codes table lists each code the protocol sends, with its sentinel, and
// the code the keeper sends for that sentinel.
func TestProtocolErrorCodes(t *testing.T) {
	for _, sp := range specs {
		t.Run(sp.title, func(t *testing.T) {
			s := protospec.Read(t, protocolDoc, sp.title)
			require.NotEmpty(t, s.Errors)
			inSpec := map[string]bool{}
			for _, row := range s.Errors {
				code := uint16(protospec.Number(t, protocolDoc, row[0]))
				inSpec[row[1]] = true
				want, ok := sp.errors[row[1]]
				if !assert.True(t, ok, "%s names error %q, which the test's %q errors do not know", protocolDoc, row[1], sp.title) {
					continue
				}
				assert.Equal(t, want, codes[code], "%s: error code %d", protocolDoc, code)
				assert.Equal(t, code, codeOf(want), "%s: the code sent for %s", protocolDoc, row[1])
			}
			for name := range sp.errors {
				assert.True(t, inSpec[name], "%s is not in %s's error codes of %q", name, protocolDoc, sp.title)
			}
		})
	}
}
