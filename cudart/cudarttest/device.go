// Package cudarttest owns the software device: a cudart.Runtime without a GPU, whose
// device memory is shared host memory (one memfd per pool), so that pools exported as
// POSIX descriptors really cross Unix sockets into other processes and are read and
// written by both.
//
// It reproduces the driver behaviour measured in FACTS.md that the layers above must
// cope with (sub-allocation packing, stale export records accepted, double imports
// aliasing one mapping, imported pools that cannot allocate, FABRIC refused, maxSize)
// and it checks the rules the real driver leaves undefined: each broken rule is a
// Violation, returned by the call that broke it (wrapping ErrViolation) and kept in
// Device.Violations. A violation is never silent.
//
// Two Devices in one process behave like two processes: each has its own pools,
// imports, streams and events, and Close simulates its process exiting.
//
// # Deferred execution
//
// Streams are queues, run later by a worker of the Device that picks among the streams
// whose next op can run at random, from a seed, and sometimes lags behind the host, so
// that work runs in many interleavings. An event completes when its stream reaches it;
// EventQuery says whether it has; StreamWaitEvent holds a stream until the event's last
// record has run; the synchronising calls (StreamSynchronize, EventSynchronize and the
// copies to host memory) wait for the work they synchronise with. Stall holds a stream
// as a long kernel would, so a test can make the GPU busy.
//
// Every access and free is checked when it runs, against what has run on every stream
// of every Device, in this process and others: an access is ordered after work of
// another stream that had completed when the access was queued, or before the
// completion of an event its stream waited on. Reading or overwriting memory another
// stream wrote, or overwriting or freeing memory another stream read, without that
// order is a violation (ViolationUnorderedRead, ViolationUnorderedWrite,
// ViolationUnorderedFree); so is touching memory whose free has run. A violation found
// by work that ran after its call returned is kept in Violations and returned by the
// next call that synchronises with that stream (StreamSynchronize, a copy to host
// memory on it, Synchronize), as CUDA reports asynchronous errors.
//
// Host memory registered with HostRegister is addressed at its own address, as the
// driver maps it with unified addressing, and its accesses by streams are checked as
// device memory's are, within the Device that registered it. MemcpyBatchAsync runs a
// batch as one op, as the GPU runs it as one kernel launch, and refuses pieces that
// overlap where one writes.
//
// The VMM route (cudart.VMM) is modelled too: a chunk is a memfd whose descriptor is
// its POSIX handle, a reservation is addresses of the process, a mapping an mmap of
// the chunk there (vmm.go says what is checked).
//
// Each Device has a seed (WithSeed, else $CUDAPOOL_SOFTDEV_SEED, else random); every
// violation names it, and ForTest logs it when a test fails. WithImmediate gives the
// old behaviour, for the few tests that need it: every call's work runs before the call
// returns, so no access can ever be unordered.
package cudarttest

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/cudapool/cudapool/cudart"
)

// Option configures New.
type Option func(*config)

type config struct {
	devices     int
	granularity uint64
	memory      uint64
	fabric      bool
	peerAccess  bool
	immediate   bool
	seed        *uint64
	free        *FreeSchedule // WithFreeSchedule or $CUDAPOOL_SOFTDEV_FREE (free.go)
	freeErr     error         // a schedule that does not parse: MemGetInfo's error
}

// WithDevices sets the number of devices (default 2). n < 1 means 1.
func WithDevices(n int) Option { return func(c *config) { c.devices = max(n, 1) } }

// WithGranularity sets the allocation granularity (default 2 MiB, as measured). It is
// rounded up to a multiple of 512 bytes.
func WithGranularity(g uint64) Option {
	return func(c *config) { c.granularity = max(roundUp(g, allocAlign), allocAlign) }
}

// WithMemory sets each device's memory (default 16 GiB). It is virtual: pool memfds
// are sparse, so only bytes actually written cost host memory.
func WithMemory(bytes uint64) Option { return func(c *config) { c.memory = bytes } }

// WithFabric lets FABRIC pools be exported and imported; without it their export
// fails with cudart.ErrNotPermitted, as on a host without IMEX (FACTS 11).
func WithFabric() Option { return func(c *config) { c.fabric = true } }

// WithPeerAccess sets whether devices can access each other (default true).
func WithPeerAccess(ok bool) Option { return func(c *config) { c.peerAccess = ok } }

// WithSeed sets the seed of the Device's interleavings (default: $CUDAPOOL_SOFTDEV_SEED,
// else random).
func WithSeed(seed uint64) Option { return func(c *config) { c.seed = &seed } }

// WithImmediate makes every call run its work before it returns, as the software
// device did before it deferred work: events are complete once recorded, violations
// are returned by the call that made them, and no access can be unordered. Use it
// only where a test needs calls to complete at once.
func WithImmediate() Option { return func(c *config) { c.immediate = true } }

