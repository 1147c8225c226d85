package kvwire

import (
	"encoding/binary"
	"fmt"

	"github.com/cudapool/cudapool/kv"
)

// The payload of each frame type, decoded. The slices of a decoded message alias the
// payload it came from.
type (
	// Alloc asks for Pages pages for writing.
	Alloc struct{ Pages uint32 }
	// Lease is a Leased or Matched frame: a lease and its pages (none, and lease 0, for
	// a Match that found nothing).
	Lease struct {
		ID    uint64
		Pages []uint32
	}
	// Seal ends write lease Lease: its first len(Hashes) pages are published under
	// Hashes once Point is reached.
	Seal struct {
		Wait  bool
		Lease uint64
		Point
		Hashes []kv.Hash
	}
	// Match asks for the longest visible run of Hashes.
	Match struct{ Hashes []kv.Hash }
	// Release ends Leases once Point is reached.
	Release struct {
		Point
		Leases []uint64
	}
	// Released says how many leases a Release ended.
	Released struct{ Count uint32 }
	// Problem is an Error or Refused frame: a code and a message.
	Problem struct {
		Code uint16
		Text string
	}
	// StatsReply is the owner's Stats as JSON.
	StatsReply struct{ JSON []byte }
	// Empty is the payload of Stats.
	Empty struct{}
	// Bye ends a connection; with Final, the leases still held end once Point is
	// reached (a replica's Close), else at once.
	Bye struct {
		Final bool
		Point
	}
	// Notifier registers notifier ID (not 0) of the connection: the eventfd sent
	// with the frame's bytes (SCM_RIGHTS), which counts the completions of one stream
	// of the replica's. It has no reply.
	Notifier struct{ ID uint32 }
)

// Limit is the smallest and largest payload a frame type has.
type Limit struct{ Min, Max int }

// PayloadLimits are the payload lengths each frame type may have, by type; a type
// with no entry is unknown.
var PayloadLimits = map[Type]Limit{
	TypeHello:      {14, 14 + MaxText},
	TypeWelcome:    {GeometryLen + 18, GeometryLen + 18 + MaxText},
	TypeRefused:    {4, 4 + MaxText},
	TypeAlloc:      {4, 4},
	TypeLeased:     {12, 12 + 4*kv.MaxBatch},
	TypeSeal:       {8 + PointLen + 4, 8 + PointLen + 4 + 16*kv.MaxBatch},
	TypeSealed:     {12, 12},
	TypeMatch:      {4, 4 + 16*kv.MaxBatch},
	TypeMatched:    {12, 12 + 4*kv.MaxBatch},
	TypeRelease:    {PointLen + 4, PointLen + 4 + 8*kv.MaxBatch},
	TypeReleased:   {4, 4},
	TypeStats:      {0, 0},
	TypeStatsReply: {0, MaxFrame - HeaderLen},
	TypeError:      {4, 4 + MaxText},
	TypeBye:        {0, PointLen},
	TypeNotifier:   {4, 4},
	TypeGrow:       {4, 4},
	TypeShrink:     {4, 4},
}

// KnownFlags are the flag bits a frame of type t may carry.
func KnownFlags(t Type) uint8 {
	if t == TypeSeal {
		return FlagWait
	}
	return 0
}

// Decode decodes the payload p of a frame with header h into the message of its type
// (Hello, Welcome, Problem, Alloc, Lease, Seal, Sealed, Match, Release, Released,
// StatsReply, Empty, Bye, Notifier, Grow or Shrink), as the Decode function of that type does. A payload that
// breaks the layout, or flags its type does not define, fail with an error wrapping
// ErrMalformed; a batch over kv.MaxBatch with one wrapping kv.ErrTooLarge. What decodes
// encodes back (Append) to the same bytes.
func Decode(h Header, p []byte) (any, error) {
	if err := CheckFlags(h); err != nil {
		return nil, err
	}
	switch h.Type {
	case TypeHello:
		return DecodeHello(p)
	case TypeWelcome:
		return DecodeWelcome(p)
	case TypeRefused, TypeError:
		return DecodeProblem(h.Type, p)
	case TypeAlloc:
		return DecodeAlloc(p)
	case TypeLeased, TypeMatched:
		return DecodeLease(h.Type, p, nil)
	case TypeSeal:
		return DecodeSeal(h, p)
	case TypeSealed:
		return DecodeSealed(p)
	case TypeMatch:
		return DecodeMatch(p)
	case TypeRelease:
		return DecodeRelease(p, nil)
	case TypeReleased:
		return DecodeReleased(p)
	case TypeStatsReply:
		return StatsReply{JSON: p}, nil
	case TypeStats:
		return Empty{}, NewParser(h.Type, p).Done()
	case TypeBye:
		return DecodeBye(p)
	case TypeNotifier:
		return DecodeNotifier(p)
	case TypeGrow:
		return DecodeGrow(p)
	case TypeShrink:
		return DecodeShrink(p)
	}
	return nil, fmt.Errorf("%w: unknown frame type %s", ErrMalformed, h.Type)
}

