package export

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"

	"github.com/cudapool/cudapool/internal/peercred"
)

// The Importer's side of the exporter's death. On the exporter's own GPU its mappings
// stay readable (FACTS 7); on another GPU a read of them after the exporter died is
// contained by the driver and costs the whole process its CUDA context (FACTS 14). So
// the Importer watches the exporter's process and, the moment it is gone, ends the
// context of every Mapping on another GPU (ErrMappingLost), and refuses to wait on the
// dead process's events: a user selecting on Done or on a Mapping's Context stops in
// time instead of finding out by a cudaErrorContained.

// exporterWatch is what the Importer knows of its exporter's process.
type exporterWatch struct {
	// proc is the exporter's process, opened at the handshake from the socket's
	// credentials; nil on a byte stream or where it cannot be watched, and then the
	// connection's end stands for the process's.
	proc *peercred.Process
	// gone is closed once the exporter's process exited, or the connection ended
	// where the process cannot be watched.
	gone chan struct{}
}

// watchExporter opens the exporter's process and starts the goroutine that acts on its
// exit. Call once the client runs.
func (imp *Importer) watchExporter(nc net.Conn) {
	imp.watch.gone = make(chan struct{})
	if uc, ok := nc.(*net.UnixConn); ok {
		if cred, err := peercred.Get(uc); err == nil {
			imp.watch.proc, _ = peercred.OpenProcess(cred.PID)
		}
	}
	go func() {
		if p := imp.watch.proc; p != nil {
			if err := p.Wait(imp.life); err != nil && imp.life.Err() != nil {
				return // Close: the Importer is done with its mappings
			}
		} else {
			select {
			case <-imp.cl.done:
			case <-imp.life.Done():
				return
			}
		}
		close(imp.watch.gone)
		imp.loseMappings()
	}()
}

// exporterDead reports whether the exporter's process is known to have exited (or, where
// it cannot be watched, its connection ended). It asks the kernel now, not the watching
// goroutine, so that an Open in flight sees a death as soon as the kernel does.
func (imp *Importer) exporterDead() bool {
	select {
	case <-imp.watch.gone:
		return true
	default:
	}
	if p := imp.watch.proc; p != nil {
		exited, err := p.Exited()
		return exited || err != nil
	}
	select {
	case <-imp.cl.done:
		return true
	default:
		return false
	}
}

// goneErr is the error of a request made as the exporter died.
func (imp *Importer) goneErr(what string) error {
	return fmt.Errorf("%w: its process exited %s", ErrExporterGone, what)
}

// loseMappings ends the contexts of the mappings on another GPU than the exporter's:
// their memory is unreachable from here now.
func (imp *Importer) loseMappings() {
	imp.mapMu.Lock()
	defer imp.mapMu.Unlock()
	for _, m := range imp.mappings {
		if m.onPeer {
			m.end(ErrMappingLost)
		}
	}
}

// Done is closed when the connection to the exporter has ended: the exporter's
// process exited, crashed or closed the connection. Select on it to stop work that
// needs the exporter; Err says why. Mappings on the exporter's GPU stay usable after
// it (FACTS 7); those on another GPU end with their Context (ErrMappingLost).
func (imp *Importer) Done() <-chan struct{} { return imp.cl.done }

// Err is nil while the connection to the exporter carries requests, and afterwards
// says why it ended; it wraps ErrExporterGone.
func (imp *Importer) Err() error {
	select {
	case <-imp.cl.done:
		return imp.cl.goneOr(nil)
	default:
		return nil
	}
}

// Context is done once the Mapping must not be used any more: after its last Release
// (the cause is ErrReleased) and, for a Mapping on another GPU than its exporter's,
// the moment the exporter's process is gone (the cause is ErrMappingLost: reading the
// memory then would lose this process's CUDA context). Derive the contexts of work
// that reads the Mapping from it; context.Cause says which.
func (m *Mapping) Context() context.Context {
	l := &m.life
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ctx == nil {
		l.ctx, l.cancel = context.WithCancelCause(context.Background())
		if l.cause != nil {
			l.cancel(l.cause)
		}
	}
	return l.ctx
}

// Err is nil while the Mapping may be used, and otherwise why not: ErrMappingLost
// (wrapping ErrExporterGone) for a Mapping on another GPU whose exporter is gone,
// ErrReleased once it was released. A lost Mapping must still be released, which
// frees its import without touching the memory.
func (m *Mapping) Err() error {
	m.life.mu.Lock()
	defer m.life.mu.Unlock()
	return m.life.cause
}

// mappingLife is a Mapping's end and its cause. The context is made only for a caller
// of Context: a Mapping is made per block of a batch, and most are never asked.
type mappingLife struct {
	mu     sync.Mutex
	cause  error
	ctx    context.Context
	cancel context.CancelCauseFunc
}

// end ends the Mapping's context with cause, unless it has ended already.
func (m *Mapping) end(cause error) {
	l := &m.life
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cause != nil {
		return
	}
	l.cause = cause
	if l.cancel != nil {
		l.cancel(cause)
	}
}

// errReleasedCause is the cause of a released Mapping's context.
var errReleasedCause = fmt.Errorf("%w: the mapping was released", ErrReleased)

var _ = errors.Is
