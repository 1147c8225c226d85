package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"text/tabwriter"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/internal/privdir"
)

// LaunchCommand is examples/kvshare. Called with "producer" or "consumer" first, it is
// that role (ProducerCommand, ConsumerCommand); otherwise it starts one producer and N
// consumers as processes of this same executable, waits for the consumers, stops the
// producer with an interrupt, and prints a summary table. It succeeds when every consumer
// read the whole cache correctly and the producer shut down cleanly.
func LaunchCommand(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) > 0 {
		switch args[0] {
		case "producer":
			return ProducerCommand(ctx, args[1:], stdin, stdout, stderr)
		case "consumer":
			return ConsumerCommand(ctx, args[1:], stdin, stdout, stderr)
		}
	}
	const role = "kvshare"
	fs := flag.NewFlagSet(role, flag.ContinueOnError)
	var consumers, reps int
	countVar(fs, &consumers, "consumers", 0, "`N` consumer processes (default: one per visible device, at least 2)")
	prefer := fs.String("runtime", choose.Auto, "auto (GPU if there is one, else the software device), gpu or test")
	countVar(fs, &reps, "reps", 3, "`N`: how many times each consumer times each copy (the best counts)")
	shapeFlags := ShapeFlags(fs)
	if !parse(fs, args, stderr) {
		return 2
	}
	picked, err := choose.Runtime(*prefer)
	rt, onGPU, why := picked.Runtime, picked.OnGPU, picked.Why
	if err != nil {
		return fail(role, stderr, err)
	}
	devices, err := rt.DeviceCount()
	if err != nil {
		return fail(role, stderr, err)
	}
	l := launch{
		shape: shapeFlags.Resolve(onGPU), devices: devices, consumers: consumers, reps: reps,
		runtime: choose.Software, onGPU: onGPU, stdout: stdout, stderr: stderr,
	}
	if onGPU {
		l.runtime = choose.GPU
	}
	if l.consumers == 0 {
		l.consumers = max(2, devices)
	}
	if err := l.shape.Validate(); err != nil {
		return fail(role, stderr, err)
	}
	fmt.Fprintf(stdout, "%s: %s\n", role, why)
	size := cacheSentence(*shapeFlags, onGPU)
	fmt.Fprintf(stdout, "%s: one producer on device 0 computes %s once; %s instead\n", role, size, plural(l.consumers, "consumer maps it", "consumers map it"))
	switch err := l.run(ctx); {
	case errors.Is(err, errInterrupted):
		fmt.Fprintf(stdout, "%s: interrupted; the producer and the consumers stopped and released what they held\n", role)
		return ExitInterrupted
	case err != nil:
		return fail(role, stderr, err)
	}
	return 0
}

// cacheSentence says how big the cache of flags is on this runtime, and on the software
// device what a GPU gets with the same flags, where that differs.
func cacheSentence(flags Shape, onGPU bool) string {
	size := "a " + humanize.IBytes(flags.Resolve(onGPU).Bytes()) + " KV cache"
	if gpu := flags.Resolve(true); !onGPU && gpu != flags.Resolve(false) {
		size += " (small for the software device; a GPU gets " + humanize.IBytes(gpu.Bytes()) + ")"
	}
	return size
}

// plural is one or many, with n in front.
func plural(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return strconv.Itoa(n) + " " + many
}

// launch is one run of the main job.
type launch struct {
	shape     Shape
	devices   int
	consumers int
	reps      int
	runtime   string // what the children are told, so that all of them agree with the launcher
	onGPU     bool
	stdout    io.Writer
	stderr    io.Writer
}

// outcome is what one consumer process did.
type outcome struct {
	device int
	res    Result
	err    error
}

func (l *launch) run(ctx context.Context) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	// The socket goes in the private announce directory, which the producer removes it
	// from when it stops, so that even a killed launcher leaves nothing behind.
	dir := discover.DefaultDir()
	if err := privdir.Ensure(dir); err != nil {
		return err
	}
	socket := filepath.Join(dir, fmt.Sprintf("kvshare-%d.sock", os.Getpid()))
	base := []string{"-json", "-runtime", l.runtime, "-socket", socket, "-name", DefaultName}

	producerArgs := append([]string{"producer"}, base...)
	producerArgs = append(producerArgs, "-device", "0",
		"-layers", strconv.Itoa(l.shape.Layers), "-tokens", strconv.Itoa(l.shape.Tokens),
		"-heads", strconv.Itoa(l.shape.Heads), "-head-dim", strconv.Itoa(l.shape.HeadDim))
	producer := newChild(ctx, exe, producerArgs)
	out, err := producer.StdoutPipe()
	if err != nil {
		return err
	}
	if err := producer.Start(); err != nil {
		return err
	}
	var pub Published
	if err := readJSONLine(out, &pub); err != nil {
		// The producer ended before publishing: wait says why.
		if werr := producer.wait(); werr != nil {
			return werr
		}
		return fmt.Errorf("the producer did not publish: %w", err)
	}
	testHookPublished()

	outcomes := make([]outcome, l.consumers)
	var wg sync.WaitGroup
	for i := range outcomes {
		o := &outcomes[i]
		o.device = i % l.devices
		args := append([]string{"consumer"}, base...)
		args = append(args, "-device", strconv.Itoa(o.device), "-reps", strconv.Itoa(l.reps))
		wg.Go(func() { o.res, o.err = runConsumer(ctx, exe, args) })
	}
	wg.Wait()

	// The producer's clean shutdown is part of the job: Ctrl-C is how it is stopped.
	stopErr := errors.Join(producer.interrupt(), producer.wait())
	if stopErr != nil {
		stopErr = fmt.Errorf("the producer did not stop cleanly: %w", stopErr)
	}
	if ctx.Err() != nil {
		return l.interrupted(outcomes, stopErr)
	}
	failed := l.summarise(pub, outcomes)
	if failed > 0 {
		return errors.Join(fmt.Errorf("%d of %s failed", failed, plural(len(outcomes), "consumer", "consumers")), stopErr)
	}
	if stopErr != nil {
		return stopErr
	}
	fmt.Fprintf(l.stdout, "kvshare: %s read the producer's %s and checked every byte; the producer stopped cleanly\n",
		plural(len(outcomes), "consumer", "consumers"), humanize.IBytes(pub.Size))
	return nil
}

