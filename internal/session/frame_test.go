package session

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/unixfd"
)

var (
	errTestEnded   = errors.New("ended inside a frame")
	errTestRefused = errors.New("refused descriptors")
)

// testFraming: a u32 length, header included, then the bytes.
var testFraming = Framing{
	HeaderLen: 4,
	Len: func(h []byte, max int) (int, error) {
		n := int(binary.LittleEndian.Uint32(h))
		if n < 4 || n > max {
			return 0, fmt.Errorf("a frame of %d bytes", n)
		}
		return n, nil
	},
	Ended:   func([]byte, int) error { return errTestEnded },
	Refused: func(err error) error { return fmt.Errorf("%w: %w", errTestRefused, err) },
}

func testFrame(body string) []byte {
	return append(binary.LittleEndian.AppendUint32(nil, uint32(4+len(body))), body...)
}

func socketPair(t *testing.T) (a, b *net.UnixConn) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "pair")
		defer f.Close()
		nc, err := net.FileConn(f)
		require.NoError(t, err)
		t.Cleanup(func() { nc.Close() })
		return nc.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

// Each descriptor goes to the frame it was sent with, whatever the reads; one not
// taken is closed.
func TestFrameReaderGivesEachFrameItsDescriptor(t *testing.T) {
	a, b := socketPair(t)
	r := NewFrameReader(testFraming, 64, 1)
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(fd)
	_, err = a.Write(testFrame("first"))
	require.NoError(t, err)
	require.NoError(t, unixfd.Send(a, testFrame("second"), fd))
	require.NoError(t, unixfd.Send(a, testFrame("third"), fd))
	_, err = a.Write(testFrame("fourth"))
	require.NoError(t, err)
	want := []struct {
		body   string
		withFD bool
	}{{"first", false}, {"second", true}, {"third", true}, {"fourth", false}}
	for i, w := range want {
		f, err := r.Next(b, true)
		require.NoError(t, err)
		assert.Equal(t, w.body, string(f[4:]))
		if i == 2 {
			continue // its descriptor is not taken: the next Next closes it
		}
		got := r.TakeFD()
		assert.Equal(t, w.withFD, got >= 0, "frame %q's descriptor", w.body)
		if got >= 0 {
			require.NoError(t, unix.Close(got))
		}
	}
	r.Close()
}

// A frame that came with descriptors where none are taken fails; a stream that ends
// inside a frame fails with the framing's error, one that ends between frames with
// io.EOF.
func TestFrameReaderRefusesAndEnds(t *testing.T) {
	a, b := socketPair(t)
	r := NewFrameReader(testFraming, 64, 0)
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(fd)
	require.NoError(t, unixfd.Send(a, testFrame("x"), fd))
	_, err = r.Next(b, true)
	require.ErrorIs(t, err, errTestRefused)

	a, b = socketPair(t)
	r = NewFrameReader(testFraming, 64, 0)
	_, err = r.Next(b, false)
	require.ErrorIs(t, err, ErrNoFrame, "nothing has arrived")
	_, err = a.Write(append(testFrame("whole"), testFrame("cut")[:5]...))
	require.NoError(t, err)
	require.NoError(t, a.CloseWrite())
	f, err := r.Next(b, true)
	require.NoError(t, err)
	assert.Equal(t, "whole", string(f[4:]))
	_, err = r.Next(b, true)
	require.ErrorIs(t, err, errTestEnded)

	a, b = socketPair(t)
	r = NewFrameReader(testFraming, 64, 0)
	_, err = a.Write(testFrame("last"))
	require.NoError(t, err)
	require.NoError(t, a.CloseWrite())
	_, err = r.Next(b, true)
	require.NoError(t, err)
	_, err = r.Next(b, true)
	require.ErrorIs(t, err, io.EOF)
}
