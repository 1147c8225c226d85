// Package keep owns the two sockets of an owner's directory that hand over file
// descriptors: the keeper protocol (dir/keep.sock) with its frames, the keeper's side
// ([Server]: named file descriptors held until dropped or the keeper stops) and the
// page server's ([Client]); and the host tier socket (dir/host.sock, host.go), where a
// replica gets its device's host tier's memfd ([AskHostTier], [ServeHostTier]). A keeper holds descriptors and nothing else (the host
// tiers' memfds, a VMM slab's chunks), so it needs no CUDA context: the memory an fd
// names lives while any process holds the fd or maps it.
//
// The frames are the KV page protocol's (kvwire: u32 length, u8 type, u8 flags, u16
// reserved, u32 request id, then the payload; descriptors ride with a frame's bytes,
// SCM_RIGHTS), with the keeper's own types, numbered from 32 so that a frame of the
// page protocol sent here, or one of these sent there, is refused by its type rather
// than misread (the host tier socket's from 48). docs/PROTOCOL.md ("The keeper
// protocol", "The host tier socket") is the specification.
package keep

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// Version is the keeper protocol's version; Hello and Welcome carry it. Version 1's
// Hello had no role.
const Version = 2

// Role is what a connection is to the keeper, as its Hello says: a page server, which
// puts and takes descriptors, or a holder, a process that maps memory the keeper's
// descriptors name and asks nothing. The keeper stops by itself only once, for its idle
// time, nobody at all has been connected; a holder learns of the keeper's death by
// its connection's end.
type Role uint32

// The roles.
const (
	RoleServer Role = 1 // a page server: Put, Take, Drop, List
	RoleHolder Role = 2 // a replica that maps the slab: no request at all
)

var roleNames = map[Role]string{RoleServer: "page server", RoleHolder: "holder"}

func (r Role) String() string {
	if n, ok := roleNames[r]; ok {
		return n
	}
	return fmt.Sprintf("role(%d)", uint32(r))
}

// Socket is the keeper's socket in an owner's directory.
const Socket = "keep.sock"

const (
	// MaxName bounds a name, in bytes.
	MaxName = 255
	// MaxKept bounds the names one keeper holds: a slab's chunks on every device and
	// each device's host tier. A slab has at most 16 chunks a layer by default (8 a tensor,
	// kv.SlabLayout), so 12,288 holds 8 devices of models of up to 95 layers.
	MaxKept = 12288
	// MaxRequest bounds a frame the keeper reads: its largest request, a Put of a name
	// of [MaxName] bytes, fits.
	MaxRequest = kvwire.HeaderLen + 2 + MaxName + 8
)

// Type is a frame's type byte.
type Type uint8

// The frame types.
const (
	TypeHello   Type = 32 // client: version, pid, role
	TypeWelcome Type = 33 // keeper: admitted; its version and pid
	TypeRefused Type = 34 // keeper: not admitted: a code and why; then close
	TypePut     Type = 35 // client: keep this descriptor (riding with the frame) under a name, of a size
	TypeTake    Type = 36 // client: the descriptor kept under a name
	TypeDrop    Type = 37 // client: let go of the descriptor kept under a name
	TypeList    Type = 38 // client: the names kept that begin with a prefix
	TypeDone    Type = 39 // keeper: a Put or Drop done
	TypeTaken   Type = 40 // keeper: the size; the descriptor rides with the frame
	TypeListed  Type = 41 // keeper: names and sizes; FlagMore on all but a List's last
	TypeError   Type = 42 // keeper: a request failed: a code and why
)

var typeNames = map[Type]string{TypeHello: "Hello", TypeWelcome: "Welcome", TypeRefused: "Refused", TypePut: "Put", TypeTake: "Take",
	TypeDrop: "Drop", TypeList: "List", TypeDone: "Done", TypeTaken: "Taken", TypeListed: "Listed", TypeError: "Error",
	TypeHostHello: "HostHello", TypeHostTier: "HostTier", TypeHostRefused: "HostRefused"}

func (t Type) String() string {
	if n, ok := typeNames[t]; ok {
		return n
	}
	return fmt.Sprintf("type(%d)", uint8(t))
}

// FlagMore on a Listed says another Listed of the same request follows.
const FlagMore = 1

// The codes of an Error or Refused frame.
const (
	CodeInternal uint16 = 1 // the keeper failed for a reason of its own
	CodeNotKept  uint16 = 2 // nothing is kept under the name
	CodeRefused  uint16 = 3 // not admitted: the user, the version, the Hello
	CodeLimit    uint16 = 4 // a cap is full: names kept, connections
	CodeName     uint16 = 5 // a name breaks the rule
)

// Header is a frame's header.
type Header struct {
	Type  Type
	Flags uint8
	ID    uint32
}