// CheckFlags says whether h carries flags its type does not define.
func CheckFlags(h Header) error {
	if unknown := h.Flags &^ KnownFlags(h.Type); unknown != 0 {
		return fmt.Errorf("%w: %s with unknown flags %#x", ErrMalformed, h.Type, unknown)
	}
	return nil
}

// DecodeHello decodes a Hello's payload.
func DecodeHello(p []byte) (Hello, error) {
	r := NewParser(TypeHello, p)
	m := Hello{Version: r.U32(), PID: r.U32(), Device: r.U32(), Namespace: r.Text()}
	return m, r.Done()
}

// DecodeWelcome decodes a Welcome's payload (the geometry not validated).
func DecodeWelcome(p []byte) (Welcome, error) {
	r := NewParser(TypeWelcome, p)
	m := Welcome{Geometry: r.Geometry(), ChunkBytes: r.U64(), Chunks: r.U32(), Keeper: r.U32(), Slab: r.Text()}
	return m, r.Done()
}

// DecodeShrink decodes a Shrink's payload.
func DecodeShrink(p []byte) (Shrink, error) {
	r := NewParser(TypeShrink, p)
	m := Shrink{Chunks: r.U32()}
	return m, r.Done()
}

// DecodeGrow decodes a Grow's payload.
func DecodeGrow(p []byte) (Grow, error) {
	r := NewParser(TypeGrow, p)
	m := Grow{Chunk: r.U32()}
	return m, r.Done()
}

// DecodeProblem decodes the payload of an Error or Refused frame (t).
func DecodeProblem(t Type, p []byte) (Problem, error) {
	r := NewParser(t, p)
	m := Problem{Code: r.U16(), Text: r.Text()}
	return m, r.Done()
}

// DecodeAlloc decodes an Alloc's payload.
func DecodeAlloc(p []byte) (Alloc, error) {
	r := NewParser(TypeAlloc, p)
	m := Alloc{Pages: r.U32()}
	return m, r.Done()
}

// DecodeLease decodes the payload of a Leased or Matched frame (t), its pages
// appended to dst.
func DecodeLease(t Type, p []byte, dst []uint32) (Lease, error) {
	r := NewParser(t, p)
	m := Lease{ID: r.U64(), Pages: r.U32s(dst)}
	return m, r.Done()
}

// DecodeSeal decodes the payload of a Seal with header h; its hashes alias p.
func DecodeSeal(h Header, p []byte) (Seal, error) {
	r := NewParser(TypeSeal, p)
	m := Seal{Wait: h.Flags&FlagWait != 0, Lease: r.U64(), Point: r.Point(), Hashes: r.Hashes()}
	return m, r.Done()
}

// DecodeSealed decodes a Sealed's payload.
func DecodeSealed(p []byte) (Sealed, error) {
	r := NewParser(TypeSealed, p)
	m := Sealed{Visible: r.U32(), Duplicates: r.U32(), Pending: r.U32()}
	return m, r.Done()
}

// DecodeMatch decodes a Match's payload; its hashes alias p.
func DecodeMatch(p []byte) (Match, error) {
	r := NewParser(TypeMatch, p)
	m := Match{Hashes: r.Hashes()}
	return m, r.Done()
}

// DecodeRelease decodes a Release's payload, its leases appended to dst.
func DecodeRelease(p []byte, dst []uint64) (Release, error) {
	r := NewParser(TypeRelease, p)
	m := Release{Point: r.Point(), Leases: r.U64s(dst)}
	return m, r.Done()
}

