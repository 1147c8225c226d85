package cudarttest

import (
	"encoding/binary"
	"fmt"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
)

// A stream is a queue of work that the Device's worker runs (queue.go). What it keeps
// besides is how far it has been ordered after other streams' work: the completion
// epoch of the latest event it waited on.
type stream struct {
	dev    int
	id     uint64 // names the stream in the write and read marks of memory
	queue  []*task
	waited uint64
	faults []error // of work that ran after its call returned, not yet reported
}

// stream resolves s on dev; the legacy, per-thread and null streams are dev's default
// stream (which here does not synchronise with other streams). d.mu is held.
func (d *Device) stream(op string, dev int, s cudart.Stream) (*stream, error) {
	if s <= 2 { // 0, cudaStreamLegacy, cudaStreamPerThread
		return d.devs[dev].defaultStream, nil
	}
	st, ok := d.streams[s]
	if !ok || st.dev != dev {
		return nil, d.unknownStream(op, s)
	}
	return st, nil
}

// unknownStream is the error of a call naming s, which is not a live stream of the
// call's device: a violation where s was destroyed (the driver's handle is freed
// memory then, and it may crash), else ErrInvalidResourceHandle. d.mu is held.
func (d *Device) unknownStream(op string, s cudart.Stream) error {
	if d.destroyed[s] {
		return violationErr(op, cudart.ErrInvalidResourceHandle,
			d.violate(ViolationUseAfterRelease, op, "stream %#x was destroyed", uintptr(s)))
	}
	return fail(op, cudart.ErrInvalidResourceHandle)
}

func (d *Device) StreamCreate(dev int, flags cudart.StreamFlags) (cudart.Stream, error) {
	const op = "cudaStreamCreateWithFlags"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return 0, err
	}
	if flags&^cudart.StreamNonBlocking != 0 {
		return 0, fail(op, cudart.ErrInvalidValue)
	}
	h := cudart.Stream(newHandle())
	d.streams[h] = &stream{dev: dev, id: uint64(h)}
	return h, nil
}

// StreamDestroy destroys a created stream; work queued on it still runs, as with the
// driver. The default streams fail with ErrInvalidResourceHandle.
func (d *Device) StreamDestroy(dev int, s cudart.Stream) error {
	const op = "cudaStreamDestroy"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return err
	}
	if st, ok := d.streams[s]; !ok || st.dev != dev {
		return d.unknownStream(op, s)
	}
	delete(d.streams, s)
	d.destroyed[s] = true
	return nil
}

// StreamSynchronize waits until the work queued on s so far has run, and returns the
// violations that work found (and any earlier work of s whose violations no call has
// returned yet).
func (d *Device) StreamSynchronize(dev int, s cudart.Stream) error {
	const opName = "cudaStreamSynchronize"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(opName, dev); err != nil {
		return err
	}
	st, err := d.stream(opName, dev, s)
	if err != nil {
		return err
	}
	if err := d.submit(opName, st, &task{done: make(chan error, 1), run: func(*stream, uint64) error { return nil }}); err != nil {
		return err
	}
	return faultsOf(st)
}

// StreamQuery reports whether the work queued on s so far has run, queueing nothing:
// work queued after it answers true is ordered after that work, as any call made
// after the host has seen the work complete.
func (d *Device) StreamQuery(dev int, s cudart.Stream) (bool, error) {
	const opName = "cudaStreamQuery"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(opName, dev); err != nil {
		return false, err
	}
	st, err := d.stream(opName, dev, s)
	if err != nil {
		return false, err
	}
	return len(st.queue) == 0, nil
}

// StreamDevice is the device s was created on; the default streams are dev's. Unlike
// the other stream calls it takes a stream of any device, as the driver's does.
func (d *Device) StreamDevice(dev int, s cudart.Stream) (int, error) {
	const opName = "cudaStreamGetDevice"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(opName, dev); err != nil {
		return 0, err
	}
	if s <= 2 { // 0, cudaStreamLegacy, cudaStreamPerThread
		return dev, nil
	}
	st, ok := d.streams[s]
	if !ok {
		return 0, d.unknownStream(opName, s)
	}
	return st.dev, nil
}

// StreamWaitEvent makes the work queued on s from now on wait until e's last record
// (as of this call) has run; an event never recorded is no wait. Waiting on an
// imported event whose owner destroyed it, or that died, is a ViolationUseAfterRelease;
// an owner that dies while s waits ends the wait.
func (d *Device) StreamWaitEvent(dev int, s cudart.Stream, e cudart.Event) error {
	const opName = "cudaStreamWaitEvent"
	d.mu.Lock()
	defer d.mu.Unlock()
	st, ev, err := d.streamAndEvent(opName, dev, s, e)
	if err != nil {
		return err
	}
	seq := ev.recorded()
	if seq == 0 {
		return nil
	}
	return d.submit(opName, st, &task{
		ready: func() bool { return ev.reached(seq) || ev.ownerGone() },
		run: func(st *stream, _ uint64) error {
			if ev.reached(seq) {
				st.waited = max(st.waited, ev.epoch())
			}
			return nil
		},
	})
}

