package owner

import "github.com/cudapool/cudapool/cudart"

// SetFreeMemory makes the give-back read devices' free memory from f, until the
// returned func undoes it.
func SetFreeMemory(f func(dev int) (uint64, error)) (undo func()) {
	old := freeMemory.Load()
	g := func(_ cudart.Runtime, dev int) (uint64, error) { return f(dev) }
	freeMemory.Store(&g)
	return func() { freeMemory.Store(old) }
}

// GiveBackTicks is how many times the give-back has looked at device dev's slab.
func GiveBackTicks(o *Owner, dev int) uint64 { return o.byDev[dev].gb.ticks.Load() }
