package producer

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/discover"
)

// Each option satisfies exactly the option type of the side it configures, so that a
// misplaced one (consumer.WithPushes given to Listen) does not compile.
func TestOptionsBelongToTheirSides(t *testing.T) {
	listen, dial, query := reflect.TypeFor[ListenOption](), reflect.TypeFor[consumer.DialOption](), reflect.TypeFor[discover.QueryOption]()
	for _, c := range []struct {
		name                string
		opt                 any
		listen, dial, query bool
	}{
		{"WithPolicy", WithPolicy(Policy{}), true, false, false},
		{"WithAnnounce", WithAnnounce("/x"), true, false, false},
		{"WithoutAnnounce", WithoutAnnounce(), true, false, false},
		{"WithName", WithName("x"), true, false, false},
		{"WithPushes", consumer.WithPushes(0, nil), false, true, false},
		{"WithLogger", WithLogger(nil), true, false, false},
		{"consumer.WithLogger", consumer.WithLogger(nil), false, true, false},
		{"discover.WithLogger", discover.WithLogger(nil), false, false, true},
		{"WithHandshakeTimeout", WithHandshakeTimeout(0), true, false, false},
		{"consumer.WithHandshakeTimeout", consumer.WithHandshakeTimeout(0), false, true, false},
		{"discover.WithHandshakeTimeout", discover.WithHandshakeTimeout(0), false, false, true},
	} {
		typ := reflect.TypeOf(c.opt)
		assert.Equal(t, c.listen, typ.Implements(listen), "%s is a ListenOption", c.name)
		assert.Equal(t, c.dial, typ.Implements(dial), "%s is a DialOption", c.name)
		assert.Equal(t, c.query, typ.Implements(query), "%s is a QueryOption", c.name)
	}
}

// Compile-time: each side has its own logger and handshake bound.
var (
	_ ListenOption         = WithLogger(nil)
	_ consumer.DialOption  = consumer.WithLogger(nil)
	_ discover.QueryOption = discover.WithHandshakeTimeout(0)
)

// An exporter name is what other processes show (its announcement, State): Listen
// refuses one that is not printable UTF-8 of at most MaxExporterNameLen bytes, before
// it makes a socket; the default, the program's name, is made printable instead.
func TestListenRefusesBadExporterNames(t *testing.T) {
	s := newSide(t, 0)
	for _, name := range []string{"kv\nLIVE: forged", "\x1b]0;title\x07", "kv\xff", "kv\u202egnp.exe", strings.Repeat("n", MaxExporterNameLen+1), ""} {
		path := filepath.Join(shortDir(t), "x.sock")
		ex, err := Listen(path, s.dev, WithoutAnnounce(), WithName(name))
		if ex != nil {
			ex.Close(ended())
		}
		require.ErrorIs(t, err, ErrBadName, "Listen WithName(%q)", name)
		assert.NotContains(t, err.Error(), "\x1b", "the error prints the name raw")
		assert.NoFileExists(t, path, "a refused Listen made its socket")
	}

	arg0 := os.Args[0]
	t.Cleanup(func() { os.Args[0] = arg0 })
	os.Args[0] = "/bin/\x1b[2Jprog\n"
	dir := shortDir(t)
	ex, err := Listen(filepath.Join(dir, "x.sock"), s.dev, WithAnnounce(dir))
	require.NoError(t, err, "Listen with the default name of an odd program name")
	defer ex.Close(ended())
	anns, err := discover.Discover(dir)
	require.NoError(t, err)
	require.Len(t, anns, 1)
	assert.Equal(t, "?[2Jprog?", anns[0].Name, "the announced default name")
}