// The event arena: one memfd per Device holding its IPC events, so that other
// Devices that open an event handle read and write the same record.
const (
	arenaMemfdName = "cudarttest-events"
	arenaMagic     = 0x32305f5456454443 // "CDEVT_02"

	aMagic     = 0
	aUID       = 8  // 2 words
	aOwner     = 24 // ident of the owning Device
	aClosed    = 32 // 1 once the owner closed
	aSlots     = 40 // slots in the arena (arenaSlots)
	aHeader    = 64
	arenaSlots = 4096

	// A slot: the generation of the event using it, bumped when it is destroyed; how
	// many records were queued and how many have run (sequence numbers); and the epoch
	// at which the latest record that ran did.
	sEpoch    = 0
	sGen      = 8
	sRecorded = 16
	sReached  = 24
	slotSize  = 32
	arenaSize = aHeader + arenaSlots*slotSize

	eventMagic = 0x31305f4456454443 // "CDEVH_01", begins an IpcEventHandle
)

type arena struct {
	reg  *region
	uid  uid
	free []uint32 // the owner's free slots
	// draining are slots of destroyed events with records still queued: the driver
	// completes them all the same, so a slot is reused only once they have run.
	draining []uint32
}

// takeSlot returns a free slot, reclaiming drained ones when none is left.
func (a *arena) takeSlot() (uint32, bool) {
	if len(a.free) == 0 {
		a.draining = slices.DeleteFunc(a.draining, func(s uint32) bool {
			so := arenaSlotOff(s)
			if a.reg.load(so+sReached) >= a.reg.load(so+sRecorded) {
				a.free = append(a.free, s)
				return true
			}
			return false
		})
	}
	if len(a.free) == 0 {
		return 0, false
	}
	s := a.free[0]
	a.free = a.free[1:]
	return s, true
}

func arenaSlotOff(slot uint32) uint64 { return aHeader + uint64(slot)*slotSize }

// ownArena returns this Device's arena, creating it on first use.
func (d *Device) ownArena(op string) (*arena, error) {
	if d.arena != nil {
		return d.arena, nil
	}
	reg, err := newRegion(arenaMemfdName, arenaSize)
	if err != nil {
		return nil, errCapacity(op, err.Error())
	}
	a := &arena{reg: reg, uid: newUID(), free: make([]uint32, arenaSlots)}
	for i := range a.free {
		a.free[i] = uint32(i)
	}
	reg.storeUID(aUID, a.uid)
	reg.store(aOwner, uint64(d.id))
	reg.store(aSlots, arenaSlots)
	reg.store(aMagic, arenaMagic)
	d.arena = a
	return a, nil
}

// kill ends the owner's events, as its process exiting would, and unmaps the arena.
func (a *arena) kill() {
	a.reg.store(aClosed, 1)
	for s := range uint32(arenaSlots) {
		so := arenaSlotOff(s)
		a.reg.store(so+sGen, a.reg.load(so+sGen)+1)
	}
	a.reg.release()
}

// event is a created event (its records kept here, or in this Device's arena if it is
// an IPC event) or an event opened from another Device's arena. Records are numbered:
// recorded counts those queued, reached those that have run.
type event struct {
	dev    int
	flags  cudart.EventFlags
	local  struct{ recorded, reached, epoch uint64 } // for events outside an arena
	arena  *arena
	slot   uint32
	gen    uint64
	opened bool
}

func (e *event) word(w uint64) uint64 { return e.arena.reg.load(arenaSlotOff(e.slot) + w) }

// recorded is the number of the last record queued; 0 if there was none.
func (e *event) recorded() uint64 {
	if e.arena == nil {
		return e.local.recorded
	}
	return e.word(sRecorded)
}

// reached reports whether record seq has run.
func (e *event) reached(seq uint64) bool {
	if e.arena == nil {
		return e.local.reached >= seq
	}
	return e.word(sReached) >= seq
}

// epoch is when the latest record that ran did.
func (e *event) epoch() uint64 {
	if e.arena == nil {
		return e.local.epoch
	}
	return e.word(sEpoch)
}

// queueRecord numbers a new record.
func (e *event) queueRecord() uint64 {
	if e.arena == nil {
		e.local.recorded++
		return e.local.recorded
	}
	off := arenaSlotOff(e.slot) + sRecorded
	for {
		n := e.arena.reg.load(off)
		if e.arena.reg.cas(off, n, n+1) {
			return n + 1
		}
	}
}

