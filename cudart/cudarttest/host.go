package cudarttest

import (
	"fmt"
	"slices"
	"unsafe"

	"github.com/cudapool/cudapool/cudart"
)

// hostReg is host memory registered with HostRegister: its device address is its
// host address, as CUDA gives with unified addressing (host addresses lie far below
// the software device's pools). Its marks are this Device's alone: another process's
// registration of the same memfd is that process's, as with the driver. Guarded by
// d.mu.
type hostReg struct {
	mem     []byte
	base    uint64
	flags   cudart.HostRegisterFlags
	me      ident // the Device that registered it
	pending int   // queued ops that touch it
	gone    bool  // unregistered

	w  accessor
	rs []accessor
}

func (h *hostReg) bounds() (uint64, uint64) { return h.base, uint64(len(h.mem)) }

// overlapping is the registration's marks, one writer and its readers: they cover the
// whole registration, whatever bytes an access touches.
func (h *hostReg) overlapping(_, _ uint64) []mark {
	ks := make([]mark, 0, 1+len(h.rs))
	if h.w.id != 0 {
		ks = append(ks, mark{accessor: h.w, hi: ^uint64(0), write: true})
	}
	for _, r := range h.rs {
		ks = append(ks, mark{accessor: r, hi: ^uint64(0)})
	}
	return ks
}

func (h *hostReg) wrote(st *stream, t, _, _ uint64) {
	h.w = accessor{h.me, st.id, t}
	h.rs = h.rs[:0]
}

func (h *hostReg) read(st *stream, t, _, _ uint64) {
	for i, r := range h.rs {
		if r.id == h.me && r.stream == st.id {
			h.rs[i].epoch = t
			return
		}
	}
	h.rs = append(h.rs, accessor{h.me, st.id, t})
}

// addrOf is the address of mem[0].
func addrOf(mem []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(mem)))) }

// knownHostFlags are the cudaHostRegister flags the software device takes.
const knownHostFlags = cudart.HostRegisterPortable | cudart.HostRegisterMapped

// HostRegister registers mem. Memory that overlaps a registration fails with
// cudart.ErrHostAlreadyRegistered, as the driver answers; empty memory or unknown
// flags with ErrInvalidValue.
func (d *Device) HostRegister(dev int, mem []byte, flags cudart.HostRegisterFlags) error {
	const op = "cudaHostRegister"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return err
	}
	switch {
	case len(mem) == 0:
		return invalid(op, "no host memory")
	case flags&^knownHostFlags != 0:
		return invalid(op, fmt.Sprintf("unknown flags %#x", uint32(flags&^knownHostFlags)))
	}
	base := addrOf(mem)
	if slices.ContainsFunc(d.hosts, func(h *hostReg) bool {
		return base < h.base+uint64(len(h.mem)) && h.base < base+uint64(len(mem))
	}) {
		return fail(op, cudart.ErrHostAlreadyRegistered)
	}
	d.hosts = insertSorted(d.hosts, &hostReg{mem: mem, base: base, flags: flags, me: d.id})
	return nil
}

// HostUnregister unregisters the memory registered from mem[0]. Memory that queued
// work still touches is a ViolationUseAfterRelease, and stays registered: the caller
// is about to unmap it, and the work would touch unmapped memory.
func (d *Device) HostUnregister(dev int, mem []byte) error {
	const op = "cudaHostUnregister"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return err
	}
	if len(mem) == 0 {
		return invalid(op, "no host memory")
	}
	i := slices.IndexFunc(d.hosts, func(h *hostReg) bool { return h.base == addrOf(mem) })
	if i < 0 {
		return fail(op, cudart.ErrHostNotRegistered)
	}
	h := d.hosts[i]
	if h.pending > 0 {
		return violationErr(op, 0, d.violate(ViolationUseAfterRelease, op,
			"host memory %#x+%d unregistered while %d queued ops still touch it (synchronize with them first)", h.base, len(h.mem), h.pending))
	}
	h.gone = true
	d.hosts = slices.Delete(d.hosts, i, i+1)
	return nil
}

// HostDevicePointer is mem[0]'s own address, in memory registered with
// HostRegisterMapped.
func (d *Device) HostDevicePointer(dev int, mem []byte) (cudart.DevicePtr, error) {
	const op = "cudaHostGetDevicePointer"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return 0, err
	}
	if len(mem) == 0 {
		return 0, invalid(op, "no host memory")
	}
	h := d.hostAt(addrOf(mem), 1)
	switch {
	case h == nil:
		return 0, invalid(op, "the memory is not registered")
	case h.flags&cudart.HostRegisterMapped == 0:
		return 0, invalid(op, "the memory was registered without cudaHostRegisterMapped")
	}
	return cudart.DevicePtr(addrOf(mem)), nil
}

