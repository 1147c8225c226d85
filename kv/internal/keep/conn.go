package keep

import (
	"errors"
	"fmt"
	"net"

	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// frames reads whole frames, and the descriptors that ride with them, from one end of
// a keeper connection: a frame whose type carries one ([CarriesFD]) takes it, and every
// other descriptor is closed. frames is not safe for concurrent use.
type frames struct {
	in    *unixfd.Stream
	rd    *kvwire.Reader
	first int // the first byte read, or -1
}

func newFrames(nc *net.UnixConn, rd *kvwire.Reader) *frames {
	return &frames{in: unixfd.NewStream(nc), rd: rd, first: -1}
}

// Read is the connection's bytes, for the Reader, the first one noted.
func (f *frames) Read(b []byte) (int, error) {
	n, err := f.in.Read(b)
	if f.first < 0 && n > 0 {
		f.first = int(b[0])
	}
	return n, err
}

// next returns the next frame, its payload (aliasing the Reader's buffer until the
// next call) and, for a type that carries one, its descriptor, which the caller then
// owns. A frame of such a type without a descriptor, a message of more than one, or a
// layout the Reader refuses, fails with an error wrapping [ErrMalformed].
func (f *frames) next() (Header, []byte, int, error) {
	kh, p, err := f.rd.Next(f)
	if errors.Is(err, unixfd.ErrUnexpectedFDs) {
		err = fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	if err != nil {
		return Header{}, nil, -1, err
	}
	h := Header{Type: Type(kh.Type), Flags: kh.Flags, ID: kh.ID}
	end := f.in.Offset() - int64(f.rd.Unread())
	if !CarriesFD(h.Type) {
		f.in.Drop(end)
		return h, p, -1, nil
	}
	fd, ok := f.in.Take(end-int64(kvwire.HeaderLen+len(p)), end)
	if !ok {
		return Header{}, nil, -1, fmt.Errorf("%w: a %s without its descriptor", ErrMalformed, h.Type)
	}
	return h, p, fd, nil
}

// close closes every descriptor received and not taken.
func (f *frames) close() { f.in.Drop(f.in.Offset() + 1) }
