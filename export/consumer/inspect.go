package consumer

import (
	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/internal/inspect"
	"github.com/cudapool/cudapool/export/internal/wire"
)

func init() {
	inspect.Client = func(imp any) *wire.Client { return imp.(*Importer).cl }
	inspect.ReleaseStream = func(imp any) cudart.Stream { return imp.(*Importer).relStream }
	inspect.DeviceUUID = func(imp any) cudart.UUID { return imp.(*Importer).devUUID }
	inspect.FreesPending = func(imp any) int {
		i := imp.(*Importer)
		i.mapMu.Lock()
		defer i.mapMu.Unlock()
		return len(i.freed)
	}
	inspect.Imports = func(imp any) int {
		i := imp.(*Importer)
		i.mapMu.Lock()
		defer i.mapMu.Unlock()
		return len(i.imports)
	}
	inspect.OrderEvents = func(imp any) int {
		i := imp.(*Importer)
		i.mapMu.Lock()
		defer i.mapMu.Unlock()
		return len(i.orderEvents)
	}
	inspect.RevokedMapped = func(imp any) int {
		i := imp.(*Importer)
		i.mapMu.Lock()
		defer i.mapMu.Unlock()
		n := 0
		for _, buf := range i.imports {
			if buf.revoked && buf.views > 0 {
				n++
			}
		}
		return n
	}
	inspect.MaxIdleOrderEvents = maxIdleOrderEvents
	inspect.ReplicaPool = func(imp any) cudart.MemPool {
		i := imp.(*Importer)
		i.replicas.mu.Lock()
		defer i.replicas.mu.Unlock()
		for _, c := range i.replicas.copiers {
			return c.pool.Handle()
		}
		return 0
	}
}
