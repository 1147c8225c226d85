// Command vmmshare shows the VMM route end to end: a producer process makes one
// allocation of several chunks (cuMemCreate), maps them one behind the other into one
// range of its addresses, writes it and publishes it (producer.Exporter.PublishChunks);
// a consumer process opens the name, which maps the same chunks as ONE range of its own
// (the chunks' descriptors passed over the socket), and checks every byte, with one
// copy across each chunk boundary. It starts both as processes of this executable and
// prints what each saw.
//
//	go run ./examples/vmmshare [-runtime auto|gpu|test] [-chunks N] [-chunk-granules G]
//
// Without a GPU it runs on the cudarttest software device and says so in its first
// line. Each chunk is G granules (the device's allocation granularity: 2 MiB on the
// H200).
//
//	vmmshare producer -socket PATH ...   # publishes, says "ready", serves until stdin ends
//	vmmshare consumer -socket PATH ...   # maps, checks, releases
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	_ "github.com/cudapool/cudapool/cudart/choose/softdevice" // the software device, where there is no GPU
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/vmm"
)

// name is what the allocation is published under.
const name = "vmm-slab"

func main() { os.Exit(run(context.Background(), os.Args[1:], os.Stdin, os.Stdout, os.Stderr)) }

// options are what every mode takes.
type options struct {
	runtime, socket  string
	chunks, granules int
}

func (o *options) register(fs *flag.FlagSet) {
	fs.StringVar(&o.runtime, "runtime", choose.Auto, "auto (GPU if there is one, else the software device), gpu or test")
	fs.StringVar(&o.socket, "socket", "", "the exporter's Unix socket (default: one in a fresh directory)")
	fs.IntVar(&o.chunks, "chunks", 4, "the chunks of the allocation")
	fs.IntVar(&o.granules, "chunk-granules", 8, "each chunk's size, in granules of the device")
}

// run runs the mode args name ("producer", "consumer", or the launcher without one)
// and returns the exit status: 0 success, 1 failure, 2 bad usage.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	mode := "launcher"
	if len(args) > 0 && (args[0] == "producer" || args[0] == "consumer") {
		mode, args = args[0], args[1:]
	}
	var o options
	fs := flag.NewFlagSet("vmmshare "+mode, flag.ContinueOnError)
	fs.SetOutput(stderr)
	o.register(fs)
	if err := fs.Parse(args); err != nil || fs.NArg() > 0 || o.chunks < 1 || o.granules < 1 {
		fmt.Fprintln(stderr, "vmmshare: want -chunks and -chunk-granules of at least 1, and no arguments")
		return 2
	}
	var err error
	switch mode {
	case "launcher":
		if err = launch(ctx, o, stdout, stderr); err == nil {
			fmt.Fprintln(stdout, "vmmshare: PASS")
		}
	case "producer", "consumer":
		err = onRuntime(mode, o, stdout, func(rt cudart.Runtime) error {
			if mode == "producer" {
				return produce(ctx, rt, o, stdin, stdout)
			}
			return consume(ctx, rt, o, stdout)
		})
	}
	if err != nil {
		fmt.Fprintf(stderr, "vmmshare %s: %v\n", mode, err)
		return 1
	}
	return 0
}

// onRuntime picks the runtime, says which, runs f on it and adds the software device's
// violations, if any, to its error.
func onRuntime(role string, o options, stdout io.Writer, f func(rt cudart.Runtime) error) error {
	c, err := choose.Runtime(o.runtime)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s: %s\n", role, c.Why)
	err = f(c.Runtime)
	return errors.Join(err, choose.Violations(c.Runtime))
}

// at is the byte the producer writes at offset off of the allocation, and the consumer
// expects there: it changes with the chunk and within it, so that a chunk mapped in the
// wrong place or a range off by any offset shows.
func at(off, chunk uint64) byte { return byte(off/chunk*37 + off%251) }

// pattern is at for the n bytes from off.
func pattern(off uint64, n int, chunk uint64) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = at(off+uint64(i), chunk)
	}
	return b
}

// piece bounds the host buffer each side writes or checks through.
const piece = 8 << 20

// produce makes the allocation, writes it, publishes it, says "ready" and serves until
// stdin ends.
func produce(ctx context.Context, rt cudart.Runtime, o options, stdin io.Reader, stdout io.Writer) (err error) {
	const dev = 0
	g, err := vmm.Granularity(rt, dev, cudart.HandleTypePosixFD)
	if err != nil {
		return err
	}
	size := uint64(o.granules) * g
	s, err := rt.StreamCreate(dev, cudart.StreamNonBlocking)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, rt.StreamDestroy(dev, s)) }()
	res, err := vmm.Reserve(rt, dev, uint64(o.chunks)*size)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, res.Close()) }()
	var chunks []*vmm.Chunk
	defer func() {
		for _, c := range chunks {
			err = errors.Join(err, c.Close())
		}
	}()
	for range o.chunks {
		c, err := vmm.NewChunk(rt, dev, size)
		if err != nil {
			return err
		}
		chunks = append(chunks, c)
		if err := res.Grow(c); err != nil {
			return err
		}
	}
	for off := uint64(0); off < res.Mapped(); off += piece {
		n := min(piece, res.Mapped()-off)
		if err := rt.MemcpyHtoDAsync(dev, res.Ptr()+cudart.DevicePtr(off), pattern(off, int(n), size), s); err != nil {
			return err
		}
		if err := rt.StreamSynchronize(dev, s); err != nil { // the host buffer is reused
			return err
		}
	}
	ex, err := producer.Listen(o.socket, rt, producer.WithoutAnnounce())
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, ex.Close(ctx)) }()
	if err := ex.PublishChunks(ctx, name, chunks, s, producer.WithMeta([]byte(fmt.Sprintf("chunk=%d", size)))); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "producer: published %q: %d chunks of %s, one range of %s at %#x\n", name, o.chunks,
		humanize.IBytes(size), humanize.IBytes(res.Mapped()), uint64(res.Ptr()))
	fmt.Fprintln(stdout, "ready")
	_, _ = io.Copy(io.Discard, stdin) // serve until stdin ends
	return nil
}

