// Command kvpoold is the owner of a KV page pool: it keeps a slab of KV pages on each
// GPU it serves and leases them to replica processes (package kv/replica, the C ABI in
// libcudapool, Python's cudapool.kv) until SIGTERM or Ctrl-C.
//
//	kvpoold [-dir DIR] [-devices 0,1] [-runtime auto|gpu|test]
//	        [-layout NAME | -layers L -kv-heads H -head-dim D [-dtype bf16] [-tokens-per-page 16]]
//	        (-pages N | -bytes SIZE) [-initial-bytes SIZE] [-chunk-bytes SIZE] [-handle posix-fd|fabric] [-host-bytes SIZE]
//	        [-min-free SIZE] [-stop-wait 10s] [-reattach-grace 5s] [-keeper-idle 10s] [-leave-keeper | -one-process]
//	kvpoold keeper [the same flags]
//
// A -layout names a whole geometry, and excludes every dimension flag: one given beside
// it, even one that agrees, is refused, naming both. -dtype is one of bf16, fp16, fp32
// and fp8e4m3 (in any case; no other spelling). A SIZE is a number of bytes with an
// optional unit (4096, 512MiB, 100GiB, 1.5TB). kvpoold -h prints the usage.
//
// It serves DIR/kv.sock (the pages, and the slabs' chunks) and prints one line saying
// where and on which runtime. -devices defaults to every GPU, or device 0 on the
// software device. Exactly one of -pages (the page count, at least 1) and -bytes (each
// slab's size, e.g. 100GiB, rounded down to whole pages) says how much it serves at
// most. A slab is on the VMM route (package kv, Layout): one range of addresses per
// layer's K and V, whatever its size, reserved for -bytes, into which chunks of
// -chunk-bytes (a multiple of the device's granularity; by default the smallest that
// makes each tensor at most 8 chunks) are mapped as pages are needed: it starts with
// a chunk per tensor (or the chunks that hold -initial-bytes, rounded down to whole
// pages and up to whole steps; -initial-bytes equal to -bytes maps the whole slab at
// the start) and grows before it evicts. While a device's free memory is below
// -min-free (default 0: never), kvpoold gives the slab's last chunks back, down to a
// chunk per tensor: their pages are evicted (copied to the host tier where it has
// room) or, where leased, waited for, every replica unmaps them, and the slab grows
// again only once a step more than -min-free is free. -handle fabric makes the chunks
// exportable as FABRIC handles too (NVLink multi-node); where the driver refuses them
// (no IMEX channel) kvpoold says so and exits 2. A chunk size off the granularity, or
// a start larger than a device's free memory, is refused at start. A second kvpoold
// on a DIR that a live one serves fails, naming it.
//
// SIGTERM or Ctrl-C stops it: every replica is told at once (its Done closes, Python's
// alive turns False), and kvpoold waits up to -stop-wait (default 10s) for its own
// copies; a replica's mapping keeps a slab's memory until it unmaps it or exits. A
// second signal stops it at once. Exit status:
//
//	0  a clean stop
//	1  a failure (at start, or the runtime reported broken rules at the stop)
//	2  a bad command line: a flag or value kvpoold does not take, flags that exclude
//	   each other, a -runtime this build lacks, a -devices the runtime lacks, a -dir
//	   that is not a directory, a -host-bytes over the host's available memory
//
// A replica that is told of the stop should close (release, unmap): the slab's memory
// goes back to the driver once its last replica unmaps it or exits. (Status 3, "replicas
// still mapped a slab", was the pool route's: a stop no longer waits for them.)
//
// The slabs' chunks are held by a keeper, `kvpoold keeper` (the same flags), which
// kvpoold starts in a session of its own where none serves DIR and gives each chunk's
// descriptor as it makes it, so that they outlive kvpoold: a kvpoold started again on
// DIR takes them back and maps them (chunks of another geometry or chunk size are
// dropped, the slab made anew), makes the pages journaled in DIR/index
// visible again, and waits up to -reattach-grace for the replicas attached before
// (replica.WithReconnect) to re-declare their leases. Its first line says what it took
// back, or why the cache is new. It holds DIR/owner.lock: a second kvpoold on DIR
// fails. A clean stop stops the keeper too, unless -leave-keeper; a keeper nobody (no
// kvpoold, no replica mapping the slab) has been connected to for -keeper-idle exits;
// -one-process makes the slabs in kvpoold itself,
// gone with it. When the keeper dies, kvpoold exits with status 1: the cache is gone,
// and a supervisor should start it again (docs/kvpoold.service runs it under systemd).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/vmm"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	context.AfterFunc(ctx, stop) // a second signal acts as usual: it stops at once
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// defaultStopWait is -stop-wait's default: how long a stop waits for its own copies
// and for the keeper to stop.
const defaultStopWait = 10 * time.Second

