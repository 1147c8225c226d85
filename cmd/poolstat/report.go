package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/internal/privdir"
	"github.com/cudapool/cudapool/internal/session"
)

// ReportSchema is the version of the -json schema. Fields may be added within a
// version; none is removed or changes meaning.
const ReportSchema = 1

// Report is one look at the exporters of a host: what the table shows and what -json
// prints. It is a stable schema (ReportSchema), written down as JSON Schema in
// report.schema.json, which the tests hold the output to:
//
//	schema     int      ReportSchema
//	time       string   when the look was taken (RFC 3339)
//	dir        string   the announce directory searched; absent with -socket
//	exporters  array    one per announced exporter (or the one -socket names), by pid:
//	  pid      int      the exporter's process id (0 when unknown: -socket, or an unreadable announcement)
//	  socket   string   its Unix socket
//	  name     string   the program name it announced
//	  status   string   "live": it answered and state is set; "dead": announced, but the process
//	                    is gone or its socket refuses connections; "removed": dead beyond doubt, and
//	                    poolstat removed its announcement (not with -keep-dead); "unreachable": it should answer but did not (refused this
//	                    user, spoke another protocol version, timed out)
//	  error    string   why, for every status but "live"
//	  processes object  the command names of the state's peers (and of the exporter), by pid, as
//	                    this host's /proc shows them; a pid it does not show is left out
//	  state    object   the exporter's own description, export.State (schema export.StateSchema):
//	                    process, devices, pools with their figures, published names, peers with
//	                    their leases
//
// poolstat's own connection, which holds no lease, is left out of each state's peers.
type Report struct {
	Schema    int        `json:"schema"`
	Time      time.Time  `json:"time"`
	Dir       string     `json:"dir,omitempty"`
	Exporters []Exporter `json:"exporters"`
}

// Exporter is one exporter in a Report.
type Exporter struct {
	PID    int           `json:"pid"`
	Socket string        `json:"socket"`
	Name   string        `json:"name,omitempty"`
	Status Status        `json:"status"`
	Error  string        `json:"error,omitempty"`
	State  *export.State `json:"state,omitempty"`
	// Processes are the command names of the pids in State, by pid.
	Processes map[int]string `json:"processes,omitempty"`
}

// Status says whether poolstat reached an exporter.
type Status string

const (
	Live        Status = "live"
	Dead        Status = "dead"
	Removed     Status = "removed"
	Unreachable Status = "unreachable"
)

// reached reports whether the report covers every exporter it lists: each one either
// answered or was a dead entry that poolstat removed. poolstat's exit status says this.
func (r *Report) reached() bool {
	for _, e := range r.Exporters {
		if e.Status != Live && e.Status != Removed {
			return false
		}
	}
	return true
}

// count returns how many exporters have status s.
func (r *Report) count(s Status) int {
	n := 0
	for _, e := range r.Exporters {
		if e.Status == s {
			n++
		}
	}
	return n
}

// looker takes Reports.
type looker struct {
	dir      string // the announce directory; unused when socket is set
	socket   string // -socket: the one exporter to ask
	keepDead bool   // -keep-dead: leave the announcements of dead exporters
	kv       string // -kv: the directory of a KV page pool's owner
	timeout  time.Duration
}

// look takes one Report. It fails only when the announce directory cannot be read; an
// exporter that cannot be reached is a fact of the report, not a failure of look.
func (l *looker) look(ctx context.Context) (*Report, error) {
	r := &Report{Schema: ReportSchema, Time: time.Now()}
	if l.socket != "" {
		r.Exporters = []Exporter{{Socket: l.socket, Status: Live}}
	} else {
		r.Dir = l.dir
		anns, err := discover.Discover(l.dir)
		if err != nil {
			return nil, err
		}
		r.Exporters = make([]Exporter, 0, len(anns))
		for _, a := range anns {
			e := Exporter{PID: a.PID, Socket: a.Socket, Name: a.Name, Status: Live}
			if !a.Live {
				e.Status, e.Error = Dead, a.Dead
				if !l.keepDead {
					l.remove(&e, a)
				}
			}
			r.Exporters = append(r.Exporters, e)
		}
	}
	// Each query waits at most l.timeout; the limit keeps a host with many exporters
	// from opening a connection to every one at once.
	var g errgroup.Group
	g.SetLimit(maxQueries)
	for i := range r.Exporters {
		if e := &r.Exporters[i]; e.Status == Live {
			g.Go(func() error { l.query(ctx, e); return nil })
		}
	}
	_ = g.Wait() // a query's failure is a fact of the report, not an error
	return r, nil
}

// maxQueries is how many exporters poolstat asks at once.
const maxQueries = 16

// query asks e for its state; on failure e becomes unreachable, with the reason.
func (l *looker) query(ctx context.Context, e *Exporter) {
	ctx, cancel := context.WithTimeout(ctx, l.timeout)
	defer cancel()
	st, err := discover.QueryState(ctx, e.Socket)
	if err != nil {
		e.Status, e.Error = Unreachable, explain(err, e.Socket)
		return
	}
	e.State = st
	if e.PID == 0 {
		e.PID, e.Name = st.PID, st.Name
	}
	e.Processes = commands(st)
}

