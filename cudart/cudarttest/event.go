package cudarttest

import (
	"fmt"

	"github.com/cudapool/cudapool/cudart"
)

// Streams are immediate: work is done when the call returns. What a stream keeps is
// how far it has been ordered after other Devices' work: the latest epoch among the
// events it waited on. An access to memory another Device wrote later than that is
// unordered (see ViolationUnorderedRead).
type stream struct {
	dev  int
	sync uint64
}

// stream resolves s on dev; the legacy, per-thread and null streams are dev's default
// stream. d.mu is held.
func (d *Device) stream(op string, dev int, s cudart.Stream) (*stream, error) {
	if s <= 2 { // 0, cudaStreamLegacy, cudaStreamPerThread
		return d.devs[dev].defaultStream, nil
	}
	st, ok := d.streams[s]
	if !ok {
		return nil, fail(op, cudart.ErrInvalidResourceHandle)
	}
	return st, nil
}

// orderedAfter is the epoch up to which other Devices' work is ordered before new work
// on st: what st waited on, and what the host synchronised with.
func (d *Device) orderedAfter(st *stream) uint64 { return max(st.sync, d.hostSync) }

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
	d.streams[h] = &stream{dev: dev}
	return h, nil
}

// StreamDestroy destroys a created stream; the default streams fail with
// ErrInvalidResourceHandle.
func (d *Device) StreamDestroy(dev int, s cudart.Stream) error {
	const op = "cudaStreamDestroy"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return err
	}
	if _, ok := d.streams[s]; !ok {
		return fail(op, cudart.ErrInvalidResourceHandle)
	}
	delete(d.streams, s)
	return nil
}

// StreamSynchronize returns at once (the work is done); the host is now ordered after
// everything s waited on.
func (d *Device) StreamSynchronize(dev int, s cudart.Stream) error {
	const op = "cudaStreamSynchronize"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return err
	}
	st, err := d.stream(op, dev, s)
	if err != nil {
		return err
	}
	d.hostSync = max(d.hostSync, st.sync)
	return nil
}

// StreamWaitEvent orders s after e's last record. Waiting on an imported event whose
// owner destroyed it, or that died, is a ViolationUseAfterRelease.
func (d *Device) StreamWaitEvent(dev int, s cudart.Stream, e cudart.Event) error {
	const op = "cudaStreamWaitEvent"
	d.mu.Lock()
	defer d.mu.Unlock()
	st, ev, err := d.streamAndEvent(op, dev, s, e)
	if err != nil {
		return err
	}
	st.sync = max(st.sync, ev.epoch())
	return nil
}

// The event arena: one memfd per Device holding its IPC events, so that other
// Devices that open an event handle read and write the same record.
const (
	arenaMemfdName = "cudarttest-events"
	arenaMagic     = 0x31305f5456454443 // "CDEVT_01"

	aMagic     = 0
	aUID       = 8  // 2 words
	aOwner     = 24 // ident of the owning Device
	aClosed    = 32 // 1 once the owner closed
	aSlots     = 40 // slots in the arena (arenaSlots)
	aHeader    = 64
	arenaSlots = 4096

	// A slot: the epoch of the last record (0: never recorded) and the generation of
	// the event using it, bumped when it is destroyed.
	sEpoch    = 0
	sGen      = 8
	slotSize  = 16
	arenaSize = aHeader + arenaSlots*slotSize

	eventMagic = 0x31305f4456454443 // "CDEVH_01", begins an IpcEventHandle
)

type arena struct {
	reg  *region
	uid  uid
	free []uint32 // the owner's free slots
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

// event is a created event (its record kept here, or in this Device's arena if it is
// an IPC event) or an event opened from another Device's arena.
type event struct {
	dev    int
	flags  cudart.EventFlags
	local  uint64 // epoch of the last record, for events outside an arena
	arena  *arena
	slot   uint32
	gen    uint64
	opened bool
}

func (e *event) epoch() uint64 {
	if e.arena == nil {
		return e.local
	}
	return e.arena.reg.load(arenaSlotOff(e.slot) + sEpoch)
}

func (e *event) record(epoch uint64) {
	if e.arena == nil {
		e.local = epoch
		return
	}
	e.arena.reg.store(arenaSlotOff(e.slot)+sEpoch, epoch)
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
		if len(a.free) == 0 {
			return 0, errCapacity(op, fmt.Sprintf("%d IPC events", arenaSlots))
		}
		ev.arena, ev.slot = a, a.free[0]
		a.free = a.free[1:]
		ev.gen = a.reg.load(arenaSlotOff(ev.slot) + sGen)
		ev.record(0)
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
		ev.arena.reg.store(so+sEpoch, 0)
		ev.arena.free = append(ev.arena.free, ev.slot)
	}
	return nil
}

// EventRecord captures the work submitted so far: all of it is done already, so the
// record is the current epoch. The event and stream must be on one device
// (ErrInvalidResourceHandle).
func (d *Device) EventRecord(dev int, e cudart.Event, s cudart.Stream) error {
	const op = "cudaEventRecord"
	d.mu.Lock()
	defer d.mu.Unlock()
	st, ev, err := d.streamAndEvent(op, dev, s, e)
	if err != nil {
		return err
	}
	if ev.dev != st.dev {
		return fail(op, cudart.ErrInvalidResourceHandle)
	}
	ev.record(now())
	return nil
}

// EventSynchronize returns at once; the host is now ordered after e's record.
func (d *Device) EventSynchronize(dev int, e cudart.Event) error {
	_, err := d.syncEvent("cudaEventSynchronize", dev, e)
	return err
}

// EventQuery is true at once: the work an event captures is done when it is recorded.
// A true answer orders the host after the record, as a synchronize would.
func (d *Device) EventQuery(dev int, e cudart.Event) (bool, error) {
	return d.syncEvent("cudaEventQuery", dev, e)
}

func (d *Device) syncEvent(op string, dev int, e cudart.Event) (bool, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return false, err
	}
	ev, err := d.usableEvent(op, e)
	if err != nil {
		return false, err
	}
	d.hostSync = max(d.hostSync, ev.epoch())
	return true, nil
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