// Device is a software CUDA device set implementing cudart.Runtime. Its methods are
// safe for concurrent use.
type Device struct {
	cfg  config
	id   ident
	born uint64 // now() at New: the free-memory schedule's start

	mu     sync.Mutex
	closed bool
	// lost: a read of a dead process's memory from a peer device lost this Device's
	// context, on device lostOn (FACTS 14); every call fails from then on.
	lost          bool
	lostOn        int
	devs          []devState
	pools         map[cudart.MemPool]*pool // live handles, own and imported
	spans         []*pool                  // pools that map memory, sorted by base
	importedByUID map[uid]*pool
	streams       map[cudart.Stream]*stream
	destroyed     map[cudart.Stream]bool // streams StreamDestroy destroyed: naming one is a violation
	events        map[cudart.Event]*event
	arena         *arena         // this Device's IPC events, created on first use
	remoteArenas  map[uid]*arena // other Devices' IPC events opened here
	violations    []Violation
	hosts         []*hostReg // registered host memory, by address (host.go)
	vmm           vmmState   // the VMM route (vmm.go)

	// Deferred execution (queue.go).
	seed     uint64
	rng      *rand.Rand
	active   []*stream // streams with queued work, in the order they got it
	queued   int       // ops queued on all streams
	working  bool      // a worker runs
	workers  sync.WaitGroup
	kick     chan struct{} // wakes an idle worker
	stop     chan struct{} // closed by Close
	progress chan struct{} // closed and replaced each time an op has run
}

type devState struct {
	reserved      uint64 // bytes reserved by this Device's own pools on the device
	defaultPool   *pool
	defaultStream *stream
}

var _ cudart.Runtime = (*Device)(nil)

// New returns an open software device. Close it when done: it holds memfds and
// mappings.
func New(opts ...Option) *Device {
	cfg := config{devices: 2, granularity: 2 << 20, memory: 16 << 30, peerAccess: true}
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	freeFromEnv(&cfg)
	seed := seedFrom(cfg)
	d := &Device{
		cfg:           cfg,
		born:          now(),
		seed:          seed,
		rng:           rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15)),
		kick:          make(chan struct{}, 1),
		stop:          make(chan struct{}),
		progress:      make(chan struct{}),
		id:            registerInstance(),
		devs:          make([]devState, cfg.devices),
		pools:         map[cudart.MemPool]*pool{},
		importedByUID: map[uid]*pool{},
		streams:       map[cudart.Stream]*stream{},
		destroyed:     map[cudart.Stream]bool{},
		events:        map[cudart.Event]*event{},
		remoteArenas:  map[uid]*arena{},
	}
	for i := range d.devs {
		d.devs[i].defaultStream = &stream{dev: i, id: uint64(newHandle())}
	}
	return d
}

// Close simulates this Device's process exiting: work still queued never runs, its
// imports are dropped (as the driver drops them at exit), its events die, and its own
// pools stay readable by the Devices that imported them (FACTS 7). Every later call
// fails with ErrClosed, and calls waiting for work return it. Close returns once the
// worker has stopped. Closing twice is a no-op.
func (d *Device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	close(d.stop)
	for _, st := range d.active {
		st.queue = nil
	}
	d.active, d.queued = nil, 0
	d.mu.Unlock()
	d.workers.Wait()
	d.mu.Lock()
	defer d.mu.Unlock()
	unregisterInstance(d.id)
	for _, p := range d.spans {
		if p.imported {
			for _, imp := range p.imports {
				p.releaseSlot(imp)
			}
		} else {
			p.reg.store(hExporterGone, 1)
		}
		p.reg.release()
	}
	d.closeVMM()
	if d.arena != nil {
		d.arena.kill()
	}
	for _, a := range d.remoteArenas {
		a.reg.release()
	}
	d.spans, d.pools, d.importedByUID, d.streams, d.events, d.remoteArenas, d.arena = nil, nil, nil, nil, nil, nil, nil
	return nil
}

// ContextLost reports whether this Device's context is lost: it read memory of a
// process that had died from a device other than the memory's own, and every call
// fails since, as the driver fails them (FACTS 14).
func (d *Device) ContextLost() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.lost
}

// Violations returns every violation this Device has seen, oldest first, once the
// work queued so far has run, except work that cannot run yet (behind a Stall, or
// waiting on an event that has not completed).
func (d *Device) Violations() []Violation {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.settle()
	return slices.Clone(d.violations)
}

// Err is errors.Join of Violations; nil if there were none.
func (d *Device) Err() error {
	vs := d.Violations()
	errs := make([]error, len(vs))
	for i, v := range vs {
		errs[i] = v
	}
	return errors.Join(errs...)
}

