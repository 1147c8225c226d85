package wire

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/export"
)

// Client is the requesting side of an admitted connection: it numbers requests, sends
// them, and hands each reply to the request waiting for it. Its one reader also hands
// the frames that answer no request (pool handles, pushes) to the connection's owner.
// Both the Importer and QueryState talk to an exporter through one.
type Client struct {
	C   *Conn
	log *slog.Logger
	// ExporterPID is what the exporter said in Welcome.
	ExporterPID int
	// Handle takes the frames that are not replies, with the descriptor that came with
	// one, which it owns. An error ends the connection.
	Handle func(m Message, fd int) error
	// Unclaimed takes a Lease whose request was given up on; nil drops it.
	Unclaimed func(l *LeaseMsg)

	Mu sync.Mutex
	// closed: the owner is closing; no new requests.
	closed bool
	// Bye: the exporter is closing; it takes no new requests but still ends leases.
	Bye bool
	// down says why the connection ended, nil while it carries requests.
	down    error
	nextReq uint64
	pending map[uint64]chan delivery
	states  map[uint64][]byte     // State replies being assembled
	batches map[uint64][]LeaseMsg // LeaseBatch replies being assembled

	// The reading role: one goroutine at a time reads the connection and hands each
	// frame to whom it concerns. A request's caller takes it while it waits, so that
	// its reply wakes it directly: a wake passed on through another goroutine costs
	// more than the rest of a request. While no caller reads, the watcher goroutine
	// does, woken by watch when something arrives. reading says who holds the role;
	// leaders lists the requests waiting for it, oldest first.
	reading  readRole
	leaders  []uint64
	watch    *idleWatch // nil: the watcher reads for good, and replies are handed over
	watchOff bool       // watch is switched off; only the role's holder touches it

	ReaderDone chan struct{} // closed when the watcher has returned
	// Done is closed when the connection ends (down is set).
	Done chan struct{}
}

// readRole says who holds the reading role.
type readRole int

const (
	readerNone    readRole = iota // nobody: the watch is on
	readerCaller                  // a request's caller, waiting for its reply
	readerWatcher                 // the watcher goroutine
)

// delivery is what a waiting request is handed: its reply, or the reading role.
type delivery struct {
	m    Message
	lead bool
}

func NewClient(c *Conn, log *slog.Logger, exporterPID int) *Client {
	return &Client{
		C: c, log: log, ExporterPID: exporterPID,
		pending: map[uint64]chan delivery{}, states: map[uint64][]byte{}, batches: map[uint64][]LeaseMsg{},
		ReaderDone: make(chan struct{}), Done: make(chan struct{}),
	}
}

// Start runs the watcher; handle and unclaimed must be set before. Where the
// connection cannot be watched while idle (not a Unix socket, not Linux), the watcher
// holds the reading role for good and hands every reply over.
func (cl *Client) Start() {
	if w, err := newIdleWatch(cl.C.raw); err == nil {
		cl.watch = w
		go cl.watchIdle()
		return
	}
	cl.reading = readerWatcher
	go cl.readAll()
}

// readAll reads every frame, for a connection without an idle watch.
func (cl *Client) readAll() {
	defer close(cl.ReaderDone)
	for {
		if err := cl.handOn(true); err != nil {
			cl.Fail(err)
			return
		}
	}
}

// watchIdle reads what arrives while no caller does, until the connection ends. Its
// first look is before any wake: the handshake's read may have brought more than the
// Welcome.
func (cl *Client) watchIdle() {
	defer close(cl.ReaderDone)
	for first := true; ; first = false {
		var watchErr error
		if !first {
			watchErr = cl.watch.wait()
		}
		if !cl.takeRole() {
			if watchErr != nil {
				<-cl.Done // the watch closed with the connection; the reader sees its end
				return
			}
			continue // a caller reads; its passRole switches the watch on again
		}
		if watchErr != nil {
			cl.Fail(watchErr)
			cl.passRole()
			return
		}
		for {
			err := cl.handOn(false)
			if err == errNoFrame {
				break
			}
			if err != nil {
				cl.Fail(err)
				cl.passRole()
				return
			}
			if cl.leaderWaits() {
				break // it reads the rest, its reply among it
			}
		}
		cl.passRole()
	}
}

// takeRole gives the watcher the reading role if nobody holds it.
func (cl *Client) takeRole() bool {
	cl.Mu.Lock()
	defer cl.Mu.Unlock()
	if cl.reading != readerNone {
		return false
	}
	cl.reading = readerWatcher
	return true
}

