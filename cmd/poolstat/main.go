// Command poolstat shows how GPU memory is shared on this host, the way nvidia-smi shows
// how it is used: every cudapool exporter, its pools with the driver's figures, the names
// it publishes, and each consumer process with the leases it holds.
//
//	poolstat [-json] [-watch INTERVAL] [-clean] [-dir DIR | -socket PATH] [-timeout D]
//
// Exporters announce themselves in one directory ($CUDAPOOL_DIR, else
// $XDG_RUNTIME_DIR/cudapool, else cudapool-<uid> in the system temp directory); -dir
// looks elsewhere and -socket asks one exporter only. Each is asked for its state over
// its own socket, under its own admission policy, with a read-only request. An announced
// exporter whose process is gone or whose socket refuses connections is shown as dead,
// never as live; -clean removes such announcements.
//
// -json prints a Report (see Report for the schema) instead of the table; with -watch
// it prints one Report per line. -watch redraws every INTERVAL until Ctrl-C.
//
// Exit status: 0 when poolstat reached every exporter it lists (dead ones removed by
// -clean count as reached, and so does an empty list), 1 otherwise, 2 for a bad command
// line.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/export"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run is poolstat with its arguments and output streams; it returns the exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("poolstat", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var l looker
	fs.StringVar(&l.dir, "dir", export.DefaultDir(), "the announce directory to look in")
	fs.StringVar(&l.socket, "socket", "", "ask only the exporter on this Unix socket")
	fs.BoolVar(&l.clean, "clean", false, "remove the announcements of dead exporters")
	fs.DurationVar(&l.timeout, "timeout", 5*time.Second, "how long to wait for each exporter's answer")
	asJSON := fs.Bool("json", false, "print a JSON report (stable schema) instead of the table")
	every := fs.Duration("watch", 0, "redraw every `INTERVAL` (e.g. 2s) until Ctrl-C")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	switch {
	case fs.NArg() > 0:
		fmt.Fprintf(stderr, "poolstat: unexpected arguments %q\n", fs.Args())
		return 2
	case l.socket != "" && l.clean:
		fmt.Fprintln(stderr, "poolstat: -clean works on the announce directory; it cannot be used with -socket")
		return 2
	case *every < 0 || l.timeout <= 0:
		fmt.Fprintln(stderr, "poolstat: -watch and -timeout must be positive")
		return 2
	}
	show := func(r *Report) error { return writeTable(stdout, r) }
	switch {
	case *asJSON:
		show = func(r *Report) error { return writeJSON(stdout, r, *every == 0) }
	case *every > 0:
		clear := isTerminal(stdout)
		show = func(r *Report) error {
			if clear {
				fmt.Fprint(stdout, "\x1b[H\x1b[2J") // home and clear: redraw in place
			}
			fmt.Fprintf(stdout, "poolstat at %s, every %v (Ctrl-C stops)\n", r.Time.Format(time.TimeOnly), *every)
			return writeTable(stdout, r)
		}
	}
	if *every == 0 {
		return once(ctx, &l, show, stderr)
	}
	return watch(ctx, &l, *every, show, stderr)
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
		fmt.Fprintf(stderr, "poolstat: %v\n", err)
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
