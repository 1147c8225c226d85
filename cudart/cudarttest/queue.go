package cudarttest

import (
	"errors"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"time"

	"github.com/cudapool/cudapool/cudart"
)

// SeedEnv names the environment variable that sets the seed of every Device made
// without WithSeed, so that a failing interleaving can be replayed. A value that is not
// a decimal uint64 is ignored.
const SeedEnv = "CUDAPOOL_SOFTDEV_SEED"

// maxQueued bounds the work queued on one stream: a call that would queue more waits
// for the stream to run some, as the real driver blocks the host when its push buffer
// is full.
const maxQueued = 1024

// pendingEpoch is the write mark of an allocation whose cudaMallocFromPoolAsync has
// not run yet: no access from another stream is ordered after it.
const pendingEpoch = ^uint64(0) >> 1

// A task is one piece of work queued on a stream. run does it with d.mu held; after is
// the epoch up to which the work of other streams is ordered before it: when it was
// queued (the host had seen whatever had completed by then) or the completion of the
// latest event its stream waited on, whichever is later.
type task struct {
	submitted uint64
	run       func(st *stream, after uint64) error
	// ready is nil for work that can always run; a wait on an event or a Stall is not
	// ready until the event completes or the stall is resumed.
	ready func() bool
	// done, if not nil, receives run's error: the caller is waiting for the op.
	done chan error
	pool *pool // kept mapped until the op has run
}

// seedFrom picks a Device's seed: the option's, else $CUDAPOOL_SOFTDEV_SEED, else a
// random one.
func seedFrom(cfg config) uint64 {
	if cfg.seed != nil {
		return *cfg.seed
	}
	if s, err := strconv.ParseUint(os.Getenv(SeedEnv), 10, 64); err == nil {
		return s
	}
	return rand.Uint64()
}

// submit queues o on st and, in immediate mode, waits for it. With done set (by the
// caller, or here in immediate mode) it returns o's error once o has run; otherwise
// nil at once. A full queue makes the host wait, as the driver does. d.mu is held on
// entry and on return, but is released while waiting.
func (d *Device) submit(opName string, st *stream, o *task) error {
	for len(st.queue) >= maxQueued {
		if err := d.waitProgress(opName); err != nil {
			return err
		}
	}
	if d.cfg.immediate && o.done == nil {
		o.done = make(chan error, 1)
	}
	o.submitted = now()
	if o.pool != nil {
		o.pool.pending++
	}
	if len(st.queue) == 0 {
		d.active = append(d.active, st)
	}
	st.queue = append(st.queue, o)
	d.queued++
	if !d.working {
		d.working = true
		d.workers.Add(1)
		go d.work()
	} else {
		kick(d.kick)
	}
	if o.done == nil {
		return nil
	}
	d.mu.Unlock()
	var err error
	select {
	case err = <-o.done:
	case <-d.stop:
		err = errClosed(opName)
	}
	d.mu.Lock()
	return err
}

// waitProgress waits, with d.mu released, until the worker has run some work, for at
// most a moment (so that a condition set by another Device, which does not notify this
// one, is seen too). It fails once the Device is closed.
func (d *Device) waitProgress(opName string) error {
	ch := d.progress
	d.mu.Unlock()
	t := time.NewTimer(pollInterval)
	select {
	case <-ch:
	case <-t.C:
	case <-d.stop:
	}
	t.Stop()
	d.mu.Lock()
	if d.closed {
		return errClosed(opName)
	}
	return nil
}

// pollInterval is how often a stream blocked on another Device's event looks again:
// that event completes in another process or under another Device's lock, which do
// not notify this one.
const (
	pollInterval    = 200 * time.Microsecond
	maxPollInterval = 5 * time.Millisecond
)

func kick(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// work runs queued work until none is left: it picks, at random (from the Device's
// seed), one of the streams whose next op can run, sometimes after a random delay that
// lets the host and the other streams get ahead, and runs that op.
func (d *Device) work() {
	defer d.workers.Done()
	d.mu.Lock()
	defer d.mu.Unlock()
	idle := pollInterval
	for !d.closed {
		st := d.pick()
		if st == nil {
			if d.queued == 0 {
				d.working = false
				return
			}
			// Blocked on stalls or on other Devices' events: look again after a while,
			// longer each time nothing changes, sooner when kicked.
			d.mu.Unlock()
			t := time.NewTimer(idle)
			select {
			case <-d.kick:
				idle = pollInterval
			case <-t.C:
				idle = min(2*idle, maxPollInterval)
			case <-d.stop:
			}
			t.Stop()
			d.mu.Lock()
			continue
		}
		idle = pollInterval
		if d.lag() {
			continue
		}
		o := st.queue[0]
		st.queue[0] = nil
		st.queue = st.queue[1:]
		d.queued--
		if len(st.queue) == 0 {
			st.queue = nil
			d.active = slices.DeleteFunc(d.active, func(s *stream) bool { return s == st })
		}
		err := o.run(st, max(o.submitted, st.waited))
		if o.pool != nil {
			o.pool.pending--
			d.dropPool(o.pool)
		}
		switch {
		case o.done != nil:
			o.done <- err
		case err != nil:
			st.faults = append(st.faults, err)
		}
		close(d.progress)
		d.progress = make(chan struct{})
	}
}

// Synchronize waits until the work queued so far on every stream of the Device has run,
// as cudaDeviceSynchronize does (so it waits for stalls to be resumed too), and
// returns the violations that work found that no call has returned yet.
func (d *Device) Synchronize() error {
	const opName = "cudaDeviceSynchronize"
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return errClosed(opName)
	}
	for _, st := range slices.Clone(d.active) {
		err := d.submit(opName, st, &task{done: make(chan error, 1), run: func(*stream, uint64) error { return nil }})
		if err != nil {
			return err
		}
	}
	var errs []error
	for _, st := range d.allStreams() {
		errs = append(errs, faultsOf(st))
	}
	return errors.Join(errs...)
}