// The exit statuses (the command's doc).
const (
	exitOK     = 0
	exitFailed = 1
	exitUsage  = 2
)

// DefaultDir is where kvpoold serves without -dir: kv in export's announce directory.
func DefaultDir() string { return filepath.Join(discover.DefaultDir(), "kv") }

// flags are kvpoold's command line.
type flags struct {
	dir, devices, runtime, layout, dtype, bytes string
	hostBytes, minFree                          string
	layers, kvHeads, headDim, tokensPerPage     int
	pages                                       int
	chunkBytes, handle, initialBytes            string
	set                                         map[string]bool // the flags given
	stopWait                                    time.Duration
	oneProcess, leaveKeeper                     bool
	grace, keeperIdle                           time.Duration
}

// synopsis is the command line's shape, as the command's doc gives it.
const synopsis = `usage: kvpoold [-dir DIR] [-devices 0,1] [-runtime auto|gpu|test]
               [-layout NAME | -layers L -kv-heads H -head-dim D [-dtype bf16] [-tokens-per-page 16]]
               (-pages N | -bytes SIZE) [-initial-bytes SIZE] [-chunk-bytes SIZE] [-handle posix-fd|fabric] [-host-bytes SIZE]
               [-min-free SIZE] [-stop-wait 10s] [-reattach-grace 5s] [-keeper-idle 10s] [-leave-keeper | -one-process]
       kvpoold keeper [the same flags]

Serves a KV page pool: a slab of KV pages on each GPU, leased to replica processes.
A SIZE is a number of bytes with an optional unit: 4096, 512MiB, 100GiB, 1.5TB.
Exit status: 0 a clean stop, 1 a failure, 2 a bad command line.
`

// dtypeSpellings are the -dtype values kvpoold takes (kv.ParseDType's, in any case).
var dtypeSpellings = []string{kv.DTypeBF16.String(), kv.DTypeFP16.String(), kv.DTypeFP32.String(), kv.DTypeFP8E4M3.String()}

// dimensionFlags are the flags a -layout sets; they exclude it.
var dimensionFlags = []string{"layers", "kv-heads", "head-dim", "dtype", "tokens-per-page"}