// hostAt is the registration holding [ptr, ptr+n), or nil. d.mu is held.
func (d *Device) hostAt(ptr, n uint64) *hostReg {
	if i := covering(d.hosts, ptr, n); i >= 0 {
		return d.hosts[i]
	}
	return nil
}

// BatchCopyPath is CopyPathKernel: the software device runs a batch as one op, as
// the kernel is one launch.
func (d *Device) BatchCopyPath(dev int) (cudart.CopyPath, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter("MemcpyBatchAsync", dev); err != nil {
		return 0, err
	}
	return cudart.CopyPathKernel, nil
}

// MemcpyBatchAsync queues every piece as one op on s, as the kernel is one launch:
// when it runs, each piece's ranges are checked and marked as a copy's are, then
// every piece is copied. A range must be device memory dev may access or host memory
// registered with HostRegisterMapped; pieces whose ranges overlap where one writes
// are a ViolationUnorderedWrite, as the kernel's blocks run in any order, and nothing
// is queued.
func (d *Device) MemcpyBatchAsync(dev int, pieces []cudart.CopyPiece, s cudart.Stream) error {
	const op = "MemcpyBatchAsync"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return err
	}
	st, err := d.stream(op, dev, s)
	if err != nil {
		return err
	}
	spans := make([]span, 0, 2*len(pieces))
	for i, pc := range pieces {
		if pc.Size == 0 {
			continue
		}
		from, err := d.batchAccess(op, dev, pc.Src, pc.Size, false)
		if err != nil {
			return fmt.Errorf("piece %d: %w", i, err)
		}
		to, err := d.batchAccess(op, dev, pc.Dst, pc.Size, true)
		if err != nil {
			return fmt.Errorf("piece %d: %w", i, err)
		}
		spans = append(spans, from, to)
	}
	if len(spans) == 0 {
		return nil
	}
	if v, bad := d.overlapping(op, spans); bad {
		return violationErr(op, 0, v)
	}
	pools, hosts := map[*pool]bool{}, map[*hostReg]bool{}
	for _, sp := range spans {
		switch {
		case sp.h != nil:
			hosts[sp.h] = true
		case sp.p != nil:
			pools[sp.p] = true
		}
	}
	release := holdMaps(spans)
	for p := range pools {
		p.pending++
	}
	for h := range hosts {
		h.pending++
	}
	o := &task{run: func(st *stream, after uint64) error {
		defer func() {
			release()
			for p := range pools {
				p.pending--
				d.dropPool(p)
			}
			for h := range hosts {
				h.pending--
			}
		}()
		return d.runSpans(op, spans, st, after, func(spans []span) {
			for i := 0; i < len(spans); i += 2 {
				copy(spans[i+1].buf(), spans[i].buf())
			}
		})
	}}
	return d.submit(op, st, o)
}

// batchAccess resolves a piece's range: registered host memory, else device memory
// as access resolves it. d.mu is held.
func (d *Device) batchAccess(op string, dev int, ptr cudart.DevicePtr, n uint64, write bool) (span, error) {
	if h := d.hostAt(uint64(ptr), n); h != nil {
		if h.flags&cudart.HostRegisterMapped == 0 {
			return span{}, invalid(op, fmt.Sprintf("host memory %#x was registered without cudaHostRegisterMapped: no device can address it", h.base))
		}
		return span{h: h, off: uint64(ptr) - h.base, n: n, ptr: ptr, write: write}, nil
	}
	if d.hostAt(uint64(ptr), 1) != nil {
		return span{}, invalid(op, fmt.Sprintf("%#x+%d runs past the end of its registered host memory", uint64(ptr), n))
	}
	return d.access(op, dev, ptr, n, write)
}

// overlapping finds two ranges of one batch that overlap where either is written. d.mu
// is held.
func (d *Device) overlapping(op string, spans []span) (Violation, bool) {
	type rng struct {
		start, end uint64
		write      bool
		piece      int
	}
	rs := make([]rng, len(spans))
	for i, sp := range spans {
		rs[i] = rng{uint64(sp.ptr), uint64(sp.ptr) + sp.n, sp.write, i / 2}
	}
	slices.SortFunc(rs, func(a, b rng) int {
		switch {
		case a.start < b.start:
			return -1
		case a.start > b.start:
			return 1
		}
		return 0
	})
	// Against every earlier range still open: the writes among them, and the furthest
	// reaching range of all.
	var open []rng
	for _, r := range rs {
		open = slices.DeleteFunc(open, func(o rng) bool { return o.end <= r.start })
		for _, o := range open {
			if o.write || r.write {
				return d.violate(ViolationUnorderedWrite, op,
					"pieces %d and %d of one batch overlap at %#x, and one writes there: the kernel copies pieces in any order",
					min(o.piece, r.piece), max(o.piece, r.piece), r.start), true
			}
		}
		open = append(open, r)
	}
	return Violation{}, false
}