// DecodeBye decodes a Bye's payload: empty, or a final point.
func DecodeBye(p []byte) (Bye, error) {
	if len(p) == 0 {
		return Bye{}, nil
	}
	r := NewParser(TypeBye, p)
	m := Bye{Final: true, Point: r.Point()}
	return m, r.Done()
}

// DecodeNotifier decodes a Notifier's payload; id 0 is malformed.
func DecodeNotifier(p []byte) (Notifier, error) {
	r := NewParser(TypeNotifier, p)
	m := Notifier{ID: r.U32()}
	if err := r.Done(); err != nil {
		return m, err
	}
	if m.ID == 0 {
		return m, fmt.Errorf("%w: Notifier of id 0", ErrMalformed)
	}
	return m, nil
}

// AppendNotifier appends a Notifier frame; the caller sends it with the eventfd.
func AppendNotifier(b []byte, m Notifier) ([]byte, error) {
	return frame(b, TypeNotifier, 0, 0, func(b []byte) []byte { return appendU32(b, m.ID) })
}

// DecodeReleased decodes a Released's payload.
func DecodeReleased(p []byte) (Released, error) {
	r := NewParser(TypeReleased, p)
	m := Released{Count: r.U32()}
	return m, r.Done()
}

// Append appends the frame of type t and id carrying m, a message of t's kind (see
// Decode).
func Append(b []byte, t Type, id uint32, m any) ([]byte, error) {
	switch m := m.(type) {
	case Hello:
		return AppendHello(b, id, m)
	case Welcome:
		return AppendWelcome(b, id, m)
	case Problem:
		return AppendError(b, t, id, m.Code, m.Text)
	case Alloc:
		return AppendU32(b, TypeAlloc, id, m.Pages)
	case Lease:
		return AppendLease(b, t, id, m.ID, m.Pages)
	case Seal:
		return AppendSeal(b, id, m.Wait, m.Lease, m.Point, m.Hashes)
	case Sealed:
		return AppendSealed(b, id, m)
	case Match:
		return AppendMatch(b, id, m.Hashes)
	case Release:
		return AppendRelease(b, id, m.Point, m.Leases)
	case Released:
		return AppendU32(b, TypeReleased, id, m.Count)
	case StatsReply:
		start := len(b)
		return End(append(Begin(b, TypeStatsReply, 0, id), m.JSON...), start)
	case Empty:
		return AppendEmpty(b, t, id)
	case Bye:
		if !m.Final {
			return AppendEmpty(b, TypeBye, id)
		}
		return frame(b, TypeBye, 0, id, m.Point.append)
	case Notifier:
		return frame(b, TypeNotifier, 0, id, func(b []byte) []byte { return appendU32(b, m.ID) })
	case Grow:
		return frame(b, TypeGrow, 0, id, func(b []byte) []byte { return appendU32(b, m.Chunk) })
	case Shrink:
		return frame(b, TypeShrink, 0, id, func(b []byte) []byte { return appendU32(b, m.Chunks) })
	}
	return b, fmt.Errorf("kvwire: no frame carries a %T", m)
}

// DecodeFrame decodes the first frame of b: its header, its message and the bytes it
// took. It fails as Reader.Next and Decode do.
func DecodeFrame(b []byte) (Header, any, int, error) {
	if len(b) < HeaderLen {
		return Header{}, nil, 0, fmt.Errorf("%w: %d bytes, shorter than a header", ErrMalformed, len(b))
	}
	n := int(binary.LittleEndian.Uint32(b)) + 4
	switch {
	case n > MaxFrame:
		return Header{}, nil, 0, fmt.Errorf("%w: a frame of %d bytes is over the limit of %d", ErrMalformed, n, MaxFrame)
	case n < HeaderLen:
		return Header{}, nil, 0, fmt.Errorf("%w: a frame of %d bytes is shorter than its header", ErrMalformed, n)
	case n > len(b):
		return Header{}, nil, 0, fmt.Errorf("%w: a frame of %d bytes in %d", ErrMalformed, n, len(b))
	case b[6] != 0 || b[7] != 0:
		return Header{}, nil, 0, fmt.Errorf("%w: reserved bytes are not zero", ErrMalformed)
	}
	h := Header{Type: Type(b[4]), Flags: b[5], ID: binary.LittleEndian.Uint32(b[8:])}
	m, err := Decode(h, b[HeaderLen:n])
	return h, m, n, err
}