// violate records a violation and returns it.
func (d *Device) violate(kind ViolationKind, op, format string, args ...any) Violation {
	v := Violation{Kind: kind, Op: op, Detail: fmt.Sprintf(format, args...), Seed: d.seed}
	d.violations = append(d.violations, v)
	return v
}

// violationErr is the error for a call that saw vs; code is what the real driver would
// have returned, or 0 where it would have succeeded.
func violationErr(op string, code cudart.Code, vs ...Violation) error {
	e := &callError{violations: vs}
	if code != 0 {
		e.cuda = cudart.NewError(op, code)
	}
	return e
}

// nextHandle numbers streams, events and pools process-wide, so a handle passed to
// the wrong Device is unknown there rather than someone else's.
var nextHandle atomic.Uint64

func init() { nextHandle.Store(0x5ca1ab1e0000) }

func newHandle() uintptr { return uintptr(nextHandle.Add(16)) }

// enter checks what every call checks first; d.mu is held.
func (d *Device) enter(op string, dev int) error {
	if d.closed {
		return errClosed(op)
	}
	if dev < 0 || dev >= d.cfg.devices {
		return fail(op, cudart.ErrInvalidDevice)
	}
	if d.lost {
		return d.errLost(op, dev)
	}
	return nil
}

func (d *Device) Name() string { return "cudarttest software device" }

// DriverVersion and RuntimeVersion report CUDA 13.0, the measured host's.
func (d *Device) DriverVersion() (int, error)  { return 13000, nil }
func (d *Device) RuntimeVersion() (int, error) { return 13000, nil }

func (d *Device) DeviceCount() (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return 0, errClosed("cudaGetDeviceCount")
	}
	if d.lost {
		return 0, d.errLost("cudaGetDeviceCount", d.lostOn)
	}
	return d.cfg.devices, nil
}

func (d *Device) DeviceAttribute(dev int, attr cudart.DeviceAttr) (int, error) {
	const op = "cudaDeviceGetAttribute"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return 0, err
	}
	switch attr {
	case cudart.DevAttrPciBusID:
		return pciBus(dev), nil
	case cudart.DevAttrPciDeviceID, cudart.DevAttrPciDomainID:
		return 0, nil
	case cudart.DevAttrComputeCapabilityMajor:
		return 9, nil
	case cudart.DevAttrComputeCapabilityMinor:
		return 0, nil
	case cudart.DevAttrMemoryPoolsSupported:
		return 1, nil
	case cudart.DevAttrMemoryPoolSupportedHandles:
		return int(cudart.HandleTypePosixFD | cudart.HandleTypeFabric), nil
	}
	return 0, fail(op, cudart.ErrInvalidValue)
}

func pciBus(dev int) int { return 0x18 + 0x10*dev }

// DeviceUUID is derived from the ordinal alone, so every Device and every process
// agrees on which physical device an ordinal is, as they would on one host.
func (d *Device) DeviceUUID(dev int) (cudart.UUID, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter("cudaDeviceGetUuid", dev); err != nil {
		return cudart.UUID{}, err
	}
	sum := sha256.Sum256(fmt.Appendf(nil, "cudarttest device %d", dev))
	var u cudart.UUID
	copy(u[:], sum[:])
	return u, nil
}

func (d *Device) DevicePCIBusID(dev int) (string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter("cudaDeviceGetPCIBusId", dev); err != nil {
		return "", err
	}
	return fmt.Sprintf("0000:%02X:00.0", pciBus(dev)), nil
}

// DeviceCanAccessPeer is false for a device and itself, as CUDA answers.
func (d *Device) DeviceCanAccessPeer(dev, peer int) (bool, error) {
	const op = "cudaDeviceCanAccessPeer"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return false, err
	}
	if err := d.enter(op, peer); err != nil {
		return false, err
	}
	return dev != peer && d.cfg.peerAccess, nil
}

// MemGetInfo counts what this Device's own pools and chunks reserve on dev as used,
// and reports less free where a free-memory schedule says so (WithFreeSchedule).
func (d *Device) MemGetInfo(dev int) (free, total uint64, err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter("cudaMemGetInfo", dev); err != nil {
		return 0, 0, err
	}
	free, err = d.scheduledFree(dev, d.cfg.memory-d.devs[dev].reserved)
	if err != nil {
		return 0, 0, err
	}
	return free, d.cfg.memory, nil
}

// AllocationGranularity is the configured granularity, minimum and recommended alike
// (as measured).
func (d *Device) AllocationGranularity(dev int, ht cudart.HandleType, recommended bool) (uint64, error) {
	const op = "cuMemGetAllocationGranularity"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return 0, err
	}
	if ht&^supportedHandles != 0 {
		return 0, fail(op, cudart.ErrInvalidValue)
	}
	return d.cfg.granularity, nil
}

const supportedHandles = cudart.HandleTypePosixFD | cudart.HandleTypeFabric
