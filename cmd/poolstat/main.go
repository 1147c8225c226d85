// Command poolstat shows how GPU memory is shared on this host, the way nvidia-smi shows
// how it is used: every cudapool exporter, its pools with the driver's figures, the names
// it publishes, and each consumer process (pid and command name) with the leases it holds.
//
//	poolstat [-json] [-watch INTERVAL] [-keep-dead] [-dir DIR | -socket PATH] [-timeout D]
//	poolstat -kv DIR [-json] [-watch INTERVAL] [-timeout D]
//	poolstat -serve ADDR [-keep-dead] [-dir DIR | -socket PATH] [-kv DIR] [-timeout D]
//	poolstat -version
//
// -kv shows the KV page pool whose owner (cmd/kvpoold) serves DIR: each slab's pages by
// state and its counters, and each replica with the leases it holds; -json prints the
// owner's Stats (kv.Stats) instead. With -serve, the pool's metrics are served beside
// the exporters' (package metrics, cudapool_kv_*).
// Exporters announce themselves in one directory ($CUDAPOOL_DIR, else
// $XDG_RUNTIME_DIR/cudapool, else cudapool-<uid> in the system temp directory); -dir
// looks elsewhere (it must exist) and -socket asks one exporter only, saying what is
// wrong with a path that leads to none. The directory must be private to this user
// (owned by it, writable by nobody else, not a link), as exporters require of it:
// poolstat reads nothing from one that is not, such as a default directory another
// user made first under the temp dir. Each is asked for its state over its own
// socket, under its own admission policy, with a read-only request, at most 16 at once.
// An announced exporter whose process is gone or whose socket refuses connections is
// shown as dead, never as live. poolstat prunes: an announcement whose exporter is dead
// beyond doubt (its socket refuses connections or is gone, and its process is gone or
// its pid now names a later process) is what a killed exporter leaves behind, and
// poolstat removes it and shows it once as removed, which is no failure; -serve exports
// it no more. It never removes a live process's announcement, nor one it cannot read:
// those stay dead, and count as failures. -keep-dead removes nothing, and every dead
// exporter counts as a failure.
//
// -json prints a Report, whose schema is report.schema.json beside this file; with
// -watch it prints one Report per line. -watch redraws every INTERVAL (a duration, or
// a number of seconds) until Ctrl-C. -serve answers Prometheus scrapes at
// http://ADDR/metrics with the figures of every exporter (package metrics names them),
// taking a fresh look at each scrape.
//
// Exit status: 0 when poolstat reached every exporter it lists (dead ones it removed
// count as reached, and so does an empty list), and for -h, -version and a
// -serve ended by Ctrl-C; 1 otherwise; 2 for a bad command line, a -dir that is not a
// directory included.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/discover"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run is poolstat with its arguments and output streams; it returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	flags := flag.NewFlagSet("poolstat", flag.ContinueOnError)
	flags.SetOutput(stderr)
	flags.Usage = func() {} // printed below, to stdout when asked for with -h
	var l looker
	every := interval(0)
	flags.StringVar(&l.dir, "dir", discover.DefaultDir(), "the announce directory to look in")
	flags.StringVar(&l.socket, "socket", "", "ask only the exporter on this Unix socket")
	flags.BoolVar(&l.keepDead, "keep-dead", false, "leave the announcements of exporters that are dead beyond doubt, and count them as failures (by default they are removed)")
	flags.DurationVar(&l.timeout, "timeout", 5*time.Second, "how long to wait for each exporter's answer")
	asJSON := flags.Bool("json", false, "print a JSON report (schema: cmd/poolstat/report.schema.json) instead of the table")
	flags.Var(&every, "watch", "redraw every `INTERVAL` (2s, 500ms, or a number of seconds) until Ctrl-C")
	serveAddr := flags.String("serve", "", "serve Prometheus metrics of every exporter at http://`ADDR`/metrics until Ctrl-C")
	flags.StringVar(&l.kv, "kv", "", "show the KV page pool whose owner (kvpoold) serves `DIR`, instead of the exporters; with -serve, beside them")
	showVersion := flags.Bool("version", false, "print poolstat's version and the protocol and schema versions it speaks")
	if err := flags.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			usage(stdout, flags)
			return 0
		}
		usage(stderr, flags)
		return 2
	}
	explicit := map[string]bool{}
	flags.Visit(func(f *flag.Flag) { explicit[f.Name] = true })
	switch {
	case *showVersion:
		fmt.Fprintln(stdout, version())
		return 0
	case flags.NArg() > 0:
		fmt.Fprintf(stderr, "poolstat: unexpected arguments %q\n", flags.Args())
		return 2
	case l.kv != "" && *serveAddr == "" && (l.socket != "" || l.keepDead):
		fmt.Fprintln(stderr, "poolstat: -kv shows a KV page pool; it cannot be used with -socket or -keep-dead")
		return 2
	case l.socket != "" && l.keepDead:
		fmt.Fprintln(stderr, "poolstat: -keep-dead works on the announce directory; it cannot be used with -socket")
		return 2
	case *serveAddr != "" && (*asJSON || every != 0):
		fmt.Fprintln(stderr, "poolstat: -serve answers each scrape on its own; it cannot be used with -json or -watch")
		return 2
	case every < 0 || l.timeout <= 0:
		fmt.Fprintln(stderr, "poolstat: -watch and -timeout must be positive")
		return 2
	case explicit["dir"] && l.socket == "":
		// The default directory is made by the first exporter: before that, none runs.
		// One named on the command line must be there.
		if err := isDir(l.dir); err != nil {
			fmt.Fprintf(stderr, "poolstat: -dir: %v\n", err)
			return 2
		}
	}
	if abs, err := filepath.Abs(l.socket); l.socket != "" && err == nil {
		l.socket = abs // as exporters announce theirs, and as metrics label it
	}
	if *serveAddr != "" {
		return serve(ctx, &l, *serveAddr, stdout, stderr)
	}
	if l.kv != "" {
		if every > 0 {
			return kvWatch(ctx, l.kv, l.timeout, time.Duration(every), *asJSON, stdout, stderr)
		}
		return kvOnce(ctx, l.kv, l.timeout, *asJSON, true, stdout, stderr)
	}
	show := shower(stdout, *asJSON, time.Duration(every))
	if every == 0 {
		return once(ctx, &l, show, stderr)
	}
	return watch(ctx, &l, time.Duration(every), show, stderr)
}

