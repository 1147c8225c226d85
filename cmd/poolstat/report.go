package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/cudapool/cudapool/export"
)

// ReportSchema is the version of the -json schema. Fields may be added within a
// version; none is removed or changes meaning.
const ReportSchema = 1

// Report is one look at the exporters of a host: what the table shows and what -json
// prints. It is a stable schema (ReportSchema):
//
//	schema     int      ReportSchema
//	time       string   when the look was taken (RFC 3339)
//	dir        string   the announce directory searched; absent with -socket
//	exporters  array    one per announced exporter (or the one -socket names), by pid:
//	  pid      int      the exporter's process id (0 when unknown: -socket, or an unreadable announcement)
//	  socket   string   its Unix socket
//	  name     string   the program name it announced
//	  status   string   "live": it answered and state is set; "dead": announced, but the process
//	                    is gone or its socket refuses connections; "removed": dead, and -clean removed
//	                    its announcement; "unreachable": it should answer but did not (refused this
//	                    user, spoke another protocol version, timed out)
//	  error    string   why, for every status but "live"
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
// answered or was a dead entry that -clean removed. poolstat's exit status says this.
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
	dir     string // the announce directory; unused when socket is set
	socket  string // -socket: the one exporter to ask
	clean   bool   // -clean: remove the announcements of dead exporters
	timeout time.Duration
}

// look takes one Report. It fails only when the announce directory cannot be read; an
// exporter that cannot be reached is a fact of the report, not a failure of look.
func (l *looker) look(ctx context.Context) (*Report, error) {
	r := &Report{Schema: ReportSchema, Time: time.Now()}
	if l.socket != "" {
		r.Exporters = []Exporter{{Socket: l.socket, Status: Live}}
	} else {
		r.Dir = l.dir
		anns, err := export.Discover(l.dir)
		if err != nil {
			return nil, err
		}
		r.Exporters = make([]Exporter, 0, len(anns))
		for _, a := range anns {
			e := Exporter{PID: a.PID, Socket: a.Socket, Name: a.Name, Status: Live}
			if !a.Live {
				e.Status, e.Error = Dead, a.Dead
				if l.clean {
					l.remove(&e, a)
				}
			}
			r.Exporters = append(r.Exporters, e)
		}
	}
	var wg sync.WaitGroup
	for i := range r.Exporters {
		if e := &r.Exporters[i]; e.Status == Live {
			wg.Go(func() { l.query(ctx, e) })
		}
	}
	wg.Wait()
	return r, nil
}

// query asks e for its state; on failure e becomes unreachable, with the reason.
func (l *looker) query(ctx context.Context, e *Exporter) {
	ctx, cancel := context.WithTimeout(ctx, l.timeout)
	defer cancel()
	st, err := export.QueryState(ctx, e.Socket)
	if err != nil {
		e.Status, e.Error = Unreachable, explain(err, e.Socket)
		return
	}
	e.State = st
	if e.PID == 0 {
		e.PID, e.Name = st.PID, st.Name
	}
}

// explain turns a failed query into a sentence an operator can act on. export's own
// messages say when nothing listens and why a policy refused us; what they cannot say is
// whose socket the kernel kept us out of, or which socket timed out.
func explain(err error, socket string) string {
	switch {
	case errors.Is(err, syscall.EACCES):
		owner := ""
		if info, serr := os.Stat(socket); serr == nil {
			if st, ok := info.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Getuid() {
				owner = fmt.Sprintf(": it belongs to uid %d, another user's exporter", st.Uid)
			}
		}
		return fmt.Sprintf("permission denied on %s%s", socket, owner)
	case errors.Is(err, context.DeadlineExceeded):
		return fmt.Sprintf("%s did not answer in time: %v", socket, err)
	}
	return err.Error()
}

// remove deletes the announcement of the dead exporter e, found as a, and marks e
// removed. It checks first that the file still holds the same announcement, so that an
// exporter that has just started with a recycled pid keeps its own.
func (l *looker) remove(e *Exporter, a export.Announcement) {
	if a.PID <= 0 {
		e.Error += fmt.Sprintf(" (not removed: unreadable, so poolstat cannot tell whether it is stale; if it is, remove %s by hand)", a.Path)
		return
	}
	var now export.Announcement
	body, err := os.ReadFile(a.Path)
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
