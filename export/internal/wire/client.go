package wire

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync/atomic"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/internal/session"
)

// Frame is one frame as a [Client] reads it: the message and the descriptor that came
// with it (-1 if none).
type Frame struct {
	M  Message
	FD int
}

// Client is the requesting side of an admitted connection, on a [session.Client]: it
// says which frames answer which request (Lease, Released, Error, State and LeaseBatch
// in parts), and hands the others (pool handles, pushes, revokes) to Handle. Both the
// Importer and QueryState talk to an exporter through one.
type Client struct {
	C *Conn
	s *session.Client[Frame]
	// ExporterPID is what the exporter said in Welcome.
	ExporterPID int
	// Handle takes the frames that are not replies, with the descriptor that came with
	// one, which it owns. An error ends the connection.
	Handle func(m Message, fd int) error
	// Unclaimed takes a Lease whose request was given up on; nil drops it.
	Unclaimed func(l *LeaseMsg)
	// Done is closed when the connection ends.
	Done <-chan struct{}

	log *slog.Logger
	// closed: the owner is closing; no new requests.
	closed atomic.Bool
	// bye: the exporter is closing; it takes no new requests but still ends leases.
	bye atomic.Bool
}

func NewClient(c *Conn, log *slog.Logger, exporterPID int) *Client {
	cl := &Client{C: c, log: log, ExporterPID: exporterPID}
	cl.s = session.NewClient[Frame](c.Nc, c, session.Protocol[Frame]{
		ReplyTo: replyTo,
		Push:    cl.push,
		Writer:  c.w,
		Gone:    cl.gone,
		Watch:   session.WatchArrivals,
	})
	cl.Done = cl.s.Done()
	return cl
}

// Start runs the reader; Handle and Unclaimed must be set before.
func (cl *Client) Start() { cl.s.Start() }

// replyTo says which request f answers, and whether it is the reply's last frame.
func replyTo(f Frame) (uint64, bool) {
	switch m := f.M.(type) {
	case *LeaseMsg:
		return m.ReqID, true
	case *ReleasedMsg:
		return m.ReqID, true
	case *ErrorMsg:
		return m.ReqID, true
	case *StateMsg:
		return m.ReqID, m.Flags&StateMore == 0
	case *LeaseBatchMsg:
		return m.ReqID, m.Flags&LeaseBatchMore == 0
	}
	return 0, false
}

// push takes the frames that answer no request waiting.
func (cl *Client) push(f Frame) error {
	switch m := f.M.(type) {
	case *LeaseMsg:
		if cl.Unclaimed != nil {
			// Not sent from here: a reader blocked on a full socket while the
			// exporter blocks writing to it would deadlock.
			go cl.Unclaimed(m)
		}
	case *LeaseBatchMsg:
		cl.GiveBackAll(m.Leases)
	case *ReleasedMsg, *ErrorMsg, *StateMsg:
	case *ByeMsg:
		cl.bye.Store(true)
	default:
		return cl.Handle(f.M, f.FD)
	}
	return nil
}

// gone is the error requests fail with once the connection ended for why.
func (cl *Client) gone(why error) error {
	if errors.Is(why, export.ErrProtocol) {
		cl.log.Warn("cudapool: closing the exporter's connection", "exporter", cl.ExporterPID, "reason", why)
	}
	if errors.Is(why, io.EOF) || errors.Is(why, net.ErrClosed) {
		return fmt.Errorf("%w: the connection closed", export.ErrExporterGone)
	}
	return fmt.Errorf("%w: %w", export.ErrExporterGone, why)
}

// Fail ends the connection: every waiting request and every later one fails with
// ErrExporterGone.
func (cl *Client) Fail(err error) { cl.s.Fail(err) }

