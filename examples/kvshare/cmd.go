package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	_ "github.com/cudapool/cudapool/cudart/choose/softdevice" // the software device, for -runtime test and where there is no GPU
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/internal/privdir"
)

// Command is one of this example's commands, given its arguments and standard streams.
// It returns the process's exit status: 0 success, 1 failure, 2 bad usage,
// ExitInterrupted when Ctrl-C stopped it before its work was done.
type Command func(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int

// Main runs cmd as this process, with the process's arguments, and exits with its status.
func Main(cmd Command) { os.Exit(Run(cmd, os.Args[1:])) }

// Run runs cmd with args and the process's standard streams. Its context ends at the
// first SIGINT or SIGTERM, so Ctrl-C shuts down cleanly; after that the signals act as
// usual again, so a second Ctrl-C stops the process at once.
func Run(cmd Command, args []string) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	context.AfterFunc(ctx, stop)
	return cmd(ctx, args, os.Stdin, os.Stdout, os.Stderr)
}

// ExitInterrupted is the status of a command that Ctrl-C stopped before its work was
// done, after it released everything it held (128 + SIGINT, as a shell reports it).
const ExitInterrupted = 130

// common is what the producer and the consumer are both told.
type common struct {
	socket, name, runtime string
	device                int
	seed                  uint64
	json                  bool
}

// DefaultName is the name the producer publishes the cache under.
const DefaultName = "kv-cache"

func (c *common) register(fs *flag.FlagSet) {
	fs.StringVar(&c.socket, "socket", "", "the exporter's Unix socket (default: kv.sock in the announce directory)")
	fs.StringVar(&c.name, "name", DefaultName, "the name the cache is published under")
	fs.StringVar(&c.runtime, "runtime", choose.Auto, "auto (GPU if there is one, else the software device), gpu or test")
	fs.IntVar(&c.device, "device", 0, "the device this process works on")
	fs.Uint64Var(&c.seed, "seed", 1, "selects the pattern the cache is filled with; consumers must use the producer's")
	fs.BoolVar(&c.json, "json", false, "print one JSON line for programs (the launcher) instead of sentences")
}

// setup selects the runtime and fills in the defaults that depend on it. It prints the
// runtime sentence first (to stderr when stdout carries JSON).
func (c *common) setup(role string, stdout, stderr io.Writer) (rt cudart.Runtime, onGPU bool, err error) {
	if c.socket == "" {
		if c.socket, err = DefaultSocket(); err != nil {
			return nil, false, err
		}
	}
	picked, err := choose.Runtime(c.runtime)
	rt, onGPU, why := picked.Runtime, picked.OnGPU, picked.Why
	if err != nil {
		return nil, false, err
	}
	fmt.Fprintf(c.say(stdout, stderr), "%s: %s\n", role, why)
	return rt, onGPU, nil
}

// say is where sentences for people go: stdout, unless it carries JSON for a program.
func (c *common) say(stdout, stderr io.Writer) io.Writer {
	if c.json {
		return stderr
	}
	return stdout
}

// parse parses args into fs; for a bad command line it has already printed why, and the
// command exits with status 2.
func parse(fs *flag.FlagSet, args []string, stderr io.Writer) bool {
	fs.SetOutput(stderr)
	if err := fs.Parse(args); err != nil {
		return false
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "%s: unexpected arguments %q\n", fs.Name(), fs.Args())
		fs.Usage()
		return false
	}
	return true
}

// fail reports err for role and returns the failure status.
func fail(role string, stderr io.Writer, err error) int {
	fmt.Fprintf(stderr, "%s: %v\n", role, err)
	return 1
}

// finish ends a command that ran on rt: err, or a violation of the CUDA rules that the
// software device saw, makes it a failure. An interrupted command says so, and that it
// released what it held (it did, or err says what it could not).
func finish(ctx context.Context, role string, rt cudart.Runtime, stderr io.Writer, err error) int {
	interrupted := errors.Is(err, context.Canceled) && ctx.Err() != nil
	if interrupted {
		err = nil
	}
	if err = errors.Join(err, choose.Violations(rt)); err != nil {
		return fail(role, stderr, err)
	}
	if interrupted {
		fmt.Fprintf(stderr, "%s: interrupted; released everything it held\n", role)
		return ExitInterrupted
	}
	return 0
}

// ShapeFlags registers the cache's dimensions on fs. A dimension left at 0 takes its
// value from GPUShape or TestShape, whichever fits the runtime: see Resolve.
func ShapeFlags(fs *flag.FlagSet) *Shape {
	var s Shape
	countVar(fs, &s.Layers, "layers", 0, "`N` model layers (default 32)")
	countVar(fs, &s.Tokens, "tokens", 0, "`N` tokens in the shared prompt (default 32768 on a GPU, 512 on the software device)")
	countVar(fs, &s.Heads, "heads", 0, "`N` KV heads (default 8)")
	countVar(fs, &s.HeadDim, "head-dim", 0, "`N` elements per head (default 128)")
	return &s
}

// countVar defines an int flag that, when given, must be positive: 0 is as wrong as -5.
// Left out, it keeps def (0 where the default depends on the runtime, as its usage
// says).
func countVar(fs *flag.FlagSet, p *int, name string, def int, usage string) {
	*p = def
	fs.Var(count{p}, name, usage)
}