// interrupted is the end of a run cut short by Ctrl-C: errInterrupted if every process
// stopped cleanly, else what went wrong.
func (l *launch) interrupted(outcomes []outcome, stopErr error) error {
	errs := []error{stopErr}
	for i, o := range outcomes {
		if o.err != nil && !errors.Is(o.err, errInterrupted) {
			errs = append(errs, fmt.Errorf("consumer %d: %w", i+1, o.err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return errInterrupted
}

// summarise prints the table, and below it why each failed consumer failed; it returns
// how many failed.
func (l *launch) summarise(pub Published, outcomes []outcome) (failed int) {
	tw := tabwriter.NewWriter(l.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CONSUMER\tPID\tDEVICE\tREADS FROM\tIMPORT READ\tLOCAL COPY\tRATIO\tCHECKSUM")
	var why []string
	for i, o := range outcomes {
		from := "same device"
		if o.device != pub.Device {
			from = fmt.Sprintf("device %d (peer)", pub.Device)
		}
		if o.err == nil && o.res.Checksum != pub.Checksum {
			o.err = fmt.Errorf("checksum %s, the producer's is %s", o.res.Checksum, pub.Checksum)
		}
		if o.err != nil {
			failed++
			fmt.Fprintf(tw, "%d\t-\t%d\t%s\tFAILED\n", i+1, o.device, from)
			why = append(why, fmt.Sprintf("consumer %d: %v", i+1, o.err))
			continue
		}
		fmt.Fprintf(tw, "%d\t%d\t%d\t%s\t%.1f GB/s\t%.1f GB/s\t%.2f\t%s ok\n", i+1, o.res.PID, o.device, from,
			o.res.ImportGBps(), o.res.LocalGBps(), o.res.ImportGBps()/o.res.LocalGBps(), o.res.Checksum)
	}
	_ = tw.Flush() // output to the terminal: nowhere else to report its failure
	if !l.onGPU {
		fmt.Fprintln(l.stdout, "kvshare: IMPORT READ, LOCAL COPY and RATIO are not meaningful on the software device: its device memory is host memory, copied by the CPU")
	}
	for _, w := range why {
		fmt.Fprintln(l.stdout, w)
	}
	return failed
}

// testHookPublished is called once the producer has published: tests interrupt there.
var testHookPublished = func() {}

// errInterrupted means a process stopped cleanly on Ctrl-C before it finished its work.
var errInterrupted = errors.New("interrupted")

// child is a process of this executable in one role. Its stderr is kept and shown only
// when it fails: a working child's output is the launcher's summary.
type child struct {
	*exec.Cmd
	errOut    bytes.Buffer
	interrupt func() error // sends one interrupt, however often it is called
}

// newChild prepares exe with args. When ctx ends the child gets one interrupt, as from
// Ctrl-C, and is killed only if it has not exited shutdownTimeout later. It runs in a
// process group of its own, so that a Ctrl-C at the terminal reaches the launcher alone
// and each child gets exactly one interrupt (a second one would stop it at once); if the
// launcher dies, the kernel sends it SIGTERM, so no producer outlives its launcher.
func newChild(ctx context.Context, exe string, args []string) *child {
	c := &child{Cmd: exec.CommandContext(ctx, exe, args...)}
	c.interrupt = sync.OnceValue(func() error { return c.Process.Signal(os.Interrupt) })
	c.Cancel = c.interrupt
	c.WaitDelay = shutdownTimeout
	c.Stderr = &c.errOut
	c.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	return c
}

// wait waits for the child: nil when it succeeded, errInterrupted when it stopped
// cleanly on an interrupt before finishing, else an error carrying its stderr.
func (c *child) wait() error {
	err := c.Wait()
	switch {
	case c.ProcessState != nil && c.ProcessState.Success():
		return nil // also after an interrupt: the producer's normal stop
	case c.ProcessState != nil && c.ProcessState.ExitCode() == ExitInterrupted:
		return errInterrupted
	}
	return fmt.Errorf("%s %s: %w\n%s", filepath.Base(c.Path), c.Args[1], err, bytes.TrimSpace(c.errOut.Bytes()))
}

func runConsumer(ctx context.Context, exe string, args []string) (Result, error) {
	c := newChild(ctx, exe, args)
	var out bytes.Buffer
	c.Stdout = &out
	if err := c.Start(); err != nil {
		if ctx.Err() != nil {
			return Result{}, errInterrupted // never started, so it holds nothing
		}
		return Result{}, err
	}
	if err := c.wait(); err != nil {
		return Result{}, err
	}
	var res Result
	if err := readJSONLine(&out, &res); err != nil {
		return Result{}, fmt.Errorf("consumer's result: %w", err)
	}
	return res, nil
}

// readJSONLine decodes the first line of r into v; it fails at the end of r.
func readJSONLine(r io.Reader, v any) error {
	line, err := bufio.NewReader(r).ReadBytes('\n')
	if err != nil {
		if errors.Is(err, io.EOF) {
			return io.ErrUnexpectedEOF
		}
		return err
	}
	return json.Unmarshal(line, v)
}
