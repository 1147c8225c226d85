package kvwire

import (
	"encoding/binary"
	"fmt"
	"io"
)

// Reader takes whole frames from a stream: each read takes whatever has arrived into
// its buffer, so a frame costs one read where it arrives whole, and frames that arrive
// together cost one read between them. A read cut short (a deadline) loses nothing:
// the next Next goes on from where it stopped. A Reader is not safe for concurrent use.
type Reader struct {
	buf  []byte
	r, w int
	max  int // the largest frame taken
}

// NewReader returns a Reader with a buffer for the largest frame and then some.
func NewReader() *Reader { return &Reader{buf: make([]byte, 2*MaxFrame), max: MaxFrame} }

// NewHandshakeReader returns a Reader that takes frames of at most MaxHello bytes, with
// a buffer to match, until Grow: what an owner gives a connection it has not admitted.
func NewHandshakeReader() *Reader { return &Reader{buf: make([]byte, 2*MaxHello), max: MaxHello} }

// Grow makes rd take frames of up to MaxFrame bytes, keeping what it has buffered.
func (rd *Reader) Grow() {
	if rd.max == MaxFrame {
		return
	}
	buf := make([]byte, 2*MaxFrame)
	rd.w = copy(buf, rd.buf[rd.r:rd.w])
	rd.r, rd.buf, rd.max = 0, buf, MaxFrame
}

// Next returns the next frame from src: its header and its payload, which aliases the
// Reader's buffer until the next call. A frame that breaks the layout fails with an
// error wrapping ErrMalformed (or kv.ErrTooLarge): the stream cannot be read further.
func (rd *Reader) Next(src io.Reader) (Header, []byte, error) {
	for {
		if avail := rd.w - rd.r; avail >= 4 {
			n := int(binary.LittleEndian.Uint32(rd.buf[rd.r:]))
			if n+4 > rd.max {
				return Header{}, nil, fmt.Errorf("%w: a frame of %d bytes is over the limit of %d", ErrMalformed, uint64(n)+4, rd.max)
			}
			if n < HeaderLen-4 {
				return Header{}, nil, fmt.Errorf("%w: a frame of %d bytes is shorter than its header", ErrMalformed, n+4)
			}
			if avail >= n+4 {
				f := rd.buf[rd.r : rd.r+4+n]
				rd.r += 4 + n
				if rd.r == rd.w {
					rd.r, rd.w = 0, 0
				}
				if f[6] != 0 || f[7] != 0 {
					return Header{}, nil, fmt.Errorf("%w: reserved bytes are not zero", ErrMalformed)
				}
				h := Header{Type: Type(f[4]), Flags: f[5], ID: binary.LittleEndian.Uint32(f[8:])}
				return h, f[HeaderLen:], nil
			}
			if rd.r+4+n > len(rd.buf) {
				rd.compact()
			}
		} else if rd.r+4 > len(rd.buf) {
			rd.compact()
		}
		m, err := src.Read(rd.buf[rd.w:])
		if m > 0 {
			rd.w += m
			continue
		}
		if err == nil {
			err = io.ErrNoProgress
		}
		if err == io.EOF && rd.w > rd.r {
			err = fmt.Errorf("%w: the stream ended inside a frame", ErrMalformed)
		}
		return Header{}, nil, err
	}
}

func (rd *Reader) compact() {
	rd.w = copy(rd.buf, rd.buf[rd.r:rd.w])
	rd.r = 0
}

// Whole says whether a whole frame (or a header that breaks the layout) is in the
// buffer: Next returns it without reading.
func (rd *Reader) Whole() bool {
	if rd.w-rd.r < 4 {
		return false
	}
	n := int(binary.LittleEndian.Uint32(rd.buf[rd.r:]))
	return n+4 > rd.max || n < HeaderLen-4 || rd.w-rd.r >= n+4
}

// Buffered says whether a frame (or part of one) is in the buffer, unread.
func (rd *Reader) Buffered() bool { return rd.w > rd.r }

// Unread is how many bytes the Reader has taken from its source past the last frame
// Next returned: with the bytes read so far, where in the stream that frame ended.
func (rd *Reader) Unread() int { return rd.w - rd.r }