// consume opens the allocation, checks every byte and one copy across each chunk
// boundary, and releases it.
func consume(ctx context.Context, rt cudart.Runtime, o options, stdout io.Writer) (err error) {
	const dev = 0
	s, err := rt.StreamCreate(dev, cudart.StreamNonBlocking)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, rt.StreamDestroy(dev, s)) }()
	imp, err := consumer.Dial(ctx, o.socket, rt, dev)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, imp.Close(ctx)) }()
	m, err := imp.Open(ctx, name, s)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, m.Release(ctx, s)) }()
	var chunk uint64
	if _, err := fmt.Sscanf(string(m.Meta()), "chunk=%d", &chunk); err != nil || chunk == 0 {
		return fmt.Errorf("metadata %q: want chunk=SIZE", m.Meta())
	}
	fmt.Fprintf(stdout, "consumer: mapped %q as one range of %s at %#x\n", name, humanize.IBytes(m.Size()), uint64(m.Ptr()))
	read := func(off uint64, n int) error {
		got := make([]byte, n)
		if err := rt.MemcpyDtoHAsync(dev, got, m.Ptr()+cudart.DevicePtr(off), s); err != nil {
			return err
		}
		if err := rt.StreamSynchronize(dev, s); err != nil {
			return err
		}
		for i, b := range got {
			if want := at(off+uint64(i), chunk); b != want {
				return fmt.Errorf("byte at offset %d is %#x, want %#x", off+uint64(i), b, want)
			}
		}
		return nil
	}
	for off := uint64(0); off < m.Size(); off += piece {
		if err := read(off, int(min(piece, m.Size()-off))); err != nil {
			return err
		}
	}
	boundaries := 0
	for b := chunk; b < m.Size(); b += chunk {
		if err := read(b-4096, 8192); err != nil { // one copy, half in each chunk
			return fmt.Errorf("across the boundary at %d: %w", b, err)
		}
		boundaries++
	}
	fmt.Fprintf(stdout, "consumer: every byte as written; one copy across each of %d chunk boundaries\n", boundaries)
	return nil
}

// launch runs a producer process and then a consumer process of this executable, and
// stops the producer once the consumer is done.
func launch(ctx context.Context, o options, stdout, stderr io.Writer) (err error) {
	// The children's output is copied from several goroutines.
	stdout, stderr = &lockedWriter{w: stdout}, &lockedWriter{w: stderr}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	if o.socket == "" {
		dir, err := os.MkdirTemp("", "vmmshare")
		if err != nil {
			return err
		}
		defer func() { err = errors.Join(err, os.RemoveAll(dir)) }()
		o.socket = filepath.Join(dir, "vmm.sock")
	}
	args := []string{"-runtime", o.runtime, "-socket", o.socket, "-chunks", fmt.Sprint(o.chunks), "-chunk-granules", fmt.Sprint(o.granules)}
	prod := exec.CommandContext(ctx, self, append([]string{"producer"}, args...)...)
	prod.Stderr = stderr
	in, err := prod.StdinPipe()
	if err != nil {
		return err
	}
	out, err := prod.StdoutPipe()
	if err != nil {
		return err
	}
	if err := prod.Start(); err != nil {
		return err
	}
	relayed := make(chan struct{}) // closed once the producer's output is all read
	defer func() {
		_ = in.Close() // ends the producer's serving
		<-relayed
		if werr := prod.Wait(); werr != nil {
			err = errors.Join(err, fmt.Errorf("producer: %w", werr))
		}
	}()
	lines := bufio.NewScanner(out)
	ready := false
	for !ready && lines.Scan() {
		fmt.Fprintln(stdout, lines.Text())
		ready = strings.TrimSpace(lines.Text()) == "ready"
	}
	go func() {
		defer close(relayed)
		for lines.Scan() { // the rest of what it says
			fmt.Fprintln(stdout, lines.Text())
		}
	}()
	if !ready {
		return errors.New("the producer ended before it was ready")
	}
	cons := exec.CommandContext(ctx, self, append([]string{"consumer"}, args...)...)
	cons.Stdout, cons.Stderr = stdout, stderr
	if err := cons.Run(); err != nil {
		return fmt.Errorf("consumer: %w", err)
	}
	return nil
}

// lockedWriter is w for writers on several goroutines, one write at a time.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