// GiveBackAll hands leases nobody waits for to Unclaimed, off the reader.
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
// up on goes to Unclaimed. A State or LeaseBatch in parts is returned whole; one past
// its bound is an Error reply.
func (cl *Client) Request(ctx context.Context, build func(reqID uint64) Message, isNew bool) (Message, error) {
	if err := cl.s.Err(); err != nil {
		return nil, err
	}
	switch {
	case isNew && cl.closed.Load():
		return nil, export.ErrClosed
	case isNew && cl.bye.Load():
		return nil, fmt.Errorf("%w: it is closing", export.ErrExporterGone)
	}
	rq := &request{cl: cl}
	err := cl.s.Call(ctx, func(b []byte, id uint64) ([]byte, error) { return appendChecked(b, build(id)) }, rq)
	if errors.Is(err, errOver) {
		return rq.reply, nil // its later parts go to push
	}
	if err != nil {
		return nil, err
	}
	return rq.reply, nil
}

// request gathers the reply to one request, as its [session.Handler].
type request struct {
	cl     *Client
	reply  Message
	state  []byte     // a State in parts
	leases []LeaseMsg // a LeaseBatch in parts
}

// Handle takes one frame of the reply: a State or LeaseBatch is gathered to its
// bound, leases nobody waits for any more are given back.
func (rq *request) Handle(f Frame, claimed bool) error {
	cl := rq.cl
	switch m := f.M.(type) {
	case *StateMsg:
		if rq.state = append(rq.state, m.JSON...); len(rq.state) > MaxStateBytes {
			rq.reply = &ErrorMsg{ReqID: m.ReqID, Code: codeExporter, Text: fmt.Sprintf("%v: State larger than %s", export.ErrProtocol, humanize.IBytes(MaxStateBytes))}
			return errOver
		}
		if m.Flags&StateMore == 0 {
			rq.reply = &StateMsg{ReqID: m.ReqID, JSON: rq.state}
		}
		return nil
	case *LeaseBatchMsg:
		rq.leases = append(rq.leases, m.Leases...)
		switch {
		case len(rq.leases) > export.MaxBatch:
			cl.GiveBackAll(rq.leases)
			rq.reply = &ErrorMsg{ReqID: m.ReqID, Code: codeExporter, Text: fmt.Sprintf("%v: LeaseBatch of more than %d leases", export.ErrProtocol, export.MaxBatch)}
			return errOver
		case !claimed:
			cl.GiveBackAll(rq.leases)
			rq.leases = nil
		case m.Flags&LeaseBatchMore == 0:
			rq.reply = &LeaseBatchMsg{ReqID: m.ReqID, Leases: rq.leases}
		}
		return nil
	case *LeaseMsg:
		if !claimed {
			if cl.Unclaimed != nil {
				go cl.Unclaimed(m) // off the reader, as push says
			}
			return nil
		}
	}
	rq.reply = f.M
	return nil
}

// errOver ends a reply in parts that grew past its bound: reply is an Error.
var errOver = errors.New("wire: the reply grew past its bound")

// GoneOr is why the connection ended, or err while it carries requests.
func (cl *Client) GoneOr(err error) error {
	if down := cl.s.Err(); down != nil {
		return down
	}
	return err
}

// Close refuses new requests from now on; it reports whether this call closed it.
func (cl *Client) Close() bool { return !cl.closed.Swap(true) }

// IsClosed reports whether close was called.
func (cl *Client) IsClosed() bool { return cl.closed.Load() }

// Gone reports whether the connection ended or the exporter said Bye.
func (cl *Client) Gone() bool { return cl.s.Err() != nil || cl.bye.Load() }

// SaidBye reports whether the exporter said Bye.
func (cl *Client) SaidBye() bool { return cl.bye.Load() }

// ReaderDone is closed when the reader has returned, after the connection ended.
func (cl *Client) ReaderDone() <-chan struct{} { return cl.s.ReaderDone() }

// HangUp says Bye and waits, until ctx ends, for the exporter to close the connection
// (it may still be ending leases as of this side's release event), then closes it and
// waits for the reader.
func (cl *Client) HangUp(ctx context.Context) error {
	var err error
	if cl.C.Send(ctx, &ByeMsg{}, -1) == nil {
		select {
		case <-cl.s.ReaderDone():
		case <-ctx.Done():
			err = fmt.Errorf("the exporter did not hang up: %w", ctx.Err())
		}
	}
	cl.s.Fail(net.ErrClosed)
	<-cl.s.ReaderDone()
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