// leaderWaits reports whether a request waits for the reading role.
func (cl *Client) leaderWaits() bool {
	cl.Mu.Lock()
	defer cl.Mu.Unlock()
	return len(cl.leaders) > 0
}

// passRole gives the reading role, which the caller holds, to the oldest request
// waiting for it, or else to nobody, with the watch on.
func (cl *Client) passRole() {
	cl.Mu.Lock()
	for len(cl.leaders) > 0 {
		id := cl.leaders[0]
		cl.leaders = cl.leaders[1:]
		if w := cl.pending[id]; w != nil {
			// Sent under mu, as every delivery, so that giveUp finds it.
			select {
			case w <- delivery{lead: true}:
				cl.reading = readerCaller
				cl.Mu.Unlock()
				return
			default: // cannot happen: a waiting request has had nothing yet
			}
		}
	}
	cl.reading = readerNone
	turnOn := cl.watch != nil && cl.watchOff
	cl.watchOff = false
	cl.Mu.Unlock()
	if turnOn {
		// After the role is free: whatever arrived meanwhile wakes the watcher now.
		// (Should the next holder's switching off come first, the watch is on while it
		// reads: a wake to spare, nothing lost.)
		cl.watch.set(true)
	}
}

// lead reads the connection for the request whose reply comes on w, which holds the
// reading role, until the reply is there or ctx ends, and then passes the role on.
func (cl *Client) lead(ctx context.Context, w chan delivery) (delivery, error) {
	defer cl.passRole()
	cl.Mu.Lock()
	turnOff := !cl.watchOff
	cl.watchOff = true
	cl.Mu.Unlock()
	if turnOff {
		cl.watch.set(false) // this caller's reads alone wake it
	}
	if ctx.Done() != nil {
		fired := make(chan struct{})
		stop := context.AfterFunc(ctx, func() {
			_ = cl.C.Nc.SetReadDeadline(time.Unix(1, 0)) // it only wakes a blocked call; it fails only on a closed connection
			close(fired)
		})
		defer func() {
			if !stop() {
				<-fired                                  // or it could set the deadline after it is cleared
				_ = cl.C.Nc.SetReadDeadline(time.Time{}) // it fails only on a closed connection, which the next read or write reports
			}
		}()
	}
	for {
		if err := cl.handOn(true); err != nil {
			if ctx.Err() != nil && errors.Is(err, os.ErrDeadlineExceeded) {
				return delivery{}, ctx.Err() // nothing is lost: the next reader goes on
			}
			cl.Fail(err)
			return delivery{}, cl.GoneOr(export.ErrExporterGone)
		}
		select {
		case d, ok := <-w:
			if !ok {
				return delivery{}, cl.GoneOr(export.ErrExporterGone)
			}
			// Frames read with the reply would wait for the next wake: take them now.
			for cl.C.hasFrame() {
				if err := cl.handOn(true); err != nil {
					cl.Fail(err)
					break
				}
			}
			return d, nil
		default:
		}
	}
}

// handOn reads a frame, waiting for it or not (errNoFrame), and dispatches it.
func (cl *Client) handOn(wait bool) error {
	m, fd, err := cl.C.next(wait)
	if err != nil {
		return err
	}
	return cl.dispatch(m, fd)
}

// dispatch hands a frame to whom it concerns. An error ends the connection.
func (cl *Client) dispatch(m Message, fd int) error {
	switch m := m.(type) {
	case *LeaseMsg:
		if !cl.deliver(m.ReqID, m) && cl.Unclaimed != nil {
			// Not sent from here: a reader blocked on a full socket while the
			// exporter blocks writing to it would deadlock.
			go cl.Unclaimed(m)
		}
	case *ReleasedMsg:
		cl.deliver(m.ReqID, m)
	case *ErrorMsg:
		cl.deliver(m.ReqID, m)
	case *StateMsg:
		cl.assembleState(m)
	case *LeaseBatchMsg:
		cl.assembleBatch(m)
	case *ByeMsg:
		cl.Mu.Lock()
		cl.Bye = true
		cl.Mu.Unlock()
	default:
		return cl.Handle(m, fd)
	}
	return nil
}

// Fail ends the connection: every waiting request and every later one fails with
// ErrExporterGone.
func (cl *Client) Fail(err error) {
	if errors.Is(err, export.ErrProtocol) {
		cl.log.Warn("cudapool: closing the exporter's connection", "exporter", cl.ExporterPID, "reason", err)
	}
	cl.closeConn()
	cl.Mu.Lock()
	defer cl.Mu.Unlock()
	if cl.down == nil {
		defer close(cl.Done)
	}
	switch {
	case cl.down != nil:
	case errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed):
		cl.down = fmt.Errorf("%w: the connection closed", export.ErrExporterGone)
	default:
		cl.down = fmt.Errorf("%w: %w", export.ErrExporterGone, err)
	}
	for id, ch := range cl.pending {
		close(ch)
		delete(cl.pending, id)
	}
	cl.states = map[uint64][]byte{}
	cl.batches = map[uint64][]LeaseMsg{}
}

