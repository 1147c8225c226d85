package producer_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	_ "github.com/cudapool/cudapool/cudart/choose/softdevice" // the tests run on the software device
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/pool"
)

// The README's "Using it" snippet, statement for statement, with a temporary socket, a
// small buffer and the software device. The consumer starts first, as a replica may:
// it waits for the exporter and the name. On a GPU host each side would be a process.
func Example_readme() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // bounds every wait
	defer cancel()
	dir, err := os.MkdirTemp("", "export-readme")
	check(err)
	defer os.RemoveAll(dir)
	socket := filepath.Join(dir, "kv.sock")

	consumed := make(chan error, 1)
	go func() {
		other := cudarttest.New() // the other process's runtime
		defer other.Close()
		consumed <- readmeConsumer(ctx, socket, other)
	}()

	picked, err := choose.Runtime(choose.Software)
	check(err)
	rt := picked.Runtime
	defer rt.(*cudarttest.Device).Close()
	stream, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	check(err)
	p, err := pool.New(rt, 0, pool.WithName("kv"))
	check(err)
	buf, err := p.Alloc(ctx, 1<<20, stream)
	check(err)
	check(rt.MemsetAsync(0, buf.Ptr(), 7, buf.Size(), stream)) // fill buf on stream
	ex, err := producer.Listen(socket, rt, producer.WithoutAnnounce())
	check(err)
	err = ex.Publish(ctx, "system-prompt", buf, stream)
	check(err)
	check(<-consumed) // consumers open it
	err = buf.Free(stream)
	check(err)
	err = ex.Close(ctx)
	check(err)
	_, err = p.Close(ctx)
	check(err)
	fmt.Println("violations:", choose.Violations(rt))
	// Output:
	// consumer read [7 7 7 7] from system-prompt
	// violations: <nil>
}

func readmeConsumer(ctx context.Context, socket string, rt cudart.Runtime) error {
	s1, err := rt.StreamCreate(1, cudart.StreamNonBlocking)
	if err != nil {
		return err
	}
	imp, err := consumer.Dial(ctx, socket, rt, 1, consumer.WaitForExporter())
	if err != nil {
		return err
	}
	m, err := imp.Open(ctx, "system-prompt", s1, consumer.WaitForName())
	if err != nil {
		return err
	}
	head := make([]byte, 4) // read m.Ptr() on s1
	if err := rt.MemcpyDtoHAsync(1, head, m.Ptr(), s1); err != nil {
		return err
	}
	if err := rt.StreamSynchronize(1, s1); err != nil {
		return err
	}
	fmt.Println("consumer read", head, "from", m.Name())
	err = m.Release(ctx, s1)
	if err != nil {
		return err
	}
	err = imp.Close(ctx)
	return err
}

// readmeInExample maps what the README shows to what Example_readme runs in its place.
var readmeInExample = strings.NewReplacer(
	"choose.Auto", "choose.Software", // the example's output must not depend on the host
	`producer.Listen("/run/app/kv.sock", rt)`, "producer.Listen(socket, rt, producer.WithoutAnnounce())", // leaves the user's announce directory alone
	`"/run/app/kv.sock"`, "socket", // a temporary directory
	"1<<30", "1<<20", // the software device's memory is host memory
)

// Every statement of the README's "Using it" snippet is in Example_readme or its
// consumer, so that the snippet compiles, runs and says what it does.
func TestReadmeSnippetIsExample(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	block := regexp.MustCompile("(?s)\n## Using it[^\n]*\n.*?```go\n(.*?)```").FindSubmatch(readme) // the first Go block of that section
	require.NotNil(t, block, "README.md has no Go block under \"## Using it\"")
	example, err := os.ReadFile("readme_test.go")
	require.NoError(t, err)
	statements := 0
	for _, line := range strings.Split(string(block[1]), "\n") {
		code, _, _ := strings.Cut(line, "//")
		code = strings.TrimSpace(code)
		if code == "" {
			continue
		}
		statements++
		assert.True(t, strings.Contains(string(example), readmeInExample.Replace(code)), "README statement %q is not in Example_readme", code)
	}
	assert.Greater(t, statements, 10, "the snippet's statements")
}
