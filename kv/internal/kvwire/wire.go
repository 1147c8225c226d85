// Package kvwire owns the frames of the KV page pool's socket (dir/kv.sock): their
// layout, their encoding without per-page allocations, and a reader that takes whole
// frames from a stream in as few reads as it can.
//
// A frame is u32 len (the bytes after this field) | u8 type | u8 flags | u16 reserved
// (0) | u32 request id | payload, little-endian, at most MaxFrame bytes in all. A reply
// carries its request's id.
package kvwire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"unsafe"

	"github.com/cudapool/cudapool/kv"
)

// Version is the version of the page protocol; Hello carries it. Version 2 gave
// Refused an error code and the Hello's id; version 3 replaced the IPC event of Seal,
// Release and Bye with a Point of a notifier (an eventfd the replica passes once, in a
// Notifier frame); version 4 put the slab on the VMM route: the Welcome says how it
// lies in chunks (kv.SlabLayout), and the chunks' descriptors ride with Grow frames on
// this connection, where segments were imported from slab.sock before.
const Version = 4

// The files of an owner's directory.
const (
	PageSocket = "kv.sock" // the page server
)

// SlabName is the name of the slab of device dev whose chunks were first made under
// id (random, so that a replica tells a restarted owner's slab of the same memory from a
// new one).
func SlabName(dev int, id uint64) string {
	return "kv/slab/" + strconv.Itoa(dev) + "@" + strconv.FormatUint(id, 16)
}

const (
	// HeaderLen is the bytes of a frame before its payload.
	HeaderLen = 12
	// MaxFrame bounds a whole frame, header included.
	MaxFrame = 128 << 10
	// PointLen is the bytes of an encoded Point.
	PointLen = 12
	// MaxText bounds the strings a frame carries (namespace, reason, message).
	MaxText = 4096
	// GeometryLen is the bytes of an encoded kv.Geometry.
	GeometryLen = 24
	// MaxHello bounds a Hello frame: the owner reads frames no larger until it has
	// admitted the connection.
	MaxHello = HeaderLen + 12 + 2 + MaxText
	// MaxNamespace bounds a Hello's namespace, in bytes.
	MaxNamespace = 256
)

// Type is a frame's type byte.
type Type uint8

// The frame types.
const (
	TypeHello      Type = 1  // replica: version, pid, device, namespace
	TypeWelcome    Type = 2  // owner: admitted; the geometry and the slab's name
	TypeRefused    Type = 3  // owner: not admitted: a code and why; then close
	TypeAlloc      Type = 4  // replica: n pages for writing
	TypeLeased     Type = 5  // owner: the write lease answering Alloc
	TypeSeal       Type = 6  // replica: a write lease's pages under these hashes, after this point
	TypeSealed     Type = 7  // owner: how many became visible, were duplicates, are pending
	TypeMatch      Type = 8  // replica: the longest visible run of these hashes
	TypeMatched    Type = 9  // owner: the read lease answering Match
	TypeRelease    Type = 10 // replica: these leases end after this point
	TypeReleased   Type = 11 // owner: how many ended
	TypeStats      Type = 12 // replica: the owner's Stats
	TypeStatsReply Type = 13 // owner: Stats as JSON
	TypeError      Type = 14 // owner: a request failed
	TypeBye        Type = 15 // replica: no more requests from me; held leases end after the point if it carries one
	TypeReattach   Type = 16 // replica: a lease held from before the owner's restart; id 0 ends the list
	TypeReattached Type = 17 // owner: the lease is kept, or lost and why
	TypeNotifier   Type = 18 // replica: a notifier's id; its eventfd rides with the frame (SCM_RIGHTS); no reply
	TypeGrow       Type = 19 // owner: a chunk of the slab, mapped; its descriptor rides with the frame (SCM_RIGHTS); id 0, no reply
	TypeShrink     Type = 20 // owner: the slab keeps this many chunks, the others unmapped; id 0, no reply
)