// newFlagSet is kvpoold's flags, bound to f.
func newFlagSet(f *flags) *flag.FlagSet {
	fs := flag.NewFlagSet("kvpoold", flag.ContinueOnError)
	fs.StringVar(&f.dir, "dir", DefaultDir(), "the directory to serve in (kv.sock)")
	fs.StringVar(&f.devices, "devices", "", "the devices to serve, comma-separated (default: every GPU, or 0 on the software device)")
	fs.StringVar(&f.runtime, "runtime", choose.Auto, "auto (GPU if there is one, else the software device), gpu or test (the software device)")
	fs.StringVar(&f.layout, "layout", "", "a named geometry ("+strings.Join(kv.LayoutNames(), ", ")+"), instead of the dimension flags (-layers, -kv-heads, -head-dim, -dtype, -tokens-per-page), which it excludes")
	fs.IntVar(&f.layers, "layers", 0, "model layers")
	fs.IntVar(&f.kvHeads, "kv-heads", 0, "KV heads")
	fs.IntVar(&f.headDim, "head-dim", 0, "elements per head")
	fs.StringVar(&f.dtype, "dtype", kv.DTypeBF16.String(), "element type, one of "+strings.Join(dtypeSpellings, ", ")+" (these spellings only, in any case)")
	fs.IntVar(&f.tokensPerPage, "tokens-per-page", 16, "tokens per page")
	fs.IntVar(&f.pages, "pages", 0, "pages per slab (or -bytes)")
	fs.StringVar(&f.bytes, "bytes", "", "bytes per slab, e.g. 100GiB, rounded down to whole pages (or -pages)")
	fs.StringVar(&f.initialBytes, "initial-bytes", "", "bytes per slab mapped at the start, rounded down to whole pages (default: a chunk per tensor); the slab grows from there up to -bytes")
	fs.StringVar(&f.chunkBytes, "chunk-bytes", "", "the size of the chunks a slab maps as it grows, a multiple of the device's granularity (default: each tensor in at most 8 chunks)")
	fs.StringVar(&f.handle, "handle", "posix-fd", "posix-fd, or fabric: chunks exportable as FABRIC handles too (needs an IMEX channel)")
	fs.StringVar(&f.minFree, "min-free", "", "give the slab's last chunks back while the device's free memory is below this, e.g. 4GiB (default: never)")
	fs.StringVar(&f.hostBytes, "host-bytes", "", "bytes of pinned host memory per device for a host tier of evicted pages, e.g. 200GiB (default none)")
	fs.DurationVar(&f.stopWait, "stop-wait", defaultStopWait, "how long a stop waits for its own copies and for the keeper to stop")
	fs.BoolVar(&f.oneProcess, "one-process", false, "make the slabs in this process, without a keeper: they die with it, and a restart starts with an empty cache")
	fs.BoolVar(&f.leaveKeeper, "leave-keeper", false, "on a clean stop, leave the keeper (and the cache) alive for the next kvpoold")
	fs.DurationVar(&f.keeperIdle, "keeper-idle", 10*time.Second, "the keeper closes the chunks it holds and exits once nobody (no kvpoold, no replica mapping the slab) has been connected to it for this long")
	fs.DurationVar(&f.grace, "reattach-grace", owner.DefaultReattachGrace, "after a restart, how long allocations wait for the replicas attached before to re-declare their leases")
	return fs
}

// parse reads the command line. It reports false, with the exit status, for -h
// (usage on stdout, status 0) and for a bad command line (why on stderr, status 2).
func parse(args []string, stdout, stderr io.Writer) (flags, int, bool) {
	var f flags
	fs := newFlagSet(&f)
	fs.SetOutput(stderr)
	fs.Usage = func() {} // printed below, to stdout when asked for with -h
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			usage(stdout, fs)
			return f, exitOK, false
		}
		fmt.Fprintln(stderr, "kvpoold -h prints the usage")
		return f, exitUsage, false
	}
	f.set = map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { f.set[fl.Name] = true })
	if f.stopWait < 0 {
		fmt.Fprintf(stderr, "kvpoold: -stop-wait %v is negative\n", f.stopWait)
		return f, exitUsage, false
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvpoold: unexpected arguments %q\n", fs.Args())
		return f, exitUsage, false
	}
	if info, err := os.Stat(f.dir); err == nil && !info.IsDir() {
		fmt.Fprintf(stderr, "kvpoold: -dir %s is not a directory\n", f.dir)
		return f, exitUsage, false
	}
	return f, exitOK, true
}

