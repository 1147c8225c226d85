package export

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"

	"github.com/dustin/go-humanize"
)

// client is the requesting side of an admitted connection: it numbers requests, sends
// them, and hands each reply to the request waiting for it. Its one reader also hands
// the frames that answer no request (pool handles, pushes) to the connection's owner.
// Both the Importer and QueryState talk to an exporter through one.
type client struct {
	c   *conn
	log *slog.Logger
	// exporterPID is what the exporter said in Welcome.
	exporterPID int
	// handle takes the frames that are not replies, with the descriptor that came with
	// one, which it owns. An error ends the connection.
	handle func(m message, fd int) error
	// unclaimed takes a Lease whose request was given up on; nil drops it.
	unclaimed func(l *leaseMsg)

	mu sync.Mutex
	// closed: the owner is closing; no new requests.
	closed bool
	// bye: the exporter is closing; it takes no new requests but still ends leases.
	bye bool
	// down says why the connection ended, nil while it carries requests.
	down    error
	nextReq uint64
	pending map[uint64]chan message
	states  map[uint64][]byte     // State replies being assembled
	batches map[uint64][]leaseMsg // LeaseBatch replies being assembled

	readerDone chan struct{}
	// done is closed when the connection ends (down is set).
	done chan struct{}
}

func newClient(c *conn, log *slog.Logger, exporterPID int) *client {
	return &client{
		c: c, log: log, exporterPID: exporterPID,
		pending: map[uint64]chan message{}, states: map[uint64][]byte{}, batches: map[uint64][]leaseMsg{},
		readerDone: make(chan struct{}), done: make(chan struct{}),
	}
}

// start runs the reader; handle and unclaimed must be set before.
func (cl *client) start() { go cl.read() }

// read is the connection's one reader.
func (cl *client) read() {
	defer close(cl.readerDone)
	for {
		m, fd, err := cl.c.recv()
		if err != nil {
			cl.fail(err)
			return
		}
		switch m := m.(type) {
		case *leaseMsg:
			if !cl.deliver(m.ReqID, m) && cl.unclaimed != nil {
				// Not sent from here: a reader blocked on a full socket while the
				// exporter blocks writing to it would deadlock.
				go cl.unclaimed(m)
			}
		case *releasedMsg:
			cl.deliver(m.ReqID, m)
		case *errorMsg:
			cl.deliver(m.ReqID, m)
		case *stateMsg:
			cl.assembleState(m)
		case *leaseBatchMsg:
			cl.assembleBatch(m)
		case *byeMsg:
			cl.mu.Lock()
			cl.bye = true
			cl.mu.Unlock()
		default:
			if err := cl.handle(m, fd); err != nil {
				cl.fail(err)
				return
			}
		}
	}
}

// fail ends the connection: every waiting request and every later one fails with
// ErrExporterGone.
func (cl *client) fail(err error) {
	if errors.Is(err, ErrProtocol) {
		cl.log.Warn("export: closing the exporter's connection", "exporter", cl.exporterPID, "reason", err)
	}
	cl.c.close()
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if cl.down == nil {
		defer close(cl.done)
	}
	switch {
	case cl.down != nil:
	case errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed):
		cl.down = fmt.Errorf("%w: the connection closed", ErrExporterGone)
	default:
		cl.down = fmt.Errorf("%w: %w", ErrExporterGone, err)
	}
	for id, ch := range cl.pending {
		close(ch)
		delete(cl.pending, id)
	}
	cl.states = map[uint64][]byte{}
	cl.batches = map[uint64][]leaseMsg{}
}

// deliver hands a reply to its request; false if no request waits for it.
func (cl *client) deliver(reqID uint64, m message) bool {
	cl.mu.Lock()
	ch := cl.pending[reqID]
	delete(cl.pending, reqID)
	cl.mu.Unlock()
	if ch == nil {
		return false
	}
	ch <- m
	return true
}

func (cl *client) assembleState(m *stateMsg) {
	body, state := gather(cl, cl.states, m.ReqID, m.JSON, m.Flags&stateMore != 0, maxStateBytes)
	switch state {
	case gatherOver:
		cl.deliver(m.ReqID, &errorMsg{Code: codeExporter, Text: fmt.Sprintf("%v: State larger than %s", ErrProtocol, humanize.IBytes(maxStateBytes))})
	case gatherDone:
		cl.deliver(m.ReqID, &stateMsg{ReqID: m.ReqID, JSON: body})
	}
}