func (t Type) String() string {
	names := [...]string{"", "Hello", "Welcome", "Refused", "Alloc", "Leased", "Seal", "Sealed", "Match", "Matched", "Release", "Released", "Stats", "StatsReply", "Error", "Bye", "Reattach", "Reattached", "Notifier", "Grow", "Shrink"}
	if int(t) < len(names) && t != 0 {
		return names[t]
	}
	return fmt.Sprintf("type(%d)", uint8(t))
}

// Observer is the device of a Hello that asks for Stats alone: such a connection maps
// no slab, takes no leases and is no replica.
const Observer = ^uint32(0)

// FlagWait on a Seal asks for the answer only once the pages are visible.
const FlagWait = 1

// ErrMalformed means a frame does not follow the layout; the connection it came on
// must be closed.
var ErrMalformed = errors.New("kvwire: malformed frame")

// Header is a frame's header.
type Header struct {
	Type  Type
	Flags uint8
	ID    uint32
}

// Error codes of an Error frame.
const (
	CodeInternal   uint16 = 1
	CodeNoSpace    uint16 = 2
	CodeStaleLease uint16 = 3
	CodeGeometry   uint16 = 4
	CodeTooLarge   uint16 = 5
	CodeClosed     uint16 = 6
	CodeRefused    uint16 = 7 // Refused: the policy, the version or the Hello
	CodeLimit      uint16 = 8 // a cap on connections, leases or notifiers is full
)

var codeErrs = map[uint16]error{CodeNoSpace: kv.ErrNoSpace, CodeStaleLease: kv.ErrStaleLease, CodeGeometry: kv.ErrGeometry, CodeTooLarge: kv.ErrTooLarge,
	CodeClosed: kv.ErrClosed, CodeRefused: kv.ErrRefused, CodeLimit: kv.ErrLimit}

// Code is the Error frame code for err.
func Code(err error) uint16 {
	for c, e := range codeErrs {
		if errors.Is(err, e) {
			return c
		}
	}
	return CodeInternal
}

// RemoteError is the error an Error frame stands for.
func RemoteError(code uint16, msg string) error {
	return &kv.RemoteError{Err: codeErrs[code], Text: msg, Peer: "kv: owner"}
}

// Begin starts a frame of type t in b (appended), to be finished by End.
func Begin(b []byte, t Type, flags uint8, id uint32) []byte {
	return append(b, 0, 0, 0, 0, byte(t), flags, 0, 0, byte(id), byte(id>>8), byte(id>>16), byte(id>>24))
}

// End finishes the frame that starts at b[start]: it fills in the length, or fails
// with kv.ErrTooLarge (and b cut back to start) if the frame is over MaxFrame.
func End(b []byte, start int) ([]byte, error) {
	n := len(b) - start
	if n > MaxFrame {
		return b[:start], fmt.Errorf("%w: a frame of %d bytes is over the limit of %d", kv.ErrTooLarge, n, MaxFrame)
	}
	binary.LittleEndian.PutUint32(b[start:], uint32(n-4))
	return b, nil
}

func appendU16(b []byte, v uint16) []byte { return binary.LittleEndian.AppendUint16(b, v) }
func appendU32(b []byte, v uint32) []byte { return binary.LittleEndian.AppendUint32(b, v) }
func appendU64(b []byte, v uint64) []byte { return binary.LittleEndian.AppendUint64(b, v) }

func appendText(b []byte, s string) []byte {
	if len(s) > MaxText {
		s = s[:MaxText]
	}
	return append(appendU16(b, uint16(len(s))), s...)
}

// frame appends a whole frame whose payload body writes.
func frame(b []byte, t Type, flags uint8, id uint32, body func([]byte) []byte) ([]byte, error) {
	start := len(b)
	b = Begin(b, t, flags, id)
	if body != nil {
		b = body(b)
	}
	return End(b, start)
}

// Hello is the replica's first frame.
type Hello struct {
	Version, PID, Device uint32
	Namespace            string
}