// usage prints the synopsis and the flags to w.
func usage(w io.Writer, fs *flag.FlagSet) {
	fmt.Fprint(w, synopsis)
	fmt.Fprintln(w)
	fs.SetOutput(w)
	fs.PrintDefaults()
}

// geometry is the geometry the flags describe; pages are left to slabPages.
func (f flags) geometry() (kv.Geometry, error) {
	if f.layout != "" {
		g, err := kv.Layout(f.layout)
		if err != nil {
			return g, err
		}
		for _, name := range dimensionFlags {
			if f.set[name] {
				return kv.Geometry{}, fmt.Errorf("-layout %s and -%s exclude each other: the layout sets every dimension (%d layers x %d kv heads x %d head dim, %s, %d tokens/page); give -layout alone, or -layers, -kv-heads and -head-dim with -dtype and -tokens-per-page",
					f.layout, name, g.Layers, g.KVHeads, g.HeadDim, g.DType, g.TokensPerPage)
			}
		}
		return g, nil
	}
	if f.layers == 0 || f.kvHeads == 0 || f.headDim == 0 {
		return kv.Geometry{}, errors.New("give -layout, or -layers, -kv-heads and -head-dim")
	}
	dt, err := kv.ParseDType(f.dtype)
	if err != nil {
		return kv.Geometry{}, fmt.Errorf("-dtype %q: want one of %s", f.dtype, strings.Join(dtypeSpellings, ", "))
	}
	return kv.Geometry{Layers: f.layers, KVHeads: f.kvHeads, HeadDim: f.headDim, TokensPerPage: f.tokensPerPage, DType: dt}, nil
}

// parseSize reads flag name's value, a SIZE: a number of bytes with an optional unit.
func parseSize(name, value string) (uint64, error) {
	v := strings.TrimSpace(value)
	if strings.HasPrefix(v, "-") {
		return 0, fmt.Errorf("-%s %s: a size cannot be negative", name, value)
	}
	n, err := humanize.ParseBytes(v)
	if err != nil {
		return 0, fmt.Errorf("-%s %q is not a size: want a number of bytes with an optional unit (4096, 512MiB, 100GiB, 1.5TB)", name, value)
	}
	return n, nil
}

// slabPages sets g.Pages from -pages or -bytes, exactly one of which is given.
func (f flags) slabPages(g kv.Geometry) (kv.Geometry, error) {
	switch {
	case f.set["pages"] && f.set["bytes"]:
		return g, errors.New("-pages and -bytes exclude each other")
	case f.set["pages"]:
		if f.pages < 1 {
			return g, fmt.Errorf("-pages %d: a slab needs at least one page", f.pages)
		}
		g.Pages = f.pages
		return g, g.Validate()
	case !f.set["bytes"]:
		return g, errors.New("give -pages or -bytes: how much each slab serves")
	}
	size, err := parseSize("bytes", f.bytes)
	if err != nil {
		return g, err
	}
	g.Pages = 1
	if err := g.Validate(); err != nil {
		return g, err
	}
	per := g.PageSpanBytes()
	if size/per < 1 {
		return g, fmt.Errorf("-bytes %s holds no page of %s", humanize.IBytes(size), humanize.IBytes(per))
	}
	if size/per > 1<<20 {
		return g, fmt.Errorf("-bytes %s is %d pages of %s: more than the %d a slab may have", humanize.IBytes(size), size/per, humanize.IBytes(per), 1<<20)
	}
	g.Pages = int(size / per)
	return g, g.Validate()
}

// chunkSize is -chunk-bytes, 0 when not given (the default).
func (f flags) chunkSize() (uint64, error) {
	if f.chunkBytes == "" {
		return 0, nil
	}
	n, err := parseSize("chunk-bytes", f.chunkBytes)
	if err == nil && n == 0 {
		err = fmt.Errorf("-chunk-bytes %s: want a multiple of the device's granularity, not 0", f.chunkBytes)
	}
	return n, err
}