// count is countVar's flag.Value.
type count struct{ n *int }

func (c count) String() string {
	if c.n == nil {
		return "0"
	}
	return strconv.Itoa(*c.n)
}

func (c count) Set(s string) error {
	n, err := strconv.Atoi(s)
	switch {
	case err != nil:
		return errors.New("not a whole number")
	case n < 1:
		return errors.New("must be positive")
	}
	*c.n = n
	return nil
}

// Resolve fills the dimensions left at 0 from GPUShape on a GPU and TestShape otherwise.
func (s Shape) Resolve(onGPU bool) Shape {
	def := TestShape
	if onGPU {
		def = GPUShape
	}
	for _, d := range []struct{ v, def *int }{
		{&s.Layers, &def.Layers}, {&s.Tokens, &def.Tokens}, {&s.Heads, &def.Heads}, {&s.HeadDim, &def.HeadDim},
	} {
		if *d.v == 0 {
			*d.v = *d.def
		}
	}
	return s
}

// ProducerCommand is examples/producer: it builds the cache, publishes it and serves
// consumers until Ctrl-C.
func ProducerCommand(ctx context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) int {
	const role = "producer"
	fs := flag.NewFlagSet(role, flag.ContinueOnError)
	var c common
	c.register(fs)
	shape := ShapeFlags(fs)
	if !parse(fs, args, stderr) {
		return 2
	}
	rt, onGPU, err := c.setup(role, stdout, stderr)
	if err != nil {
		return fail(role, stderr, err)
	}
	cfg := ProducerConfig{Socket: c.socket, Name: c.name, Device: c.device, Shape: shape.Resolve(onGPU), Seed: c.seed,
		Notify: func(msg string) {
			fmt.Fprintf(c.say(stdout, stderr), "%s: %s; Ctrl-C again stops at once\n", role, msg)
		}}
	err = Produce(ctx, rt, cfg, func(p Published) {
		if c.json {
			_ = json.NewEncoder(stdout).Encode(p) // a reader that misses the line sees the producer fail to publish
			return
		}
		fmt.Fprintf(stdout, "%s: published %q, %s, on device %d at %s (checksum %s)\n",
			role, p.Name, p.Shape, p.Device, p.Socket, p.Checksum)
		fmt.Fprintf(stdout, "%s: serving consumers until Ctrl-C\n", role)
	})
	if err == nil && !c.json {
		fmt.Fprintf(stdout, "%s: stopped; every lease ended and the cache is freed\n", role)
	}
	return finish(ctx, role, rt, stderr, err)
}

// ConsumerCommand is examples/consumer: it opens the cache, checks it from its own
// device, reports how fast it read it, releases it and exits.
func ConsumerCommand(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	const role = "consumer"
	fs := flag.NewFlagSet(role, flag.ContinueOnError)
	var c common
	c.register(fs)
	reps := fs.Int("reps", 3, "how many times each copy is timed (the best counts)")
	hold := fs.Bool("hold", false, "after checking, hold the mapping until Enter, end of input or Ctrl-C (to watch it in poolstat)")
	if !parse(fs, args, stderr) {
		return 2
	}
	rt, _, err := c.setup(role, stdout, stderr)
	if err != nil {
		return fail(role, stderr, err)
	}
	cfg := ConsumerConfig{Socket: c.socket, Name: c.name, Device: c.device, Seed: c.seed, Reps: *reps}
	if *hold {
		cfg.Hold = func(ctx context.Context) error {
			if !c.json {
				fmt.Fprintf(stdout, "%s: holding %q; press Enter to release\n", role, c.name)
			}
			return waitLine(ctx, stdin)
		}
	}
	res, err := Consume(ctx, rt, cfg)
	if err == nil {
		if c.json {
			err = json.NewEncoder(stdout).Encode(res)
		} else {
			fmt.Fprintf(stdout, "%s: device %d read %q (%s) at %.1f GB/s; a local copy runs at %.1f GB/s; checksum %s matches the pattern; released\n",
				role, res.Device, res.Name, humanize.IBytes(res.Size), res.ImportGBps(), res.LocalGBps(), res.Checksum)
		}
	}
	return finish(ctx, role, rt, stderr, err)
}

// waitLine returns when a line or the end arrives on r (nil), or when ctx ends (nil too:
// Ctrl-C is how a person ends a hold, and the release that follows is the normal one).
func waitLine(ctx context.Context, r io.Reader) error {
	line := make(chan error, 1)
	go func() {
		_, err := bufio.NewReader(r).ReadString('\n')
		if errors.Is(err, io.EOF) {
			err = nil
		}
		line <- err
	}()
	select {
	case err := <-line:
		return err
	case <-ctx.Done():
		return nil
	}
}

// DefaultSocket is where a producer listens unless told otherwise: next to the
// announcements, in the private announce directory (created if missing), so that no
// other user can take its place.
func DefaultSocket() (string, error) {
	dir := discover.DefaultDir()
	if err := privdir.Ensure(dir); err != nil {
		return "", err
	}
	return filepath.Join(dir, DefaultName+".sock"), nil
}