// assembleBatch collects the frames of a LeaseBatch reply and delivers them as one.
// Leases of a request given up on go to unclaimed, as a lone Lease's do.
func (cl *client) assembleBatch(m *leaseBatchMsg) {
	all, state := gather(cl, cl.batches, m.ReqID, m.Leases, m.Flags&leaseBatchMore != 0, MaxBatch)
	switch state {
	case gatherOver:
		cl.deliver(m.ReqID, &errorMsg{Code: codeExporter, Text: fmt.Sprintf("%v: LeaseBatch of more than %d leases", ErrProtocol, MaxBatch)})
		cl.giveBackAll(all)
	case gatherUnwanted:
		cl.giveBackAll(all)
	case gatherDone:
		if !cl.deliver(m.ReqID, &leaseBatchMsg{ReqID: m.ReqID, Leases: all}) {
			cl.giveBackAll(all)
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
func gather[T any](cl *client, parts map[uint64][]T, reqID uint64, part []T, more bool, limit int) ([]T, gatherState) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
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

// giveBackAll hands leases nobody waits for to unclaimed, off the reader.
func (cl *client) giveBackAll(ls []leaseMsg) {
	if cl.unclaimed == nil || len(ls) == 0 {
		return
	}
	go func() {
		for i := range ls {
			cl.unclaimed(&ls[i])
		}
	}()
}

// request sends the message build makes for a fresh request id and waits for the
// reply. A new request (Open, StateRequest) is refused once the client is closed or
// the exporter said Bye; a Release only once the connection is down. A Lease that
// arrives for a request given up on goes to unclaimed.
func (cl *client) request(ctx context.Context, build func(reqID uint64) message, isNew bool) (message, error) {
	cl.mu.Lock()
	var refuse error
	switch {
	case cl.down != nil:
		refuse = cl.down
	case isNew && cl.closed:
		refuse = ErrClosed
	case isNew && cl.bye:
		refuse = fmt.Errorf("%w: it is closing", ErrExporterGone)
	}
	if refuse != nil {
		cl.mu.Unlock()
		return nil, refuse
	}
	cl.nextReq++
	id := cl.nextReq
	ch := make(chan message, 1)
	cl.pending[id] = ch
	cl.mu.Unlock()
	if err := cl.c.send(ctx, build(id), -1); err != nil {
		cl.forget(id) // send closed the connection if it wrote part of the frame
		if ctx.Err() == nil {
			// The write itself failed (the exporter closed its end, as when its
			// process died): the connection is lost, whether or not the reader has
			// seen the end of the stream yet.
			cl.fail(err)
		}
		return nil, cl.goneOr(err)
	}
	select {
	case m, ok := <-ch:
		if !ok {
			return nil, cl.goneOr(ErrExporterGone)
		}
		return m, nil
	case <-ctx.Done():
		if m, ok := cl.forget(id); ok {
			switch r := m.(type) {
			case *leaseMsg:
				if cl.unclaimed != nil {
					cl.unclaimed(r)
				}
			case *leaseBatchMsg:
				cl.giveBackAll(r.Leases)
			}
		}
		return nil, ctx.Err()
	}
}

// forget drops the request id; if its reply had arrived meanwhile it is returned.
func (cl *client) forget(id uint64) (message, bool) {
	cl.mu.Lock()
	ch := cl.pending[id]
	delete(cl.pending, id)
	cl.mu.Unlock()
	if ch == nil {
		return nil, false
	}
	select {
	case m, ok := <-ch:
		return m, ok
	default:
		return nil, false
	}
}

// goneOr is why the connection ended, or err while it carries requests.
func (cl *client) goneOr(err error) error {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if cl.down != nil {
		return cl.down
	}
	return err
}

// close refuses new requests from now on; it reports whether this call closed it.
func (cl *client) close() bool {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	was := cl.closed
	cl.closed = true
	return !was
}

// isClosed reports whether close was called.
func (cl *client) isClosed() bool {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	return cl.closed
}

// gone reports whether the connection ended or the exporter said Bye.
func (cl *client) gone() bool {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	return cl.down != nil || cl.bye
}

// hangUp says Bye and waits, until ctx ends, for the exporter to close the connection
// (it may still be ending leases as of this side's release event), then closes it and
// waits for the reader.
func (cl *client) hangUp(ctx context.Context) error {
	var err error
	if cl.c.send(ctx, &byeMsg{}, -1) == nil {
		select {
		case <-cl.readerDone:
		case <-ctx.Done():
			err = fmt.Errorf("the exporter did not hang up: %w", ctx.Err())
		}
	}
	cl.c.close()
	<-cl.readerDone
	return err
}

// queryState asks for the exporter's State and returns its JSON.
func (cl *client) queryState(ctx context.Context) ([]byte, error) {
	reply, err := cl.request(ctx, func(id uint64) message { return &stateRequestMsg{ReqID: id} }, true)
	if err != nil {
		return nil, fmt.Errorf("export: state: %w", err)
	}
	switch r := reply.(type) {
	case *stateMsg:
		return r.JSON, nil
	case *errorMsg:
		return nil, fmt.Errorf("export: state: %w", replyErr(r))
	}
	return nil, fmt.Errorf("%w: StateRequest answered with %s", ErrProtocol, reply.kind())
}
