package producer_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
)

// Compile-time: each side has its own logger and handshake bound.
var (
	_ producer.ListenOption = producer.WithLogger(nil)
	_ consumer.DialOption   = consumer.WithLogger(nil)
	_ discover.QueryOption  = discover.WithHandshakeTimeout(0)
)

// An exporter name is what other processes show (its announcement, State): Listen
// refuses one that is not printable UTF-8 of at most MaxExporterNameLen bytes, before
// it makes a socket; the default, the program's name, is made printable instead.
func TestListenRefusesBadExporterNames(t *testing.T) {
	s := exporttest.NewSide(t, 0)
	for _, name := range []string{"kv\nLIVE: forged", "\x1b]0;title\x07", "kv\xff", "kv\u202egnp.exe", strings.Repeat("n", producer.MaxExporterNameLen+1), ""} {
		path := filepath.Join(exporttest.ShortDir(t), "x.sock")
		ex, err := producer.Listen(path, s.Dev, producer.WithoutAnnounce(), producer.WithName(name))
		if ex != nil {
			ex.Close(exporttest.Ended())
		}
		require.ErrorIs(t, err, export.ErrBadName, "Listen WithName(%q)", name)
		assert.NotContains(t, err.Error(), "\x1b", "the error prints the name raw")
		assert.NoFileExists(t, path, "a refused Listen made its socket")
	}

	arg0 := os.Args[0]
	t.Cleanup(func() { os.Args[0] = arg0 })
	os.Args[0] = "/bin/\x1b[2Jprog\n"
	dir := exporttest.ShortDir(t)
	ex, err := producer.Listen(filepath.Join(dir, "x.sock"), s.Dev, producer.WithAnnounceDir(dir))
	require.NoError(t, err, "Listen with the default name of an odd program name")
	defer ex.Close(exporttest.Ended())
	anns, err := discover.Discover(dir)
	require.NoError(t, err)
	require.Len(t, anns, 1)
	assert.Equal(t, "?[2Jprog?", anns[0].Name, "the announced default name")
}

// A nil option is no option: Listen, Publish, Dial, Open and QueryState ignore it
// rather than crash (an option built conditionally, left nil, is an easy slip).
func TestNilOptionsAreIgnored(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, []producer.ListenOption{nil})
	ctx := exporttest.Ctx(t)
	b, err := pr.Pool.Alloc(ctx, 1<<20, pr.Stream)
	require.NoError(t, err)
	require.NoError(t, pr.Ex.Publish(ctx, "a", b, pr.Stream, nil))
	c := exporttest.NewConsumer(t, pr.Path, 0, nil)
	m, err := c.Imp.Open(ctx, "a", c.Stream, nil)
	require.NoError(t, err)
	require.NoError(t, m.Release(ctx, c.Stream))
	_, err = discover.QueryState(ctx, pr.Path, nil)
	require.NoError(t, err)
}