// AppendHello appends a Hello frame.
func AppendHello(b []byte, id uint32, m Hello) ([]byte, error) {
	return frame(b, TypeHello, 0, id, func(b []byte) []byte {
		b = appendU32(appendU32(appendU32(b, m.Version), m.PID), m.Device)
		return appendText(b, m.Namespace)
	})
}

// AppendGeometry appends g's 24-byte encoding (also the slab's metadata).
func AppendGeometry(b []byte, g kv.Geometry) []byte {
	b = appendU32(appendU32(appendU32(appendU32(appendU32(b, uint32(g.Layers)), uint32(g.KVHeads)), uint32(g.HeadDim)), uint32(g.TokensPerPage)), uint32(g.Pages))
	return append(b, byte(g.DType), 0, 0, 0)
}

// Welcome admits a replica: the slab's geometry, the size of its chunks (the layout is
// Geometry.SlabLayout(ChunkBytes)), how many chunks are mapped (the Grow frames that
// follow at once carry their descriptors, one each, before any reply), the pid of the
// keeper that holds them (0: none; the slab is gone once it exits) and the slab's
// name.
type Welcome struct {
	Geometry   kv.Geometry
	ChunkBytes uint64
	Chunks     uint32
	Keeper     uint32
	Slab       string
}

// AppendWelcome appends a Welcome frame.
func AppendWelcome(b []byte, id uint32, m Welcome) ([]byte, error) {
	return frame(b, TypeWelcome, 0, id, func(b []byte) []byte {
		return appendText(appendU32(appendU32(appendU64(AppendGeometry(b, m.Geometry), m.ChunkBytes), m.Chunks), m.Keeper), m.Slab)
	})
}

// Grow says that chunk Chunk of the slab is mapped; its descriptor rides with the
// frame (SCM_RIGHTS). The owner sends it with id 0 before any reply that grants a page
// in that chunk.
type Grow struct{ Chunk uint32 }

// Shrink says that the slab keeps its first Chunks chunks: the owner has given the
// pages of the others back (none is leased, nor will be) and unmaps them; a replica
// unmaps them too, so that their memory goes back to the driver. Id 0, no reply.
type Shrink struct{ Chunks uint32 }

// AppendShrink appends a Shrink frame.
func AppendShrink(b []byte, m Shrink) ([]byte, error) {
	return frame(b, TypeShrink, 0, 0, func(b []byte) []byte { return appendU32(b, m.Chunks) })
}

// AppendGrow appends a Grow frame; the caller sends it with the descriptor.
func AppendGrow(b []byte, m Grow) ([]byte, error) {
	return frame(b, TypeGrow, 0, 0, func(b []byte) []byte { return appendU32(b, m.Chunk) })
}

// AppendError appends an Error frame, or with t TypeRefused a Refused frame: a code
// and a message.
func AppendError(b []byte, t Type, id uint32, code uint16, msg string) ([]byte, error) {
	return frame(b, t, 0, id, func(b []byte) []byte { return appendText(appendU16(b, code), msg) })
}

// ParseError reads the payload of an Error or Refused frame as the error it stands for.
func ParseError(t Type, p []byte) error {
	pm, err := DecodeProblem(t, p)
	if err != nil {
		return err
	}
	if t == TypeRefused {
		pm.Text = "refused: " + pm.Text
	}
	return RemoteError(pm.Code, pm.Text)
}

// AppendEmpty appends a frame without payload: Stats, Bye.
func AppendEmpty(b []byte, t Type, id uint32) ([]byte, error) { return frame(b, t, 0, id, nil) }

// AppendU32 appends a frame whose payload is one u32: Alloc, Released.
func AppendU32(b []byte, t Type, id uint32, v uint32) ([]byte, error) {
	start := len(b)
	return End(appendU32(Begin(b, t, 0, id), v), start)
}