// allStreams lists the default streams and the created ones.
func (d *Device) allStreams() []*stream {
	sts := make([]*stream, 0, len(d.devs)+len(d.streams))
	for _, dev := range d.devs {
		sts = append(sts, dev.defaultStream)
	}
	for _, st := range d.streams {
		sts = append(sts, st)
	}
	return sts
}

// settle waits until no queued work can run. d.mu is held.
func (d *Device) settle() {
	for !d.closed && d.runnable() != nil {
		if d.waitProgress("settle") != nil {
			return
		}
	}
}

// runnable lists the streams whose next op can run.
func (d *Device) runnable() []*stream {
	var rs []*stream
	for _, st := range d.active {
		if r := st.queue[0].ready; r == nil || r() {
			rs = append(rs, st)
		}
	}
	return rs
}

// pick returns a random stream among those whose next op can run, or nil.
func (d *Device) pick() *stream {
	runnable := d.runnable()
	if len(runnable) == 0 {
		return nil
	}
	return runnable[d.rng.IntN(len(runnable))]
}

// lag sometimes lets the worker fall behind: it releases d.mu for a yield or a short
// sleep and reports true; the caller then picks again.
func (d *Device) lag() bool {
	if d.cfg.immediate {
		return false
	}
	r := d.rng.IntN(16)
	if r < 10 {
		return false
	}
	var sleep time.Duration
	if r >= 14 {
		sleep = time.Duration(d.rng.IntN(300)) * time.Microsecond
	}
	d.mu.Unlock()
	if sleep > 0 {
		t := time.NewTimer(sleep)
		select {
		case <-t.C:
		case <-d.stop:
		}
		t.Stop()
	} else {
		time.Sleep(0)
	}
	d.mu.Lock()
	return true
}

// faultsOf returns and forgets the errors of st's work that ran since the last call
// that reported them, as one error; nil if there were none.
func faultsOf(st *stream) error {
	err := errors.Join(st.faults...)
	st.faults = nil
	return err
}

// Seed is the seed of this Device's interleavings: New with WithSeed(d.Seed()), or
// $CUDAPOOL_SOFTDEV_SEED set to it, replays them as far as the host's own timing lets.
func (d *Device) Seed() uint64 { return d.seed }

// Stall queues work on s that runs until resume is called: a long kernel, so that a
// test can see what waits for it (events recorded after it stay incomplete, streams
// waiting on them stay blocked, host calls that synchronise with it block). resume may
// be called more than once; Close ends every stall, with the rest of the queued work. It fails in immediate mode,
// where the call itself would wait for the stall.
func (d *Device) Stall(dev int, s cudart.Stream) (resume func(), err error) {
	const opName = "stall"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(opName, dev); err != nil {
		return nil, err
	}
	if d.cfg.immediate {
		return nil, invalid(opName, "an immediate Device runs every call's work before it returns: nothing can stall")
	}
	st, err := d.stream(opName, dev, s)
	if err != nil {
		return nil, err
	}
	stalled := make(chan struct{})
	ready := func() bool {
		select {
		case <-stalled:
			return true
		default:
			return false
		}
	}
	if err := d.submit(opName, st, &task{ready: ready, run: func(*stream, uint64) error { return nil }}); err != nil {
		return nil, err
	}
	var once bool
	return func() {
		d.mu.Lock()
		defer d.mu.Unlock()
		if !once {
			once = true
			close(stalled)
			kick(d.kick)
		}
	}, nil
}

// TB is the part of testing.TB that ForTest uses.
type TB interface {
	Helper()
	Cleanup(func())
	Failed() bool
	Logf(format string, args ...any)
}

// ForTest is New for a test: the Device is closed when the test ends, and if the test
// failed its seed is logged, so that the interleaving can be replayed.
func ForTest(t TB, opts ...Option) *Device {
	t.Helper()
	d := New(opts...)
	t.Cleanup(func() {
		t.Helper()
		if t.Failed() {
			t.Logf("cudarttest: the software device ran with seed %d; replay with %s=%d", d.seed, SeedEnv, d.seed)
		}
		_ = d.Close() // cleanup: nothing is left to do if closing fails
	})
	return d
}
