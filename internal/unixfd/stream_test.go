package unixfd

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// inode names the file behind fd.
func inode(t *testing.T, fd int) uint64 {
	var st unix.Stat_t
	require.NoError(t, unix.Fstat(fd, &st))
	return st.Ino
}

// A Stream read in pieces smaller than its messages gives each descriptor to the
// bytes it came with: Take of the second message's range gets the second's, closing
// the first's, and Drop closes what is left.
func TestStreamTakesEachDescriptorWithItsBytes(t *testing.T) {
	a, b := pair(t)
	_, w1 := pipeFD(t)
	_, w2 := pipeFD(t)
	require.NoError(t, Send(a, []byte("first-"), int(w1.Fd())))
	require.NoError(t, Send(a, []byte("second"), int(w2.Fd())))
	s := NewStream(b)
	before := openFDs(t)
	var got []byte
	buf := make([]byte, 4)
	for len(got) < 12 {
		n, err := s.Read(buf)
		require.NoError(t, err)
		got = append(got, buf[:n]...)
	}
	assert.Equal(t, "first-second", string(got))
	assert.Equal(t, int64(12), s.Offset())
	assert.Equal(t, before+2, openFDs(t), "both descriptors arrived")
	fd, ok := s.Take(6, 12)
	require.True(t, ok)
	assert.Equal(t, inode(t, int(w2.Fd())), inode(t, fd), "the second message's descriptor")
	require.NoError(t, unix.Close(fd))
	assert.Equal(t, before, openFDs(t), "Take closed the first message's descriptor")
	_, ok = s.Take(6, 12)
	assert.False(t, ok, "taken once")
	s.Drop(s.Offset())
}

// A message of more than one descriptor fails its read, its bytes dropped and its
// descriptors closed.
func TestStreamRefusesTwoDescriptors(t *testing.T) {
	a, b := pair(t)
	_, w1 := pipeFD(t)
	_, w2 := pipeFD(t)
	require.NoError(t, Send(a, []byte("x"), int(w1.Fd()), int(w2.Fd())))
	before := openFDs(t)
	s := NewStream(b)
	n, err := s.Read(make([]byte, 4))
	require.ErrorIs(t, err, ErrUnexpectedFDs)
	assert.Zero(t, n)
	assert.Zero(t, s.Offset())
	assert.Equal(t, before, openFDs(t))
}
