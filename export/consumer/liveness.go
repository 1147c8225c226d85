package consumer

import (
	"fmt"
	"net"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/internal/peercred"
)

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
			case <-imp.cl.Done:
			case <-imp.life.Done():
				return
			}
		}
		close(imp.watch.gone)
		imp.loseMappings()
	}()
	go func() {
		// Once the connection has ended no lease can come: the kept chunks go, and only
		// the mappings hold the exporter's memory (the exporter may live on, closed).
		select {
		case <-imp.cl.Done:
			imp.dropAllChunks()
		case <-imp.life.Done():
		}
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
	case <-imp.cl.Done:
		return true
	default:
		return false
	}
}

// goneErr is the error of a request made as the exporter died.
func (imp *Importer) goneErr(what string) error {
	return fmt.Errorf("%w: its process exited %s", export.ErrExporterGone, what)
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
// it (FACTS 7); those on another GPU end with their Context ([ErrMappingLost]).
func (imp *Importer) Done() <-chan struct{} { return imp.cl.Done }

// Err is nil while the connection to the exporter carries requests, and afterwards
// says why it ended; it wraps [export.ErrExporterGone].
func (imp *Importer) Err() error {
	select {
	case <-imp.cl.Done:
		return imp.cl.GoneOr(nil)
	default:
		return nil
	}
}