// The payload of each frame type, decoded.
type (
	// Hello opens a connection: the client's version, pid (for logs; the keeper
	// judges by the kernel's credentials) and [Role].
	Hello struct {
		Version, PID uint32
		Role         Role
	}
	// Welcome answers Hello: the keeper's version and pid.
	Welcome struct{ Version, PID uint32 }
	// Problem is an Error or Refused frame: a code and why.
	Problem struct {
		Code uint16
		Text string
	}
	// Put asks the keeper to keep the descriptor riding with the frame under Name,
	// replacing (and closing) one kept under it before. Size is the client's word,
	// given back by Take and List; the keeper does not check it.
	Put struct {
		Name string
		Size uint64
	}
	// Name is the payload of Take and Drop: a name; of List: a prefix ("" for all).
	Name struct{ Name string }
	// Taken answers Take: the size Put gave; the descriptor rides with the frame.
	Taken struct{ Size uint64 }
	// Listed is one frame of a List's answer; More says another follows.
	Listed struct {
		More    bool
		Entries []Entry
	}
	// Empty is the payload of Done.
	Empty struct{}
)

// Entry is a name kept and the size Put gave it.
type Entry struct {
	Name string
	Size uint64
}

// entryLen is the bytes of e in a Listed frame.
func entryLen(e Entry) int { return 2 + len(e.Name) + 8 }

// Limit is the smallest and largest payload a frame type has.
type Limit struct{ Min, Max int }

// PayloadLimits are the payload lengths each frame type may have; a type with no entry
// is unknown.
var PayloadLimits = map[Type]Limit{
	TypeHello:   {12, 12},
	TypeWelcome: {8, 8},
	TypeRefused: {4, 4 + kvwire.MaxText},
	TypePut:     {2 + 1 + 8, 2 + MaxName + 8},
	TypeTake:    {2 + 1, 2 + MaxName},
	TypeDrop:    {2 + 1, 2 + MaxName},
	TypeList:    {2, 2 + MaxName},
	TypeDone:    {0, 0},
	TypeTaken:   {8, 8},
	TypeListed:  {4, kvwire.MaxFrame - kvwire.HeaderLen},
	TypeError:   {4, 4 + kvwire.MaxText},
}

// limitOf is the payload lengths of type t, of either protocol.
func limitOf(t Type) (Limit, bool) {
	if lim, ok := PayloadLimits[t]; ok {
		return lim, true
	}
	lim, ok := HostPayloadLimits[t]
	return lim, ok
}

// KnownFlags are the flag bits a frame of type t may carry.
func KnownFlags(t Type) uint8 {
	if t == TypeListed {
		return FlagMore
	}
	return 0
}

// CarriesFD says whether a frame of type t carries exactly one descriptor (Put,
// Taken, HostTier); every other type carries none, and a descriptor sent with one is closed.
func CarriesFD(t Type) bool { return t == TypePut || t == TypeTaken || t == TypeHostTier }

// Append appends the frame of type t, request id, whose payload is m (the message
// type [Decode] gives for t). It fails for a message that is not t's or does not fit
// the layout.
func Append(b []byte, t Type, id uint32, m any) ([]byte, error) {
	start := len(b)
	var flags uint8
	if l, ok := m.(Listed); ok && l.More {
		flags = FlagMore
	}
	b = kvwire.Begin(b, kvwire.Type(t), flags, id)
	body, err := appendPayload(b, t, m)
	if err != nil {
		return b[:start], err
	}
	if lim, ok := limitOf(t); !ok || len(body)-len(b) < lim.Min || len(body)-len(b) > lim.Max {
		return b[:start], fmt.Errorf("keep: a %s payload of %d bytes is outside its layout's %v", t, len(body)-len(b), lim)
	}
	return kvwire.End(body, start)
}

func appendPayload(b []byte, t Type, m any) ([]byte, error) {
	switch v := m.(type) {
	case Hello:
		if t == TypeHello {
			return appendU32(appendU32(appendU32(b, v.Version), v.PID), uint32(v.Role)), nil
		}
	case Welcome:
		if t == TypeWelcome {
			return appendU32(appendU32(b, v.Version), v.PID), nil
		}
	case Problem:
		if t == TypeRefused || t == TypeError || t == TypeHostRefused {
			return appendText(appendU16(b, v.Code), v.Text), nil
		}
	case Put:
		if t == TypePut {
			return appendText(appendU64(b, v.Size), v.Name), nil
		}
	case Name:
		if t == TypeTake || t == TypeDrop || t == TypeList {
			return appendText(b, v.Name), nil
		}
	case Taken:
		if t == TypeTaken {
			return appendU64(b, v.Size), nil
		}
	case Listed:
		if t == TypeListed {
			b = appendU32(b, uint32(len(v.Entries)))
			for _, e := range v.Entries {
				b = appendU64(appendText(b, e.Name), e.Size)
			}
			return b, nil
		}
	case Empty:
		if t == TypeDone {
			return b, nil
		}
	case HostHello:
		if t == TypeHostHello {
			return appendU32(appendU32(appendU32(b, v.Version), v.PID), v.Device), nil
		}
	case HostTier:
		if t == TypeHostTier {
			return appendU64(appendU64(appendU32(appendU32(b, v.Device), v.Pages), v.PageBytes), v.Bytes), nil
		}
	}
	return b, fmt.Errorf("keep: a %T is not the payload of %s", m, t)
}