// shower returns how each report is written to stdout: as JSON (indented if
// once, every == 0, else one line each), or as the table, under a heading with
// the time when watched every so often (redrawn in place on a terminal).
func shower(stdout io.Writer, asJSON bool, every time.Duration) func(*Report) error {
	switch {
	case asJSON:
		return func(r *Report) error { return writeJSON(stdout, r, every == 0) }
	case every > 0:
		clear := isTerminal(stdout)
		return func(r *Report) error {
			if clear {
				fmt.Fprint(stdout, "\x1b[H\x1b[2J") // home and clear: redraw in place
			}
			fmt.Fprintf(stdout, "poolstat at %s, every %v (Ctrl-C stops)\n", r.Time.Format(time.TimeOnly), every)
			return writeTable(stdout, r)
		}
	}
	return func(r *Report) error { return writeTable(stdout, r) }
}

// usage prints the synopsis and the flags.
func usage(w io.Writer, flags *flag.FlagSet) {
	fmt.Fprintln(w, "usage: poolstat [-json] [-watch INTERVAL] [-keep-dead] [-dir DIR | -socket PATH] [-timeout D]")
	fmt.Fprintln(w, "       poolstat -kv DIR [-json] [-watch INTERVAL] [-timeout D]")
	fmt.Fprintln(w, "       poolstat -serve ADDR [-keep-dead] [-dir DIR | -socket PATH] [-kv DIR] [-timeout D]")
	fmt.Fprintln(w, "       poolstat -version")
	fmt.Fprintln(w, "\nShows the cudapool exporters of this host: their pools, published names and peers.")
	flags.SetOutput(w)
	flags.PrintDefaults()
	flags.SetOutput(io.Discard)
}

// interval is -watch's value: a duration ("2s", "500ms") or a bare number of seconds
// ("2", "0.5"), as watch(1) takes it.
type interval time.Duration

func (i *interval) String() string { return time.Duration(*i).String() }

func (i *interval) Set(s string) error {
	if secs, err := strconv.ParseFloat(s, 64); err == nil {
		if math.IsNaN(secs) || math.Abs(secs) > float64(math.MaxInt64/time.Second) {
			return fmt.Errorf("%q is not a number of seconds poolstat can wait", s)
		}
		*i = interval(secs * float64(time.Second))
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("%q is neither a duration (2s, 500ms) nor a number of seconds", s)
	}
	*i = interval(d)
	return nil
}

// version says which poolstat this is, from the build's own record, and the versions
// of what it speaks: the wire protocol and the two JSON schemas.
func version() string {
	v, rev, modified := "(unknown)", "", ""
	if bi, ok := debug.ReadBuildInfo(); ok {
		v = bi.Main.Version
		for _, s := range bi.Settings {
			switch {
			case s.Key == "vcs.revision":
				rev = " " + s.Value
			case s.Key == "vcs.modified" && s.Value == "true":
				modified = " (modified)"
			}
		}
	}
	return fmt.Sprintf("poolstat %s%s%s; protocol %d, report schema %d, state schema %d; %s",
		v, rev, modified, export.ProtocolVersion, ReportSchema, export.StateSchema, runtime.Version())
}

// isDir says why dir cannot be looked in, or nil.
func isDir(dir string) error {
	info, err := os.Stat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%s does not exist", dir)
	case err != nil:
		return err
	case !info.IsDir():
		return fmt.Errorf("%s is not a directory", dir)
	}
	return nil
}

// once takes one report, shows it and returns the exit status. A report cut short by
// Ctrl-C is not shown: its exporters would look unreachable when they were not.
func once(ctx context.Context, l *looker, show func(*Report) error, stderr io.Writer) int {
	r, err := l.look(ctx)
	if ctx.Err() != nil {
		return 1
	}
	if err == nil {
		err = show(r)
	}
	if err != nil {
		fmt.Fprintf(stderr, "poolstat: %s\n", text(err.Error(), maxText))
		return 1
	}
	if !r.reached() {
		return 1
	}
	return 0
}

// watch shows a report every interval until ctx ends, and returns the status of the
// last one shown: Ctrl-C is how a watch ends, not a failure.
func watch(ctx context.Context, l *looker, every time.Duration, show func(*Report) error, stderr io.Writer) int {
	tick := time.NewTicker(every)
	defer tick.Stop()
	code := 1
	for {
		if c := once(ctx, l, show, stderr); ctx.Err() == nil {
			code = c
		}
		select {
		case <-ctx.Done():
			return code
		case <-tick.C:
		}
	}
}

func writeTable(w io.Writer, r *Report) error {
	render(w, r, time.Now())
	return nil
}

// writeJSON writes r indented, or on one line for a stream of reports (-watch).
func writeJSON(w io.Writer, r *Report, indent bool) error {
	enc := json.NewEncoder(w)
	if indent {
		enc.SetIndent("", "  ")
	}
	return enc.Encode(r)
}

// isTerminal reports whether w is a terminal, where a redraw can clear the screen.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
