package cudarttest

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// An ident names a Device instance across processes: pid<<32 | nonce. Two Devices in
// one process stand for two processes, so the pid alone cannot tell them apart.
type ident uint64

func (id ident) pid() int       { return int(id >> 32) }
func (id ident) nonce() uint32  { return uint32(id) }
func (id ident) String() string { return fmt.Sprintf("pid %d device #%d", id.pid(), id.nonce()) }

// openInstances holds the nonces of this process's Devices that are not closed.
var openInstances struct {
	sync.Mutex
	next  uint32
	nonce map[uint32]bool
}

func registerInstance() ident {
	openInstances.Lock()
	defer openInstances.Unlock()
	if openInstances.nonce == nil {
		openInstances.nonce = map[uint32]bool{}
	}
	openInstances.next++
	openInstances.nonce[openInstances.next] = true
	return ident(uint64(os.Getpid())<<32 | uint64(openInstances.next))
}

func unregisterInstance(id ident) {
	openInstances.Lock()
	defer openInstances.Unlock()
	delete(openInstances.nonce, id.nonce())
}

// alive reports whether the Device id still runs: in this process, while it is not
// closed; in another, while that process exists and is not a zombie (a process that
// died has had its mappings torn down, as the driver tears down its imports). A
// Device closed in another, still running, process clears its own importer slots and
// marks its exported pools, so the pid is enough there.
func (id ident) alive() bool {
	if id.pid() == os.Getpid() {
		openInstances.Lock()
		defer openInstances.Unlock()
		return openInstances.nonce[id.nonce()]
	}
	if err := unix.Kill(id.pid(), 0); err == unix.ESRCH {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", id.pid()))
	if err != nil {
		return false
	}
	// The state follows the last ')' (the command name may contain one).
	if i := bytes.LastIndexByte(stat, ')'); i >= 0 && i+2 < len(stat) {
		switch stat[i+2] {
		case 'Z', 'X', 'x':
			// The state is the leader thread's, a zombie as soon as that thread
			// exits; the process has exited once its other threads have too, which
			// is when its pidfd reads ready (how export watches a peer). Saying
			// "exited" earlier would fail a use the watcher could not have foreseen.
			tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", id.pid()))
			return err == nil && len(tasks) > 1
		}
	}
	return true
}

// lastEpoch makes epochs strictly increasing within the process, so a write and an
// event recorded after it never share a timestamp.
var lastEpoch atomic.Uint64

// now is the current epoch: CLOCK_MONOTONIC nanoseconds, comparable across processes
// on one host.
func now() uint64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic("cudarttest: clock_gettime: " + err.Error())
	}
	t := uint64(ts.Nano())
	for {
		last := lastEpoch.Load()
		if t <= last {
			t = last + 1
		}
		if lastEpoch.CompareAndSwap(last, t) {
			return t
		}
	}
}

// addressSpace hands out device address ranges. It starts at a random 4 TiB-aligned
// point so that ranges of different processes practically never overlap; an import
// that would overlap fails cleanly with ErrAddressOverlap.
var addressSpace struct {
	sync.Mutex
	next uint64
}

const addressAlign = 1 << 30

func reserveAddresses(size uint64) uint64 {
	addressSpace.Lock()
	defer addressSpace.Unlock()
	if addressSpace.next == 0 {
		addressSpace.next = (1<<16 + rand.Uint64N(1<<20-1<<16)) << 42 // between 2^58 and 2^62
	}
	base := addressSpace.next
	addressSpace.next += roundUp(size, addressAlign) + addressAlign // a gap catches overruns
	return base
}