// closeConn closes the connection and its watch.
func (cl *Client) closeConn() {
	_ = cl.C.Close() // cleanup: nothing is left to do if closing fails
	if cl.watch != nil {
		cl.watch.Close()
	}
}

// deliver hands a reply to its request; false if no request waits for it.
func (cl *Client) deliver(reqID uint64, m Message) bool {
	cl.Mu.Lock()
	defer cl.Mu.Unlock()
	w := cl.pending[reqID]
	if w == nil {
		return false
	}
	delete(cl.pending, reqID)
	w <- delivery{m: m} // never blocks: it is the first, and under mu (see giveUp)
	return true
}

func (cl *Client) assembleState(m *StateMsg) {
	body, state := gather(cl, cl.states, m.ReqID, m.JSON, m.Flags&StateMore != 0, MaxStateBytes)
	switch state {
	case gatherOver:
		cl.deliver(m.ReqID, &ErrorMsg{Code: codeExporter, Text: fmt.Sprintf("%v: State larger than %s", export.ErrProtocol, humanize.IBytes(MaxStateBytes))})
	case gatherDone:
		cl.deliver(m.ReqID, &StateMsg{ReqID: m.ReqID, JSON: body})
	}
}

// assembleBatch collects the frames of a LeaseBatch reply and delivers them as one.
// Leases of a request given up on go to unclaimed, as a lone Lease's do.
func (cl *Client) assembleBatch(m *LeaseBatchMsg) {
	all, state := gather(cl, cl.batches, m.ReqID, m.Leases, m.Flags&LeaseBatchMore != 0, export.MaxBatch)
	switch state {
	case gatherOver:
		cl.deliver(m.ReqID, &ErrorMsg{Code: codeExporter, Text: fmt.Sprintf("%v: LeaseBatch of more than %d leases", export.ErrProtocol, export.MaxBatch)})
		cl.GiveBackAll(all)
	case gatherUnwanted:
		cl.GiveBackAll(all)
	case gatherDone:
		if !cl.deliver(m.ReqID, &LeaseBatchMsg{ReqID: m.ReqID, Leases: all}) {
			cl.GiveBackAll(all)
		}
	}
}

// gatherState says where a reply in parts stands.
type gatherState int

const (
	gatherMore     gatherState = iota // more parts to come
	gatherDone                        // the last part came: all is the reply
	gatherOver                        // the reply grew past its limit: all is dropped
	gatherUnwanted                    // no request waits for it: all is dropped
)

// gather adds part to the reply for reqID being assembled in parts (guarded by cl.mu),
// at most limit elements in all.
func gather[T any](cl *Client, parts map[uint64][]T, reqID uint64, part []T, more bool, limit int) ([]T, gatherState) {
	cl.Mu.Lock()
	defer cl.Mu.Unlock()
	_, waiting := cl.pending[reqID]
	all := append(parts[reqID], part...)
	switch {
	case !waiting:
		delete(parts, reqID)
		return all, gatherUnwanted
	case len(all) > limit:
		delete(parts, reqID)
		return all, gatherOver
	case more:
		parts[reqID] = all
		return nil, gatherMore
	}
	delete(parts, reqID)
	return all, gatherDone
}

// GiveBackAll hands leases nobody waits for to unclaimed, off the reader.
func (cl *Client) GiveBackAll(ls []LeaseMsg) {
	if cl.Unclaimed == nil || len(ls) == 0 {
		return
	}
	go func() {
		for i := range ls {
			cl.Unclaimed(&ls[i])
		}
	}()
}