// initialPages is -initial-bytes in pages of g, 0 when not given (the default).
func (f flags) initialPages(g kv.Geometry) (int, error) {
	if f.initialBytes == "" {
		return 0, nil
	}
	n, err := parseSize("initial-bytes", f.initialBytes)
	if err != nil {
		return 0, err
	}
	if n/g.PageSpanBytes() < 1 {
		return 0, fmt.Errorf("-initial-bytes %s holds no page of %s", humanize.IBytes(n), humanize.IBytes(g.PageSpanBytes()))
	}
	return int(min(n/g.PageSpanBytes(), uint64(g.Pages))), nil
}

// minFreeBytes is -min-free, 0 when not given.
func (f flags) minFreeBytes() (uint64, error) {
	if f.minFree == "" {
		return 0, nil
	}
	return parseSize("min-free", f.minFree)
}

// fabric is -handle: whether chunks are FABRIC too.
func (f flags) fabric() (bool, error) {
	switch f.handle {
	case "posix-fd":
		return false, nil
	case "fabric":
		return true, nil
	}
	return false, fmt.Errorf("-handle %q: want posix-fd or fabric", f.handle)
}

// hostTierBytes is -host-bytes, 0 when not given.
func (f flags) hostTierBytes() (uint64, error) {
	if f.hostBytes == "" {
		return 0, nil
	}
	return parseSize("host-bytes", f.hostBytes)
}

// checkDevices says why devs, -devices, cannot be served by a runtime of n devices.
func checkDevices(devs []int, n int) error {
	for i, d := range devs {
		if d < 0 || d >= n {
			return fmt.Errorf("-devices: device %d: the runtime has %d device(s), 0 to %d", d, n, n-1)
		}
		if slices.Contains(devs[:i], d) {
			return fmt.Errorf("-devices: device %d is listed twice", d)
		}
	}
	return nil
}

// pickRuntime is choose.Runtime; the tests replace it.
var pickRuntime = choose.Runtime

// runtimeRefused says, for the command line, why -runtime name could not be had, and
// with which exit status: an unknown name, or the software device in a kvpoold built
// without it, is a bad command line.
func runtimeRefused(name string, err error) (string, int) {
	switch {
	case errors.Is(err, choose.ErrUnknownPreference):
		return fmt.Sprintf("-runtime %q: want %s, %s or %s", name, choose.Auto, choose.GPU, choose.Software), exitUsage
	case errors.Is(err, choose.ErrNoSoftwareDevice) && name == choose.Software:
		return fmt.Sprintf("-runtime %s: this kvpoold is built without the software device; build one with it (go build -tags cudapool_softdevice ./cmd/kvpoold), or serve GPUs with -runtime %s", choose.Software, choose.GPU), exitUsage
	case errors.Is(err, choose.ErrNoSoftwareDevice):
		why := "no usable GPU"
		if errors.Is(err, cudart.ErrNoRuntime) {
			why = "no CUDA runtime loaded (set " + cudart.LibraryEnv + " to libcudart's path)"
		} else if errors.Is(err, cudart.ErrNoDevice) {
			why = "the CUDA runtime sees no GPU"
		}
		return why + ", and this kvpoold is built without the software device to fall back on (go build -tags cudapool_softdevice ./cmd/kvpoold builds one with it)", exitFailed
	}
	return err.Error(), exitFailed
}

// deviceList parses -devices; "" is every device of n.
func deviceList(s string, n int, onGPU bool) ([]int, error) {
	if s == "" {
		if !onGPU {
			return []int{0}, nil
		}
		all := make([]int, n)
		for i := range all {
			all[i] = i
		}
		return all, nil
	}
	var devs []int
	for _, part := range strings.Split(s, ",") {
		d, err := strconv.Atoi(strings.TrimSpace(part))
		if err != nil {
			return nil, fmt.Errorf("-devices %q: %w", s, err)
		}
		devs = append(devs, d)
	}
	return devs, nil
}