// complete marks record seq as run now. An event destroyed since still completes,
// as with the driver: its slot is not reused before (arena.takeSlot).
func (e *event) complete(seq uint64) {
	t := now()
	if e.arena == nil {
		e.local.epoch = max(e.local.epoch, t)
		e.local.reached = max(e.local.reached, seq)
		return
	}
	so := arenaSlotOff(e.slot)
	if e.arena.reg.mem == nil {
		return
	}
	e.arena.reg.storeMax(so+sEpoch, t) // before the number: a reader that sees it reached sees the epoch
	e.arena.reg.storeMax(so+sReached, seq)
}

// ownerGone reports whether an opened event's owner closed or exited: its queued
// records will never run, and nothing waits for them any more.
func (e *event) ownerGone() bool {
	return e.opened && (e.arena.reg.load(aClosed) != 0 || !ident(e.arena.reg.load(aOwner)).alive())
}

// released says why an opened event is no longer its owner's, or "" while it is.
func (e *event) released() string {
	if !e.opened {
		return ""
	}
	switch {
	case e.arena.reg.load(aClosed) != 0:
		return "its owner closed"
	case !ident(e.arena.reg.load(aOwner)).alive():
		return "its owner's process exited"
	case e.arena.reg.load(arenaSlotOff(e.slot)+sGen) != e.gen:
		return "its owner destroyed it"
	}
	return ""
}

// usableEvent resolves e for a call that uses it; d.mu is held.
func (d *Device) usableEvent(op string, e cudart.Event) (*event, error) {
	ev, ok := d.events[e]
	if !ok {
		return nil, fail(op, cudart.ErrInvalidResourceHandle)
	}
	if why := ev.released(); why != "" {
		return nil, violationErr(op, 0, d.violate(ViolationUseAfterRelease, op, "IPC event %#x used after %s", uintptr(e), why))
	}
	return ev, nil
}

// streamAndEvent resolves the stream and event of a call that uses both.
func (d *Device) streamAndEvent(op string, dev int, s cudart.Stream, e cudart.Event) (*stream, *event, error) {
	if err := d.enter(op, dev); err != nil {
		return nil, nil, err
	}
	st, err := d.stream(op, dev, s)
	if err != nil {
		return nil, nil, err
	}
	ev, err := d.usableEvent(op, e)
	return st, ev, err
}

// EventCreate creates an event. An interprocess event needs EventDisableTiming too
// (else ErrInvalidValue), as the driver requires.
func (d *Device) EventCreate(dev int, flags cudart.EventFlags) (cudart.Event, error) {
	const op = "cudaEventCreateWithFlags"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return 0, err
	}
	known := cudart.EventBlockingSync | cudart.EventDisableTiming | cudart.EventInterprocess
	if flags&^known != 0 || (flags&cudart.EventInterprocess != 0 && flags&cudart.EventDisableTiming == 0) {
		return 0, fail(op, cudart.ErrInvalidValue)
	}
	ev := &event{dev: dev, flags: flags}
	if flags&cudart.EventInterprocess != 0 {
		a, err := d.ownArena(op)
		if err != nil {
			return 0, err
		}
		slot, ok := a.takeSlot()
		if !ok {
			return 0, errCapacity(op, fmt.Sprintf("%d IPC events", arenaSlots))
		}
		ev.arena, ev.slot = a, slot
		so := arenaSlotOff(ev.slot)
		ev.gen = a.reg.load(so + sGen)
		for _, w := range []uint64{sEpoch, sRecorded, sReached} {
			a.reg.store(so+w, 0)
		}
	}
	h := cudart.Event(newHandle())
	d.events[h] = ev
	return h, nil
}

// EventDestroy destroys an event; destroying an IPC event ends it for the Devices that
// opened it.
func (d *Device) EventDestroy(dev int, e cudart.Event) error {
	const op = "cudaEventDestroy"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return err
	}
	ev, ok := d.events[e]
	if !ok {
		return fail(op, cudart.ErrInvalidResourceHandle)
	}
	delete(d.events, e)
	if ev.arena != nil && !ev.opened {
		so := arenaSlotOff(ev.slot)
		ev.arena.reg.store(so+sGen, ev.gen+1)
		ev.arena.draining = append(ev.arena.draining, ev.slot)
	}
	return nil
}

// EventRecord queues a record of e on s: e completes when s reaches it. The event
// and stream must be on one device (ErrInvalidResourceHandle).
func (d *Device) EventRecord(dev int, e cudart.Event, s cudart.Stream) error {
	const opName = "cudaEventRecord"
	d.mu.Lock()
	defer d.mu.Unlock()
	st, ev, err := d.streamAndEvent(opName, dev, s, e)
	if err != nil {
		return err
	}
	if ev.dev != st.dev {
		return fail(opName, cudart.ErrInvalidResourceHandle)
	}
	seq := ev.queueRecord()
	return d.submit(opName, st, &task{run: func(*stream, uint64) error {
		ev.complete(seq)
		return nil
	}})
}