// Request sends the message build makes for a fresh request id and waits for the
// reply, reading it itself if nobody else reads the connection. A new request (Open,
// StateRequest) is refused once the client is closed or the exporter said Bye; a
// Release only once the connection is down. A Lease that arrives for a request given
// up on goes to unclaimed.
func (cl *Client) Request(ctx context.Context, build func(reqID uint64) Message, isNew bool) (Message, error) {
	cl.Mu.Lock()
	var refuse error
	switch {
	case cl.down != nil:
		refuse = cl.down
	case isNew && cl.closed:
		refuse = export.ErrClosed
	case isNew && cl.Bye:
		refuse = fmt.Errorf("%w: it is closing", export.ErrExporterGone)
	}
	if refuse != nil {
		cl.Mu.Unlock()
		return nil, refuse
	}
	cl.nextReq++
	id := cl.nextReq
	w := make(chan delivery, 1)
	cl.pending[id] = w
	lead := false
	switch {
	case cl.reading == readerNone:
		cl.reading, lead = readerCaller, true
	case cl.watch != nil:
		cl.leaders = append(cl.leaders, id)
	}
	cl.Mu.Unlock()
	if err := cl.C.Send(ctx, build(id), -1); err != nil {
		cl.giveUp(id, w, lead) // send closed the connection if it wrote part of the frame
		if ctx.Err() == nil {
			// The write itself failed (the exporter closed its end, as when its
			// process died): the connection is lost, whether or not the reader has
			// seen the end of the stream yet.
			cl.Fail(err)
		}
		return nil, cl.GoneOr(err)
	}
	for {
		var d delivery
		if lead {
			var err error
			if d, err = cl.lead(ctx, w); err != nil {
				cl.giveUp(id, w, false)
				return nil, err
			}
		} else {
			select {
			case got, ok := <-w:
				if !ok {
					return nil, cl.GoneOr(export.ErrExporterGone)
				}
				d = got
			case <-ctx.Done():
				cl.giveUp(id, w, false)
				return nil, ctx.Err()
			}
		}
		if d.lead {
			lead = true
			continue
		}
		return d.m, nil
	}
}

// giveUp forgets request id, whose caller returns without its reply: a reply that
// came meanwhile is given back, the reading role passed on if the caller holds it
// (lead) or was handed it meanwhile.
func (cl *Client) giveUp(id uint64, w chan delivery, lead bool) {
	cl.Mu.Lock()
	delete(cl.pending, id)
	if i := slices.Index(cl.leaders, id); i >= 0 {
		cl.leaders = slices.Delete(cl.leaders, i, i+1)
	}
	cl.Mu.Unlock()
	// Every delivery is made under mu while the request is pending: after the
	// delete above none comes, and one made before is in w.
	select {
	case d := <-w: // a closed w gives the zero delivery: nothing to do
		if d.lead {
			lead = true
		}
		switch r := d.m.(type) {
		case *LeaseMsg:
			if cl.Unclaimed != nil {
				cl.Unclaimed(r)
			}
		case *LeaseBatchMsg:
			cl.GiveBackAll(r.Leases)
		}
	default:
	}
	if lead {
		cl.passRole()
	}
}

// GoneOr is why the connection ended, or err while it carries requests.
func (cl *Client) GoneOr(err error) error {
	cl.Mu.Lock()
	defer cl.Mu.Unlock()
	if cl.down != nil {
		return cl.down
	}
	return err
}

// Close refuses new requests from now on; it reports whether this call closed it.
func (cl *Client) Close() bool {
	cl.Mu.Lock()
	defer cl.Mu.Unlock()
	was := cl.closed
	cl.closed = true
	return !was
}

// IsClosed reports whether close was called.
func (cl *Client) IsClosed() bool {
	cl.Mu.Lock()
	defer cl.Mu.Unlock()
	return cl.closed
}

// Gone reports whether the connection ended or the exporter said Bye.
func (cl *Client) Gone() bool {
	cl.Mu.Lock()
	defer cl.Mu.Unlock()
	return cl.down != nil || cl.Bye
}

// HangUp says Bye and waits, until ctx ends, for the exporter to close the connection
// (it may still be ending leases as of this side's release event), then closes it and
// waits for the reader.
func (cl *Client) HangUp(ctx context.Context) error {
	var err error
	if cl.C.Send(ctx, &ByeMsg{}, -1) == nil {
		select {
		case <-cl.ReaderDone:
		case <-ctx.Done():
			err = fmt.Errorf("the exporter did not hang up: %w", ctx.Err())
		}
	}
	cl.closeConn()
	<-cl.ReaderDone
	return err
}

// QueryState asks for the exporter's State and returns its JSON.
func (cl *Client) QueryState(ctx context.Context) ([]byte, error) {
	reply, err := cl.Request(ctx, func(id uint64) Message { return &StateRequestMsg{ReqID: id} }, true)
	if err != nil {
		return nil, fmt.Errorf("cudapool: state: %w", err)
	}
	switch r := reply.(type) {
	case *StateMsg:
		return r.JSON, nil
	case *ErrorMsg:
		return nil, fmt.Errorf("cudapool: state: %w", ReplyErr(r))
	}
	return nil, fmt.Errorf("%w: StateRequest answered with %s", export.ErrProtocol, reply.Kind())
}