// stop closes o, waiting up to -stop-wait, and, unless -one-process,
// -leave-keeper or the keeper is gone, stops the keeper (the one this kvpoold
// started, child, is waited for). It returns the exit status: exitOK if all went
// well ("kvpoold: stopped" on stdout), else exitFailed, with what went wrong on
// stderr (the software device's violations among it); a gone keeper is exitFailed.
func stop(o *owner.Owner, rt cudart.Runtime, f flags, child *keeperChild, keeperGone bool, stdout, stderr io.Writer) int {
	cctx, cancel := context.WithTimeout(context.Background(), f.stopWait)
	defer cancel()
	closeErr, broken := o.Close(cctx), choose.Violations(rt)
	if !f.oneProcess && !f.leaveKeeper && !keeperGone {
		// The keeper closes the descriptors it holds: their memory goes once the
		// replicas unmap it.
		kctx, kcancel := context.WithTimeout(context.Background(), f.stopWait+keeperStopMargin)
		defer kcancel()
		pid := o.Recovery().KeeperPID
		if err := owner.StopKeeper(kctx, pid); err != nil {
			closeErr = errors.Join(closeErr, err)
		} else if child != nil && child.pid == pid {
			<-child.exited
			if child.status() != exitOK {
				closeErr = errors.Join(closeErr, fmt.Errorf("the keeper (pid %d) stopped: %v", pid, child.err))
			}
		}
	}
	switch {
	case keeperGone:
		return exitFailed
	case closeErr == nil && broken == nil:
		fmt.Fprintln(stdout, "kvpoold: stopped")
		return exitOK
	}
	fmt.Fprintf(stderr, "kvpoold: stopping: %v\n", errors.Join(closeErr, broken))
	return exitFailed
}

// settings is what a command line asks of the owner, checked whole.
type settings struct {
	geo                       kv.Geometry // its Pages the bound a slab grows to
	chunk, hostBytes, minFree uint64      // 0: the owner's defaults
	initial                   int
	fabric                    bool
}

// settings checks the command line whole, before any runtime is touched: the
// geometry and the slab's pages, the chunk size (against the geometry), the initial
// pages, the handle, the host tier, -min-free and the syntax of -devices (their
// range waits for the runtime). It fails with what is wrong with which flag.
func (f flags) settings() (settings, error) {
	var set settings
	g, err := f.geometry()
	if err != nil {
		return set, err
	}
	if set.geo, err = f.slabPages(g); err != nil {
		return set, err
	}
	if set.chunk, err = f.chunkSize(); err != nil {
		return set, err
	}
	if set.initial, err = f.initialPages(set.geo); err != nil {
		return set, err
	}
	if set.chunk > 0 {
		if _, err := set.geo.SlabLayout(set.chunk); err != nil {
			return set, err
		}
	}
	if set.fabric, err = f.fabric(); err != nil {
		return set, err
	}
	if set.hostBytes, err = f.hostTierBytes(); err != nil {
		return set, err
	}
	if set.minFree, err = f.minFreeBytes(); err != nil {
		return set, err
	}
	_, err = deviceList(f.devices, 0, false) // the syntax; the range once the runtime says
	return set, err
}

// listenFailed says on stderr why [owner.Listen] failed, and returns the exit
// status: exitUsage where the command line asks what cannot be served (fabric
// handles without an IMEX channel, -host-bytes, -chunk-bytes), else exitFailed.
func listenFailed(stderr io.Writer, err error) int {
	fmt.Fprintf(stderr, "kvpoold: %v\n", err)
	if errors.Is(err, vmm.ErrFabricNotPermitted) {
		fmt.Fprintln(stderr, "kvpoold: -handle fabric needs an IMEX channel on this host (nvidia-imex running, /dev/nvidia-caps-imex-channels/channel0 granted); -handle posix-fd serves the replicas of this host")
		return exitUsage
	}
	if errors.Is(err, kv.ErrHostMemory) || errors.Is(err, kv.ErrGeometry) {
		return exitUsage // what the command line asks cannot be served: -host-bytes, -chunk-bytes
	}
	return exitFailed
}