// AppendLease appends Leased or Matched: a lease and its pages.
func AppendLease(b []byte, t Type, id uint32, lease uint64, pages []uint32) ([]byte, error) {
	if len(pages) > kv.MaxBatch {
		return b, fmt.Errorf("%w: %d pages, at most %d", kv.ErrTooLarge, len(pages), kv.MaxBatch)
	}
	start := len(b)
	b = appendU32(appendU64(Begin(b, t, 0, id), lease), uint32(len(pages)))
	for _, p := range pages {
		b = appendU32(b, p)
	}
	return End(b, start)
}

// hashBytes is hs as bytes, without a copy (a Hash is 16 bytes, aligned to 1).
func hashBytes(hs []kv.Hash) []byte {
	if len(hs) == 0 {
		return nil
	}
	return unsafe.Slice(&hs[0][0], len(hs)*len(kv.Hash{}))
}

func checkBatch(what string, n int) error {
	if n > kv.MaxBatch {
		return fmt.Errorf("%w: %d %s, at most %d", kv.ErrTooLarge, n, what, kv.MaxBatch)
	}
	return nil
}

// AppendSeal appends a Seal frame.
func AppendSeal(b []byte, id uint32, wait bool, lease uint64, at Point, hashes []kv.Hash) ([]byte, error) {
	if err := checkBatch("hashes", len(hashes)); err != nil {
		return b, err
	}
	var flags uint8
	if wait {
		flags = FlagWait
	}
	start := len(b)
	b = appendU64(Begin(b, TypeSeal, flags, id), lease)
	b = appendU32(at.append(b), uint32(len(hashes)))
	return End(append(b, hashBytes(hashes)...), start)
}

// Point is where a stream's work is done: once notifier Notifier's eventfd has
// counted Target completions in all (the Target'th StreamNotify the replica queued
// on that notifier's stream has run). Notifier 0 (with Target 0) means nothing to wait for:
// the work had completed when the replica sent it.
type Point struct {
	Notifier uint32
	Target   uint64
}

// Now is the Point that waits for nothing.
var Now = Point{}

func (at Point) append(b []byte) []byte { return appendU64(appendU32(b, at.Notifier), at.Target) }

// Sealed answers a Seal.
type Sealed struct{ Visible, Duplicates, Pending uint32 }

// AppendSealed appends a Sealed frame.
func AppendSealed(b []byte, id uint32, m Sealed) ([]byte, error) {
	start := len(b)
	return End(appendU32(appendU32(appendU32(Begin(b, TypeSealed, 0, id), m.Visible), m.Duplicates), m.Pending), start)
}

// AppendMatch appends a Match frame.
func AppendMatch(b []byte, id uint32, hashes []kv.Hash) ([]byte, error) {
	if err := checkBatch("hashes", len(hashes)); err != nil {
		return b, err
	}
	start := len(b)
	b = appendU32(Begin(b, TypeMatch, 0, id), uint32(len(hashes)))
	return End(append(b, hashBytes(hashes)...), start)
}

// AppendRelease appends a Release frame.
func AppendRelease(b []byte, id uint32, at Point, leases []uint64) ([]byte, error) {
	if err := checkBatch("leases", len(leases)); err != nil {
		return b, err
	}
	start := len(b)
	b = appendU32(at.append(Begin(b, TypeRelease, 0, id)), uint32(len(leases)))
	for _, l := range leases {
		b = appendU64(b, l)
	}
	return End(b, start)
}

// Parser reads the payload of one frame, field by field; the first field that does not
// fit makes Err say so and every later field zero.
type Parser struct {
	p   []byte
	t   Type
	err error
}

// NewParser parses payload p of a frame of type t.
func NewParser(t Type, p []byte) *Parser { return &Parser{p: p, t: t} }

func (r *Parser) take(n int) []byte {
	if r.err != nil {
		return nil
	}
	if n < 0 || len(r.p) < n {
		r.err = fmt.Errorf("%w: %s payload ends early", ErrMalformed, r.t)
		return nil
	}
	b := r.p[:n]
	r.p = r.p[n:]
	return b
}

// U16 reads a u16.
func (r *Parser) U16() uint16 {
	if b := r.take(2); b != nil {
		return binary.LittleEndian.Uint16(b)
	}
	return 0
}

