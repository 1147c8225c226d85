package keep

import (
	"fmt"
	"net"

	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// frames reads whole frames, and the descriptors that ride with them, from one end of
// a keeper connection, through kvwire's Reader: a frame whose type carries one
// ([CarriesFD]) takes it, and every other descriptor is closed. frames is not safe
// for concurrent use.
type frames struct {
	nc *net.UnixConn
	rd *kvwire.Reader
}

func newFrames(nc *net.UnixConn, rd *kvwire.Reader) *frames { return &frames{nc: nc, rd: rd} }

// next returns the next frame, waiting for it or not (session.ErrNoFrame), its payload
// (aliasing the Reader's buffer until the next call) and, for a type that carries
// one, its descriptor, which the caller then owns. A frame of such a type without a
// descriptor, a message of more than one, or a layout the Reader refuses, fails with
// an error wrapping [ErrMalformed].
func (f *frames) next(wait bool) (Header, []byte, int, error) {
	kh, p, err := f.rd.NextWait(f.nc, wait)
	if err != nil {
		return Header{}, nil, -1, err
	}
	h := Header{Type: Type(kh.Type), Flags: kh.Flags, ID: kh.ID}
	fd := f.rd.TakeFD()
	switch {
	case !CarriesFD(h.Type):
		closeFD(fd)
		return h, p, -1, nil
	case fd < 0:
		return Header{}, nil, -1, fmt.Errorf("%w: a %s without its descriptor", ErrMalformed, h.Type)
	}
	return h, p, fd, nil
}

// close closes every descriptor received and not taken.
func (f *frames) close() { f.rd.Close() }
