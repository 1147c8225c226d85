package kvwire

import (
	"encoding/binary"
	"fmt"
	"io"

	"github.com/cudapool/cudapool/internal/session"
)

// framing is the page protocol's on a stream ([session.Framing]).
var framing = session.Framing{
	HeaderLen: HeaderLen,
	Len: func(h []byte, max int) (int, error) {
		n := int(binary.LittleEndian.Uint32(h)) + 4
		switch {
		case n > max:
			return 0, fmt.Errorf("%w: a frame of %d bytes is over the limit of %d", ErrMalformed, n, max)
		case n < HeaderLen:
			return 0, fmt.Errorf("%w: a frame of %d bytes is shorter than its header", ErrMalformed, n)
		}
		return n, nil
	},
	Ended: func([]byte, int) error {
		return fmt.Errorf("%w: the stream ended inside a frame", ErrMalformed)
	},
	Refused: func(err error) error { return fmt.Errorf("%w: %w", ErrMalformed, err) },
}

// Reader takes whole frames from a stream ([session.FrameReader]): a frame costs one
// read where it arrives whole, and a read cut short (a deadline) loses nothing. On a
// Unix socket it takes the descriptor that comes with a frame (a Notifier's eventfd),
// at most one a read: [Reader.TakeFD]. A Reader is not safe for concurrent use.
type Reader struct{ fr *session.FrameReader }

// NewReader returns a Reader of frames of up to MaxFrame bytes.
func NewReader() *Reader { return &Reader{fr: session.NewFrameReader(framing, MaxFrame, 1)} }

// NewHandshakeReader returns a Reader that takes frames of at most MaxHello bytes,
// until Grow: what an owner gives a connection it has not admitted.
func NewHandshakeReader() *Reader {
	return &Reader{fr: session.NewFrameReader(framing, MaxHello, 1)}
}

// Grow makes rd take frames of up to MaxFrame bytes, keeping what it has buffered.
func (rd *Reader) Grow() { rd.fr.SetMax(MaxFrame) }

// Next returns the next frame from src: its header and its payload, which aliases the
// Reader's buffer until the next call. A frame that breaks the layout fails with an
// error wrapping ErrMalformed: the stream cannot be read further.
func (rd *Reader) Next(src io.Reader) (Header, []byte, error) { return rd.NextWait(src, true) }

// NextWait is Next, waiting for a frame or, without wait, failing with
// [session.ErrNoFrame] where no whole frame has arrived.
func (rd *Reader) NextWait(src io.Reader, wait bool) (Header, []byte, error) {
	f, err := rd.fr.Next(src, wait)
	if err != nil {
		return Header{}, nil, err
	}
	if f[6] != 0 || f[7] != 0 {
		return Header{}, nil, fmt.Errorf("%w: reserved bytes are not zero", ErrMalformed)
	}
	return Header{Type: Type(f[4]), Flags: f[5], ID: binary.LittleEndian.Uint32(f[8:])}, f[HeaderLen:], nil
}

// TakeFD returns the descriptor that came with the frame Next returned last, -1 if
// none did; the caller owns it. One not taken is closed by the next Next.
func (rd *Reader) TakeFD() int { return rd.fr.TakeFD() }

// Close closes the descriptors that came and were not taken.
func (rd *Reader) Close() { rd.fr.Close() }

// Whole says whether a whole frame (or a header that breaks the layout) is in the
// buffer: Next returns it without reading.
func (rd *Reader) Whole() bool { return rd.fr.Buffered() }

// Unread is how many bytes the Reader has taken from its source past the last frame
// Next returned: with the bytes read so far, where in the stream that frame ended.
func (rd *Reader) Unread() int { return rd.fr.Unread() }