// U32 reads a u32.
func (r *Parser) U32() uint32 {
	if b := r.take(4); b != nil {
		return binary.LittleEndian.Uint32(b)
	}
	return 0
}

// U64 reads a u64.
func (r *Parser) U64() uint64 {
	if b := r.take(8); b != nil {
		return binary.LittleEndian.Uint64(b)
	}
	return 0
}

// Text reads a string (u16 length and bytes).
func (r *Parser) Text() string {
	n := int(r.U16())
	if n > MaxText {
		r.err = fmt.Errorf("%w: %s text of %d bytes", ErrMalformed, r.t, n)
		return ""
	}
	return string(r.take(n))
}

// Point reads a Point; a point of notifier 0 must be 0.
func (r *Parser) Point() Point {
	at := Point{Notifier: r.U32(), Target: r.U64()}
	if r.err == nil && at.Notifier == 0 && at.Target != 0 {
		r.err = fmt.Errorf("%w: %s names no notifier but a target %d", ErrMalformed, r.t, at.Target)
	}
	return at
}

// count reads a u32 count of items of size bytes each, at most kv.MaxBatch.
func (r *Parser) count(size int) int {
	n := r.U32()
	if r.err == nil && n > kv.MaxBatch {
		r.err = fmt.Errorf("%w: %s of %d items, at most %d", kv.ErrTooLarge, r.t, n, kv.MaxBatch)
	}
	if r.err == nil && uint64(len(r.p)) < uint64(n)*uint64(size) {
		r.err = fmt.Errorf("%w: %s says %d items, has room for %d", ErrMalformed, r.t, n, len(r.p)/size)
	}
	if r.err != nil {
		return 0
	}
	return int(n)
}

// Hashes reads a count and that many hashes, aliasing the payload (no copy).
func (r *Parser) Hashes() []kv.Hash {
	n := r.count(len(kv.Hash{}))
	b := r.take(n * len(kv.Hash{}))
	if n == 0 {
		return nil
	}
	return unsafe.Slice((*kv.Hash)(unsafe.Pointer(&b[0])), n)
}

// U32s reads a count and that many u32s, appended to dst.
func (r *Parser) U32s(dst []uint32) []uint32 {
	n := r.count(4)
	b := r.take(4 * n)
	for i := range n {
		dst = append(dst, binary.LittleEndian.Uint32(b[4*i:]))
	}
	return dst
}

// U64s reads a count and that many u64s, appended to dst.
func (r *Parser) U64s(dst []uint64) []uint64 {
	n := r.count(8)
	b := r.take(8 * n)
	for i := range n {
		dst = append(dst, binary.LittleEndian.Uint64(b[8*i:]))
	}
	return dst
}

// Geometry reads an encoded geometry.
func (r *Parser) Geometry() kv.Geometry {
	var g kv.Geometry
	g.Layers, g.KVHeads, g.HeadDim, g.TokensPerPage, g.Pages = int(r.U32()), int(r.U32()), int(r.U32()), int(r.U32()), int(r.U32())
	if b := r.take(4); b != nil {
		g.DType = kv.DType(b[0])
		if r.err == nil && (b[1] != 0 || b[2] != 0 || b[3] != 0) {
			r.err = fmt.Errorf("%w: %s geometry's reserved bytes are not zero", ErrMalformed, r.t)
		}
	}
	return g
}

// Done says whether the payload parsed whole: the first error, or an error for bytes
// left over.
func (r *Parser) Done() error {
	if r.err == nil && len(r.p) != 0 {
		r.err = fmt.Errorf("%w: %d bytes after the %s payload", ErrMalformed, len(r.p), r.t)
	}
	return r.err
}

// ParseGeometry decodes a geometry encoded by AppendGeometry, checking it.
func ParseGeometry(b []byte) (kv.Geometry, error) {
	r := NewParser(TypeWelcome, b)
	g := r.Geometry()
	if err := r.Done(); err != nil {
		return kv.Geometry{}, err
	}
	return g, g.Validate()
}