func appendU16(b []byte, v uint16) []byte  { return binary.LittleEndian.AppendUint16(b, v) }
func appendU32(b []byte, v uint32) []byte  { return binary.LittleEndian.AppendUint32(b, v) }
func appendU64(b []byte, v uint64) []byte  { return binary.LittleEndian.AppendUint64(b, v) }
func appendText(b []byte, s string) []byte { return append(appendU16(b, uint16(len(s))), s...) }

// Decode decodes payload p of a frame with header h into the message of its type
// (Hello, Welcome, Problem, Put, Name, Taken, Listed, Empty, HostHello or HostTier). A payload outside its type's
// [PayloadLimits], a type not listed, flags the type does not define or a payload that
// breaks the layout fail with an error wrapping [ErrMalformed]. What decodes encodes
// back ([Append]) to the same bytes.
func Decode(h Header, p []byte) (any, error) {
	lim, ok := limitOf(h.Type)
	switch {
	case !ok:
		return nil, fmt.Errorf("%w: unknown frame type %s", ErrMalformed, h.Type)
	case h.Flags&^KnownFlags(h.Type) != 0:
		return nil, fmt.Errorf("%w: %s with unknown flags %#x", ErrMalformed, h.Type, h.Flags&^KnownFlags(h.Type))
	case len(p) < lim.Min || len(p) > lim.Max:
		return nil, fmt.Errorf("%w: a %s payload of %d bytes, outside %d to %d", ErrMalformed, h.Type, len(p), lim.Min, lim.Max)
	}
	r := kvwire.NewParser(kvwire.Type(h.Type), p)
	var m any
	switch h.Type {
	case TypeHello:
		m = Hello{Version: r.U32(), PID: r.U32(), Role: Role(r.U32())}
	case TypeWelcome:
		m = Welcome{Version: r.U32(), PID: r.U32()}
	case TypeRefused, TypeError, TypeHostRefused:
		m = Problem{Code: r.U16(), Text: r.Text()}
	case TypeHostHello:
		m = HostHello{Version: r.U32(), PID: r.U32(), Device: r.U32()}
	case TypeHostTier:
		m = HostTier{Device: r.U32(), Pages: r.U32(), PageBytes: r.U64(), Bytes: r.U64()}
	case TypePut:
		size := r.U64()
		m = Put{Name: r.Text(), Size: size}
	case TypeTake, TypeDrop, TypeList:
		m = Name{Name: r.Text()}
	case TypeTaken:
		m = Taken{Size: r.U64()}
	case TypeListed:
		l := Listed{More: h.Flags&FlagMore != 0}
		n := r.U32()
		// Each entry is at least 10 bytes: a count the payload cannot hold is refused
		// before anything is allocated for it.
		if uint64(n)*10 > uint64(len(p)) {
			return nil, fmt.Errorf("%w: Listed says %d entries in %d bytes", ErrMalformed, n, len(p))
		}
		if n > 0 {
			l.Entries = make([]Entry, 0, n)
		}
		for range n {
			l.Entries = append(l.Entries, Entry{Name: r.Text(), Size: r.U64()})
		}
		m = l
	case TypeDone:
		m = Empty{}
	}
	if err := r.Done(); err != nil {
		return nil, fmt.Errorf("keep: %s: %w", h.Type, err)
	}
	return m, nil
}

// DecodeFrame decodes the frame at the start of b, read as a stream by kvwire's
// Reader: its header, its message and its length. It fails as the Reader and [Decode]
// do, with an error wrapping [ErrMalformed].
func DecodeFrame(b []byte) (Header, any, int, error) {
	src := bytes.NewReader(b)
	rd := kvwire.NewReader()
	kh, p, err := rd.Next(src)
	if err != nil {
		if !errors.Is(err, ErrMalformed) {
			err = fmt.Errorf("%w: %d bytes, shorter than a frame: %w", ErrMalformed, len(b), err)
		}
		return Header{}, nil, 0, err
	}
	h := Header{Type: Type(kh.Type), Flags: kh.Flags, ID: kh.ID}
	m, err := Decode(h, p)
	return h, m, len(b) - src.Len() - rd.Unread(), err
}