// commands returns the command names of the exporter's and its peers' pids, as far as
// this host shows them: a peer on another host, in another pid namespace or gone since
// the state was taken has none.
func commands(st *export.State) map[int]string {
	names := map[int]string{}
	for _, pid := range append([]int{st.PID}, peerPIDs(st)...) {
		if info, err := peercred.Lookup(pid); err == nil {
			names[pid] = info.Command
		}
	}
	if len(names) == 0 {
		return nil
	}
	return names
}

func peerPIDs(st *export.State) []int {
	var pids []int
	for _, p := range st.Peers {
		if !p.Remote {
			pids = append(pids, p.PID)
		}
	}
	return pids
}

// explain turns a failed query into a sentence an operator can act on. export's own
// messages say why a policy refused us; what they cannot say is what is wrong with the
// path (nothing there, not a socket, nobody listening, whose it is), or which socket
// timed out.
func explain(err error, socket string) string {
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Sprintf("%s did not answer in time: %v", socket, err)
	}
	if why := diagnose(socket, err); why != "" {
		return why
	}
	return err.Error()
}

// diagnose looks at the path a connection to socket failed on and says what is wrong
// with it, or "" when the path looks right and err says more.
func diagnose(socket string, err error) string {
	info, serr := os.Stat(socket)
	switch {
	case errors.Is(serr, fs.ErrNotExist):
		return fmt.Sprintf("%s does not exist: no exporter listens there", socket)
	case errors.Is(serr, fs.ErrPermission):
		return fmt.Sprintf("permission denied looking up %s: a directory on its path is closed to this user", socket)
	case serr != nil:
		return serr.Error()
	case info.Mode().Type() != fs.ModeSocket:
		return fmt.Sprintf("%s is a %s, not a Unix socket", socket, fileKind(info.Mode()))
	case errors.Is(err, syscall.ECONNREFUSED):
		return fmt.Sprintf("nobody listens on %s: the exporter that made it is gone or stopped listening", socket)
	case errors.Is(err, syscall.EACCES):
		owner := ""
		if st, ok := info.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Getuid() {
			owner = fmt.Sprintf(": it belongs to uid %d, another user's exporter", st.Uid)
		}
		return fmt.Sprintf("permission denied on %s%s", socket, owner)
	}
	return ""
}

// fileKind names the type of a file that is not a socket.
func fileKind(m fs.FileMode) string {
	switch m.Type() {
	case 0:
		return "regular file"
	case fs.ModeDir:
		return "directory"
	case fs.ModeNamedPipe:
		return "named pipe"
	case fs.ModeDevice | fs.ModeCharDevice:
		return "character device"
	case fs.ModeDevice:
		return "block device"
	}
	return "special file"
}

// remove deletes the announcement of the dead exporter e, found as a, and marks e
// removed, but only once the exporter is proven dead (see provenDead): an announcement
// that Discover found not live may still be a live process's. It checks first that the
// file still holds the same announcement, so that an exporter that has just started
// with a recycled pid keeps its own.
func (l *looker) remove(e *Exporter, a discover.Announcement) {
	if a.PID <= 0 {
		e.Error += fmt.Sprintf(" (not removed: unreadable, so poolstat cannot tell whether it is stale; if it is, remove %s by hand)", a.Path)
		return
	}
	if err := provenDead(a); err != nil {
		e.Error += fmt.Sprintf(" (not removed: %v)", err)
		return
	}
	var now discover.Announcement
	body, regular, err := privdir.ReadRegular(a.Path, discover.MaxAnnouncement)
	if err == nil && !regular {
		err = errors.New("no longer a regular file")
	}
	if err == nil {
		err = json.Unmarshal(body, &now)
	}
	if err == nil && (now.Socket != a.Socket || !now.Started.Equal(a.Started)) {
		err = errors.New("the announcement changed meanwhile")
	}
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		e.Error += fmt.Sprintf(" (not removed: %v)", err)
		return
	}
	if err := os.Remove(a.Path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		e.Error += fmt.Sprintf(" (not removed: %v)", err)
		return
	}
	e.Status = Removed
}

// startSlack is how far a process's start time as /proc shows it (the boot time there
// is in whole seconds) may be off.
const startSlack = time.Second

// provenDead returns nil when a's exporter is dead beyond doubt: its socket is gone or
// refuses connections, and its process is gone, or its pid names a process that
// started after the announcement was written (the pid was reused). Otherwise it says
// what may still be alive. A socket that cannot be checked (a path too long to dial, a
// full backlog) or a process that cannot be looked up proves nothing.
func provenDead(a discover.Announcement) error {
	live, err := session.Answers(a.Socket)
	switch {
	case err != nil:
		return fmt.Errorf("its socket %s could not be checked: %w", a.Socket, err)
	case live:
		return fmt.Errorf("its socket %s accepts connections", a.Socket)
	}
	info, err := peercred.Lookup(a.PID)
	switch {
	case errors.Is(err, peercred.ErrGone):
		return nil
	case err != nil:
		return fmt.Errorf("process %d could not be checked: %w", a.PID, err)
	case info.Started.After(a.Started.Add(startSlack)):
		return nil // a later process has its pid
	}
	return fmt.Errorf("process %d (%s) still runs", a.PID, info.Command)
}