// EventSynchronize waits until e's last record (as of the call) has run, or its owner
// is gone.
func (d *Device) EventSynchronize(dev int, e cudart.Event) error {
	const opName = "cudaEventSynchronize"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(opName, dev); err != nil {
		return err
	}
	ev, err := d.usableEvent(opName, e)
	if err != nil {
		return err
	}
	seq := ev.recorded()
	for !ev.reached(seq) && !ev.ownerGone() {
		if err := d.waitProgress(opName); err != nil {
			return err
		}
	}
	return nil
}

// EventQuery reports whether e's last record has run (true if it was never recorded).
func (d *Device) EventQuery(dev int, e cudart.Event) (bool, error) {
	const opName = "cudaEventQuery"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(opName, dev); err != nil {
		return false, err
	}
	ev, err := d.usableEvent(opName, e)
	if err != nil {
		return false, err
	}
	return ev.reached(ev.recorded()), nil
}

// IpcGetEventHandle returns the handle of an interprocess event created here; any
// other event fails with ErrInvalidValue.
func (d *Device) IpcGetEventHandle(dev int, e cudart.Event) (cudart.IpcEventHandle, error) {
	const op = "cudaIpcGetEventHandle"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return cudart.IpcEventHandle{}, err
	}
	ev, ok := d.events[e]
	if !ok {
		return cudart.IpcEventHandle{}, fail(op, cudart.ErrInvalidResourceHandle)
	}
	if ev.arena == nil || ev.opened {
		return cudart.IpcEventHandle{}, fail(op, cudart.ErrInvalidValue)
	}
	a := ev.arena
	return sealed(eventMagic, uint64(d.id.pid()), uint64(a.reg.fd), a.uid[0], a.uid[1], uint64(ev.slot), ev.gen), nil
}

// IpcOpenEventHandle opens another Device's IPC event on dev. Junk, a handle of this
// Device's own event, or of a Device that is gone, fails with ErrInvalidValue; a
// handle of an event its owner destroyed is a ViolationUseAfterRelease.
func (d *Device) IpcOpenEventHandle(dev int, h cudart.IpcEventHandle) (cudart.Event, error) {
	const op = "cudaIpcOpenEventHandle"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return 0, err
	}
	w, ok := unseal(h, eventMagic)
	if !ok || w[5] >= arenaSlots {
		return 0, invalid(op, "not an IPC event handle")
	}
	id := uid{w[3], w[4]}
	if d.arena != nil && d.arena.uid == id {
		return 0, invalid(op, "the event is this Device's own")
	}
	a, ok := d.remoteArenas[id]
	if !ok {
		reg, err := mapProcRegion(int(w[1]), int(w[2]), arenaMemfdName, arenaSize, aUID, id)
		if err != nil {
			return 0, invalid(op, err.Error())
		}
		if reg.load(aMagic) != arenaMagic || reg.load(aSlots) != arenaSlots {
			reg.release()
			return 0, invalid(op, "not a cudarttest event arena")
		}
		a = &arena{reg: reg, uid: id}
		d.remoteArenas[id] = a
	}
	ev := &event{dev: dev, flags: cudart.EventIPC, arena: a, slot: uint32(w[5]), gen: w[6], opened: true}
	if why := ev.released(); why != "" {
		return 0, violationErr(op, 0, d.violate(ViolationUseAfterRelease, op, "IPC event handle opened after %s", why))
	}
	e := cudart.Event(newHandle())
	d.events[e] = ev
	return e, nil
}

// StreamNotify queues on s a write of 1 to eventfd fd, run when s reaches it in the
// Device's interleaving, after every earlier op of s, as the driver runs a host
// function: across processes it is a real write to the eventfd. A write that fails
// (fd closed meanwhile) is lost, as the real host function's is.
func (d *Device) StreamNotify(dev int, s cudart.Stream, fd int) error {
	const opName = "cudaLaunchHostFunc"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(opName, dev); err != nil {
		return err
	}
	if fd < 0 {
		return fail(opName, cudart.ErrInvalidValue)
	}
	st, err := d.stream(opName, dev, s)
	if err != nil {
		return err
	}
	return d.submit(opName, st, &task{run: func(*stream, uint64) error {
		var one [8]byte
		binary.NativeEndian.PutUint64(one[:], 1)
		for {
			if _, err := unix.Write(fd, one[:]); err != unix.EINTR {
				return nil
			}
		}
	}})
}