// printServing writes the line that says what o serves, on which devices, with
// which tiers, which runtime (why: why it was picked) and which cache.
func printServing(stdout io.Writer, f flags, devs []int, o *owner.Owner, why string) {
	g := o.Geometry()
	tier := "no host tier"
	if h := o.Stats().Devices[0].Host; h != nil {
		tier = fmt.Sprintf("a host tier of %s (%d pages) a device, copies by %s", humanize.IBytes(h.Bytes), h.Pages, h.CopyPath)
	}
	cache := "slabs in this process (-one-process)"
	if !f.oneProcess {
		cache = o.Recovery().String()
	}
	st := o.Stats()
	fmt.Fprintf(stdout, "kvpoold: serving %s on device(s) %v: %v, pages of %s per layer's K or V (a page span of %s, all layers' K and V), %s a slab at most (%v; %s mapped now), %s; %s; %s\n",
		f.dir, devs, g, humanize.IBytes(g.PageBytes()), humanize.IBytes(g.PageSpanBytes()), humanize.IBytes(g.SlabBytes()), o.Layout(), humanize.IBytes(st.Devices[0].MappedBytes), tier, why, cache)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "keeper" {
		return runKeeper(ctx, args[1:], stdout, stderr)
	}
	f, code, ok := parse(args, stdout, stderr)
	if !ok {
		return code
	}
	// The command line first, whole: what is wrong with it is said before any runtime
	// is touched.
	set, err := f.settings()
	if err != nil {
		fmt.Fprintf(stderr, "kvpoold: %v\n", err)
		return exitUsage
	}
	picked, err := pickRuntime(f.runtime)
	if err != nil {
		msg, code := runtimeRefused(f.runtime, err)
		fmt.Fprintf(stderr, "kvpoold: %s\n", msg)
		return code
	}
	rt := picked.Runtime
	n, err := rt.DeviceCount()
	if err != nil {
		fmt.Fprintf(stderr, "kvpoold: %v\n", err)
		return exitFailed
	}
	devs, err := deviceList(f.devices, n, picked.OnGPU)
	if err == nil {
		err = checkDevices(devs, n)
	}
	if err != nil {
		fmt.Fprintf(stderr, "kvpoold: %v\n", err)
		return exitUsage
	}
	logger := slog.New(slog.NewTextHandler(stderr, nil)) // what no call returns: refused and closed connections
	opts := []owner.Option{owner.WithDevices(devs...), owner.WithChunkBytes(set.chunk), owner.WithInitialPages(set.initial), owner.WithHostBytes(set.hostBytes), owner.WithMinFree(set.minFree), owner.WithLogger(logger)}
	if set.fabric {
		opts = append(opts, owner.WithFabric())
	}
	var child *keeperChild // the keeper this kvpoold started, if it did
	if !f.oneProcess {
		opts = append(opts, owner.WithKeeper(startKeeper(stderr, keeperArgs(f), &child)),
			owner.WithIndex(filepath.Join(f.dir, owner.IndexFile)), owner.WithReattachGrace(f.grace))
	}
	o, err := owner.Listen(f.dir, rt, set.geo, opts...)
	if err != nil {
		return listenFailed(stderr, err)
	}
	printServing(stdout, f, devs, o, picked.Why)
	keeperGone := false
	select {
	case <-ctx.Done():
	case <-o.KeeperGone():
		fmt.Fprintf(stderr, "kvpoold: the keeper (pid %d) is gone, and the cache with it; start kvpoold again for a new one\n", o.Recovery().KeeperPID)
		keeperGone = true
	}
	return stop(o, rt, f, child, keeperGone, stdout, stderr)
}
