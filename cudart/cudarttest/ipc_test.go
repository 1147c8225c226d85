//go:build linux

package cudarttest

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/stretchr/testify/require"
)

// shared is an exporter and an importer Device of one process with a pool exported
// from the first and imported into the second.
type shared struct {
	exp, imp fx
	pool     cudart.MemPool // in exp
	ipool    cudart.MemPool // in imp
}

func newShared(t *testing.T) shared {
	t.Helper()
	s := shared{exp: newFx(t), imp: newFx(t)}
	var fd int
	s.pool, fd = s.exp.exported()
	defer func() { _ = unix.Close(fd) }() // test cleanup
	s.ipool = s.imp.importPool(fd)
	return s
}

// share allocates n bytes in the exporter, fills them with data, and imports them
// ordered after that write.
func (s shared) share(n uint64, data []byte) (ptr, iptr cudart.DevicePtr) {
	ptr = s.exp.alloc(s.pool, n)
	s.exp.write(ptr, data)
	require.NoError(s.exp.t, s.exp.StreamSynchronize(0, 0))
	e, o := s.exp.ipcEvent(s.imp)
	ready(s.exp, e, s.imp, o)
	return ptr, s.imp.importPtr(s.ipool, s.exp.exportPtr(ptr))
}

// The whole round trip between two Devices of one process: bytes both ways, ordered
// by IPC events, freed in order, no violation.
func TestTwoDevicesShareAPool(t *testing.T) {
	exp, imp := newFx(t), newFx(t)
	p, fd := exp.exported()
	defer func() { _ = unix.Close(fd) }() // test cleanup
	ptr := exp.alloc(p, 1000)
	exp.write(ptr, []byte("from the exporter"))
	e, o := exp.ipcEvent(imp)
	ready(exp, e, imp, o)

	ip := imp.importPool(fd)
	iptr := imp.importPtr(ip, exp.exportPtr(ptr))
	require.Equal(t, ptr, iptr, "imported and exported addresses must match")
	imp.wantBytes(iptr, []byte("from the exporter"))
	imp.write(iptr+100, []byte("from the importer"))
	ready(imp, o, exp, e)
	exp.wantBytes(ptr+100, []byte("from the importer"))
	require.NoError(t, imp.FreeAsync(0, iptr, 0))
	ready(imp, o, exp, e)
	require.NoError(t, exp.FreeAsync(0, ptr, 0))
	require.NoError(t, imp.Err())
	require.NoError(t, exp.Err())
}

// importerDone orders the exporter's default stream after everything the importer
// did so far, through an IPC event of the importer.
func (s shared) importerDone() {
	o, e := s.imp.ipcEvent(s.exp)
	ready(s.imp, o, s.exp, e)
}

// FACTS 12 and 9: only live allocations of an exported IPC pool can be exported.
func TestExportPointerNeedsExportedIPCPool(t *testing.T) {
	d := newFx(t)
	p := d.pool(ipcProps(0))
	ptr := d.alloc(p, 1*mib)
	_, err := d.MemPoolExportPointer(0, ptr)
	wantErr(t, err, cudart.ErrInvalidValue)
	h, err := d.MemPoolExportToShareableHandle(0, p, cudart.HandleTypePosixFD)
	require.NoError(t, err)
	defer func() { _ = unix.Close(h.FD) }() // test cleanup
	flags, err := unix.FcntlInt(uintptr(h.FD), unix.F_GETFD, 0)
	require.NoError(t, err)
	require.NotZero(t, flags&unix.FD_CLOEXEC, "exported descriptor not close-on-exec: %#x", flags)
	first := d.exportPtr(ptr)
	require.Equal(t, first, d.exportPtr(ptr), "exporting one pointer twice gave different records")
	other := d.alloc(p, 1*mib)
	require.NotEqual(t, first, d.exportPtr(other), "two allocations share a record")
	_, err = d.MemPoolExportPointer(0, ptr+512)
	wantErr(t, err, cudart.ErrInvalidValue)
	require.NoError(t, d.FreeAsync(0, other, 0))
	_, err = d.MemPoolExportPointer(0, other)
	wantErr(t, err, cudart.ErrInvalidValue)

	none := d.pool(cudart.PoolProps{Location: cudart.DeviceLocation(0)})
	_, err = d.MemPoolExportToShareableHandle(0, none, cudart.HandleTypePosixFD)
	wantErr(t, err, cudart.ErrInvalidValue)
	_, err = d.MemPoolExportToShareableHandle(0, p, cudart.HandleTypeFabric) // not created with it
	wantErr(t, err, cudart.ErrInvalidValue)
	_, err = d.MemPoolExportPointer(0, d.alloc(none, 512))
	wantErr(t, err, cudart.ErrInvalidValue)
}

// FACTS 11: FABRIC export is refused unless the host has IMEX (WithFabric).
func TestFabricExport(t *testing.T) {
	fabricProps := cudart.PoolProps{HandleTypes: cudart.HandleTypeFabric, Location: cudart.DeviceLocation(0)}
	plain := newFx(t)
	_, err := plain.MemPoolExportToShareableHandle(0, plain.pool(fabricProps), cudart.HandleTypeFabric)
	wantErr(t, err, cudart.ErrNotPermitted)

	exp, imp := newFx(t, WithFabric()), newFx(t, WithFabric())
	p := exp.pool(fabricProps)
	h, err := exp.MemPoolExportToShareableHandle(0, p, cudart.HandleTypeFabric)
	require.NoError(t, err)
	require.Equal(t, -1, h.FD, "fabric handle %+v", h)
	require.Equal(t, cudart.HandleTypeFabric, h.Type, "fabric handle %+v", h)
	ptr := exp.alloc(p, 100)
	exp.write(ptr, []byte("over the fabric"))
	ip, err := imp.MemPoolImportFromShareableHandle(0, h)
	require.NoError(t, err)
	e, o := exp.ipcEvent(imp)
	ready(exp, e, imp, o)
	iptr := imp.importPtr(ip, exp.exportPtr(ptr))
	imp.wantBytes(iptr, []byte("over the fabric"))
	require.NoError(t, imp.FreeAsync(0, iptr, 0))
	ready(imp, o, exp, e)

	_, err = plain.MemPoolImportFromShareableHandle(0, h)
	wantErr(t, err, cudart.ErrNotPermitted)
	junk := h
	junk.Fabric[20] ^= 1
	_, err = imp.MemPoolImportFromShareableHandle(0, junk)
	wantErr(t, err, cudart.ErrInvalidValue)
	require.NoError(t, exp.FreeAsync(0, ptr, 0))
	require.NoError(t, exp.sync())
	require.NoError(t, exp.MemPoolDestroy(0, p))
	// The exporter's descriptor is gone: the handle names nothing now.
	_, err = newFx(t, WithFabric()).MemPoolImportFromShareableHandle(0, h)
	wantErr(t, err, cudart.ErrInvalidValue)
}

func TestImportPoolChecksItsHandle(t *testing.T) {
	exp, imp := newFx(t), newFx(t)
	p, fd := exp.exported()
	defer func() { _ = unix.Close(fd) }() // test cleanup
	posix := func(fd int) cudart.ShareableHandle {
		return cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: fd}
	}
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer func() { _ = r.Close() }()                               // test cleanup
	defer func() { _ = w.Close() }()                               // test cleanup
	junk, err := unix.MemfdCreate(poolMemfdName, unix.MFD_CLOEXEC) // our name, no header
	require.NoError(t, err)
	defer func() { _ = unix.Close(junk) }() // test cleanup
	require.NoError(t, unix.Ftruncate(junk, poolDataOffset))
	for _, h := range []cudart.ShareableHandle{posix(-1), posix(int(r.Fd())), posix(junk), {Type: 0x2, FD: fd}} {
		_, err := imp.MemPoolImportFromShareableHandle(0, h)
		wantErr(t, err, cudart.ErrInvalidValue)
	}
	_, err = exp.MemPoolImportFromShareableHandle(0, posix(fd))
	wantErr(t, err, cudart.ErrInvalidValue) // its own pool
	_, err = imp.MemPoolImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypeFabric, FD: -1})
	wantErr(t, err, cudart.ErrNotPermitted) // no IMEX

	// Importing one pool twice gives one handle, undone by two destroys.
	a, b := imp.importPool(fd), imp.importPool(fd)
	require.Equal(t, a, b, "one pool imported twice")
	require.NoError(t, imp.MemPoolDestroy(0, a))
	require.NoError(t, imp.MemPoolDestroy(0, a))
	wantErr(t, imp.MemPoolDestroy(0, a), cudart.ErrInvalidValue)

	// Destroyed with an import still live: the import stays usable, and importing
	// the pool again works.
	ptr := exp.alloc(p, 512)
	exp.write(ptr, []byte("kept"))
	e, o := exp.ipcEvent(imp)
	ready(exp, e, imp, o)
	c := imp.importPool(fd)
	iptr := imp.importPtr(c, exp.exportPtr(ptr))
	require.NoError(t, imp.MemPoolDestroy(0, c))
	imp.wantBytes(iptr, []byte("kept"))
	c = imp.importPool(fd)
	_, err = imp.MemPoolImportPointer(0, c, exp.exportPtr(ptr))
	require.NoError(t, err)
	require.NoError(t, imp.FreeAsync(0, iptr, 0))
	require.NoError(t, imp.MemPoolDestroy(0, c))
	require.NoError(t, imp.Err())
}

// FACTS 6: an imported pool cannot allocate.
func TestImportedPoolCannotAllocate(t *testing.T) {
	s := newShared(t)
	_, err := s.imp.MallocFromPoolAsync(0, 512, s.ipool, 0)
	wantErr(t, err, cudart.ErrInvalidValue)
	_, err = s.imp.MemPoolExportToShareableHandle(0, s.ipool, cudart.HandleTypePosixFD)
	wantErr(t, err, cudart.ErrInvalidValue)
	wantErr(t, s.imp.MemPoolSetAttribute(0, s.ipool, cudart.PoolUsedMemHigh, 0), cudart.ErrInvalidValue)
	s.exp.alloc(s.pool, 3*mib)
	require.EqualValues(t, 4*mib, s.imp.attr(s.ipool, cudart.PoolReservedMemCurrent), "the importer sees the exporter's reserved figure")
}

// FACTS 2: imports have the exporter's addresses; memcpy on a neighbour that was not
// imported fails.
func TestImportKeepsAddressesAndHidesNeighbours(t *testing.T) {
	s := newShared(t)
	ptr, iptr := s.share(1000, []byte("exported"))
	secret := s.exp.alloc(s.pool, 1000)
	s.exp.write(secret, []byte("not exported"))
	require.Equal(t, ptr, iptr, "imported and exported addresses")
	s.imp.wantBytes(iptr, []byte("exported"))
	_, err := s.imp.MemcpyDtoHAsyncN(secret, 4)
	wantErr(t, err, cudart.ErrInvalidValue)
	_, err = s.imp.MemcpyDtoHAsyncN(iptr+1000, 100) // runs past the import
	wantErr(t, err, cudart.ErrInvalidValue)
	require.NoError(t, s.imp.Err())
}

// FACTS 5: junk records fail; so do records of another pool.
func TestJunkRecordsAreRefused(t *testing.T) {
	s := newShared(t)
	ptr := s.exp.alloc(s.pool, 512)
	rec := s.exp.exportPtr(ptr)
	var junk cudart.PtrExportData
	for i := range junk {
		junk[i] = 0x3c
	}
	flipped := rec
	flipped[40] ^= 0x80
	other := newShared(t)
	foreign := other.exp.exportPtr(other.exp.alloc(other.pool, 512))
	for _, data := range []cudart.PtrExportData{junk, flipped, foreign, {}} {
		_, err := s.imp.MemPoolImportPointer(0, s.ipool, data)
		wantErr(t, err, cudart.ErrInvalidValue)
	}
	_, err := s.exp.MemPoolImportPointer(0, s.pool, rec) // into the exporter's own pool
	wantErr(t, err, cudart.ErrInvalidValue)
	require.NoError(t, s.imp.Err())
}

// FACTS 3: a stale record imports fine; using it is the violation.
func TestStaleRecordImportsButCannotBeUsed(t *testing.T) {
	s := newShared(t)
	ptr := s.exp.alloc(s.pool, 512)
	rec := s.exp.exportPtr(ptr)
	require.NoError(t, s.exp.FreeAsync(0, ptr, 0))
	require.NoError(t, s.exp.sync()) // the free has run: the record is stale
	iptr, err := s.imp.MemPoolImportPointer(0, s.ipool, rec)
	require.NoError(t, err)
	_, err = s.imp.MemcpyDtoHAsyncN(iptr, 8)
	wantErr(t, err, ErrViolation)
	wantViolation(t, err, ViolationUseAfterRelease)
	require.NoError(t, s.imp.FreeAsync(0, iptr, 0))
	require.NoError(t, s.imp.sync())

	// Reused: the same entry's new allocation does not revive the old record.
	again := s.exp.alloc(s.pool, 512)
	require.Equal(t, ptr, again, "reallocation: want the freed address")
	iptr, err = s.imp.MemPoolImportPointer(0, s.ipool, rec)
	require.NoError(t, err)
	err = s.imp.MemsetAsync(0, iptr, 0, 8, 0)
	wantViolation(t, err, ViolationUseAfterRelease)
	require.NoError(t, s.imp.FreeAsync(0, iptr, 0))
	require.NoError(t, s.exp.FreeAsync(0, again, 0)) // the stale import held no reference
	require.NoError(t, s.exp.Err())
}

// FACTS 4: a second import of one record aliases the first; freeing either unmaps
// both.
func TestDoubleImportAliasesOneMapping(t *testing.T) {
	s := newShared(t)
	ptr, first := s.share(512, []byte("once"))
	second := s.imp.importPtr(s.ipool, s.exp.exportPtr(ptr))
	require.Equal(t, first, second, "a double import")
	require.NoError(t, s.imp.FreeAsync(0, second, 0))
	_, err := s.imp.MemcpyDtoHAsyncN(first, 4)
	wantErr(t, err, cudart.ErrInvalidValue, ErrViolation)
	wantViolation(t, err, ViolationUseAfterRelease)
	err = s.imp.FreeAsync(0, first, 0)
	wantErr(t, err, cudart.ErrInvalidValue)
	wantViolation(t, err, ViolationUseAfterRelease)
	s.importerDone()
	require.NoError(t, s.exp.FreeAsync(0, ptr, 0)) // the importer holds nothing any more
	require.NoError(t, s.exp.Err())
}

// The importer's free must complete before the exporter's: an IPC event recorded
// after it, waited on by the exporter's freeing stream.
func TestExporterFreeMustFollowImportersFree(t *testing.T) {
	s := newShared(t)
	// The importer's free has not run when the exporter's does.
	ptr, iptr := s.share(512, []byte("x"))
	resumeImp := s.imp.stall()
	require.NoError(t, s.imp.FreeAsync(0, iptr, 0))
	require.NoError(t, s.exp.FreeAsync(0, ptr, 0))
	wantViolation(t, s.exp.sync(), ViolationExporterFreedWhileImported)
	resumeImp()
	require.NoError(t, s.imp.sync())

	// The importer's free has run when the exporter's does, but only after the
	// exporter's was queued: nothing ordered them.
	ptr, iptr = s.share(512, []byte("x"))
	resumeImp, resumeExp := s.imp.stall(), s.exp.stall()
	require.NoError(t, s.imp.FreeAsync(0, iptr, 0))
	require.NoError(t, s.exp.FreeAsync(0, ptr, 0))
	resumeImp()
	require.NoError(t, s.imp.sync())
	resumeExp()
	wantViolation(t, s.exp.sync(), ViolationExporterFreedWhileImported)

	ptr, iptr = s.share(512, []byte("y"))
	require.NoError(t, s.imp.FreeAsync(0, iptr, 0))
	s.importerDone()
	require.NoError(t, s.exp.FreeAsync(0, ptr, 0))
	require.Len(t, s.exp.Violations(), 2, "violations: want the first two frees' only")
}

func TestExporterFreeWhileImported(t *testing.T) {
	s := newShared(t)
	ptr, iptr := s.share(512, []byte("held"))
	require.NoError(t, s.exp.FreeAsync(0, ptr, 0))
	err := s.exp.sync()
	wantErr(t, err, ErrViolation)
	wantViolation(t, err, ViolationExporterFreedWhileImported)
	require.Len(t, s.exp.Violations(), 1, "exporter violations")
	// The free happened: the space is handed out again, and the import is dead.
	require.Equal(t, ptr, s.exp.alloc(s.pool, 512), "freed space not reused")
	_, err = s.imp.MemcpyDtoHAsyncN(iptr, 4)
	wantViolation(t, err, ViolationUseAfterRelease)
	require.NoError(t, s.imp.FreeAsync(0, iptr, 0))
}

func TestClosedImporterHoldsNothing(t *testing.T) {
	s := newShared(t)
	ptr, _ := s.share(512, []byte("x"))
	require.NoError(t, s.imp.Close())
	require.NoError(t, s.exp.FreeAsync(0, ptr, 0))
	require.NoError(t, s.exp.Err())
}

// FACTS 7: the importer outlives the exporter.
func TestExporterClosesFirst(t *testing.T) {
	s := newShared(t)
	ptr, iptr := s.share(512, []byte("survives"))
	_ = ptr
	require.NoError(t, s.exp.Close())
	s.imp.wantBytes(iptr, []byte("survives"))
	s.imp.write(iptr, []byte("still mapped"))
	s.imp.wantBytes(iptr, []byte("still mapped"))
	require.NoError(t, s.imp.FreeAsync(0, iptr, 0))
	wantErr(t, s.imp.MemPoolDestroy(0, s.ipool), cudart.ErrInvalidValue)
	require.NoError(t, s.imp.Err())
}

func TestUnorderedAccessIsReported(t *testing.T) {
	s := newShared(t)
	e, o := s.exp.ipcEvent(s.imp)
	local := s.imp.alloc(s.imp.pool(ipcProps(0)), 512)

	// The exporter's stream is busy: its allocation has not run when the importer reads.
	resume := s.exp.stall()
	ptr := s.exp.alloc(s.pool, 512)
	iptr := s.imp.importPtr(s.ipool, s.exp.exportPtr(ptr))
	_, err := s.imp.MemcpyDtoHAsyncN(iptr, 4)
	wantViolation(t, err, ViolationUnorderedRead)

	// Ordered by an event: the importer's stream waits for the record behind the stall.
	s.exp.write(ptr, []byte("v1"))
	require.NoError(t, s.exp.EventRecord(0, e, 0))
	require.NoError(t, s.imp.StreamWaitEvent(0, 0, o))
	done, err := s.imp.EventQuery(0, o)
	require.NoError(t, err)
	require.False(t, done, "EventQuery of a record behind a stall")
	resume()
	s.imp.wantBytes(iptr, []byte("v1"))
	require.Len(t, s.imp.Violations(), 1, "violations: want the first read's only")

	// A write queued before a read of another stream but run after it: the write is
	// reported (it overwrote what was read), and the read saw the old bytes.
	resume = s.exp.stall()
	s.exp.write(ptr, []byte("v2"))
	s.imp.wantBytes(iptr, []byte("v1"))
	resume()
	wantViolation(t, s.exp.sync(), ViolationUnorderedWrite)

	// A read queued before a write of another stream ran, and run after it: the read
	// is reported.
	resumeImp := s.imp.stall()
	require.NoError(t, s.imp.MemcpyDtoDAsync(0, local, iptr, 2, 0))
	s.exp.write(ptr, []byte("v3"))
	require.NoError(t, s.exp.sync())
	resumeImp()
	wantViolation(t, s.imp.sync(), ViolationUnorderedRead)

	// A created stream is ordered only by what it waited on: a wait of the default
	// stream does not cover it.
	st, err := s.imp.StreamCreate(0, 0)
	require.NoError(t, err)
	resumeSt, err := s.imp.Stall(0, st)
	require.NoError(t, err)
	resume = s.exp.stall()
	s.exp.write(ptr, []byte("v4"))
	require.NoError(t, s.exp.EventRecord(0, e, 0))
	require.NoError(t, s.imp.StreamWaitEvent(0, 0, o))
	require.NoError(t, s.imp.MemcpyDtoDAsync(0, local, iptr, 2, st))
	resume()
	require.NoError(t, s.exp.sync())
	resumeSt()
	wantViolation(t, s.imp.StreamSynchronize(0, st), ViolationUnorderedRead)
	require.NoError(t, s.imp.StreamWaitEvent(0, st, o))
	buf := make([]byte, 2)
	require.NoError(t, s.imp.MemcpyDtoHAsync(0, buf, iptr, st))
	require.Equal(t, "v4", string(buf), "read after the wait")
}

// FACTS 8 and the access rule: an imported pool is reachable from another device
// only once the importer grants it; the exporter's grant does not carry over.
func TestImportedPoolAccessFromAnotherDevice(t *testing.T) {
	s := newShared(t)
	rw := []cudart.AccessDesc{{Location: cudart.DeviceLocation(1), Flags: cudart.AccessReadWrite}}
	require.NoError(t, s.exp.MemPoolSetAccess(0, s.pool, rw))
	_, iptr := s.share(512, []byte("peer"))
	buf := make([]byte, 4)
	err := s.imp.MemcpyDtoHAsync(1, buf, iptr, 0)
	wantErr(t, err, cudart.ErrInvalidValue)
	wantViolation(t, err, ViolationAccessDenied)

	require.NoError(t, s.imp.MemPoolSetAccess(0, s.ipool, []cudart.AccessDesc{{Location: cudart.DeviceLocation(1), Flags: cudart.AccessRead}}))
	require.NoError(t, s.imp.StreamSynchronize(1, 0))
	require.NoError(t, s.imp.EventSynchronize(0, mustEvent(t, s)))
	require.NoError(t, s.imp.MemcpyDtoHAsync(1, buf, iptr, 0))
	require.Equal(t, "peer", string(buf), "device 1 read")
	err = s.imp.MemsetAsync(1, iptr, 0, 1, 0)
	wantViolation(t, err, ViolationAccessDenied)
	require.NoError(t, s.imp.MemPoolSetAccess(0, s.ipool, rw))
	require.NoError(t, s.imp.MemsetAsync(1, iptr, 'P', 1, 0))
}

// mustEvent records an IPC event of the exporter, opened in the importer, and returns
// the importer's handle of it.
func mustEvent(t *testing.T, s shared) cudart.Event {
	e, o := s.exp.ipcEvent(s.imp)
	require.NoError(t, s.exp.EventRecord(0, e, 0))
	return o
}

func TestImportersPerAllocationAreBounded(t *testing.T) {
	s := newShared(t)
	ptr := s.exp.alloc(s.pool, 512)
	rec := s.exp.exportPtr(ptr)
	h, err := s.exp.MemPoolExportToShareableHandle(0, s.pool, cudart.HandleTypePosixFD)
	require.NoError(t, err)
	defer func() { _ = unix.Close(h.FD) }() // test cleanup
	s.imp.importPtr(s.ipool, rec)
	var last fx
	for range maxImporters - 1 {
		last = newFx(t)
		last.importPtr(last.importPool(h.FD), rec)
	}
	extra := newFx(t)
	_, err = extra.MemPoolImportPointer(0, extra.importPool(h.FD), rec)
	wantErr(t, err, ErrCapacity, cudart.ErrOutOfMemory)
	require.NoError(t, last.Close()) // a closed importer's slot goes back
	extra.importPtr(extra.importPool(h.FD), rec)
}

func TestIPCEvents(t *testing.T) {
	a, b := newFx(t), newFx(t)
	_, err := a.EventCreate(0, cudart.EventInterprocess)
	wantErr(t, err, cudart.ErrInvalidValue) // needs DisableTiming too
	_, err = a.EventCreate(0, 0x80)
	wantErr(t, err, cudart.ErrInvalidValue)
	plain, err := a.EventCreate(0, cudart.EventDisableTiming)
	require.NoError(t, err)
	_, err = a.IpcGetEventHandle(0, plain)
	wantErr(t, err, cudart.ErrInvalidValue)

	e, o := a.ipcEvent(b)
	h, err := a.IpcGetEventHandle(0, e)
	require.NoError(t, err)
	_, err = a.IpcOpenEventHandle(0, h)
	wantErr(t, err, cudart.ErrInvalidValue) // its own
	junk := h
	junk[30] ^= 1
	_, err = b.IpcOpenEventHandle(0, junk)
	wantErr(t, err, cudart.ErrInvalidValue)
	require.NoError(t, b.EventRecord(0, o, 0)) // an opened event can be recorded
	require.NoError(t, a.EventSynchronize(0, e))
	done, err := a.EventQuery(0, e)
	require.NoError(t, err)
	require.True(t, done, "EventQuery after EventSynchronize")

	// Mismatched or unknown handles.
	wantErr(t, a.EventRecord(1, e, 0), cudart.ErrInvalidResourceHandle) // event of device 0
	wantErr(t, a.EventRecord(0, e, 999), cudart.ErrInvalidResourceHandle)
	wantErr(t, a.EventRecord(0, o, 0), cudart.ErrInvalidResourceHandle) // b's handle
	wantErr(t, a.StreamDestroy(0, 0), cudart.ErrInvalidResourceHandle)
	_, err = a.StreamCreate(0, 0x10)
	wantErr(t, err, cudart.ErrInvalidValue)
	st, err := a.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	require.NoError(t, a.StreamDestroy(0, st))
	wantErr(t, a.StreamSynchronize(0, st), cudart.ErrInvalidResourceHandle)

	// Destroyed by its owner: using it is a violation, and so is opening it.
	require.NoError(t, a.EventDestroy(0, e))
	wantErr(t, a.EventDestroy(0, e), cudart.ErrInvalidResourceHandle)
	wantViolation(t, b.StreamWaitEvent(0, 0, o), ViolationUseAfterRelease)
	_, err = newFx(t).IpcOpenEventHandle(0, h)
	wantViolation(t, err, ViolationUseAfterRelease)
	require.NoError(t, b.EventDestroy(0, o))

	// Its owner closed: every opened event dies.
	e2, o2 := a.ipcEvent(b)
	_ = e2
	require.NoError(t, a.Close())
	_, err = b.EventQuery(0, o2)
	wantViolation(t, err, ViolationUseAfterRelease)
	_, err = newFx(t).IpcOpenEventHandle(0, h)
	wantErr(t, err, cudart.ErrInvalidValue) // nothing left to open
}

func TestCopyBetweenTwoImportedPools(t *testing.T) {
	s, u := newShared(t), newShared(t)
	// u's importer imports s's pool too: one Device holding two imported pools.
	h, err := s.exp.MemPoolExportToShareableHandle(0, s.pool, cudart.HandleTypePosixFD)
	require.NoError(t, err)
	defer func() { _ = unix.Close(h.FD) }() // test cleanup
	sp := u.imp.importPool(h.FD)
	src := s.exp.alloc(s.pool, 64)
	s.exp.write(src, []byte("cross pool"))
	dst := u.exp.alloc(u.pool, 64)
	e, o := s.exp.ipcEvent(u.imp)
	f, q := u.exp.ipcEvent(u.imp)
	ready(s.exp, e, u.imp, o)
	ready(u.exp, f, u.imp, q)
	isrc := u.imp.importPtr(sp, s.exp.exportPtr(src))
	idst := u.imp.importPtr(u.ipool, u.exp.exportPtr(dst))
	require.NoError(t, u.imp.MemcpyDtoDAsync(0, idst, isrc, 10, 0))
	ready(u.imp, q, u.exp, f)
	u.exp.wantBytes(dst, []byte("cross pool"))
	require.Equal(t, "cross pool", string(u.imp.read(isrc, 10)), "the source changed")
}

// Every failed call and every finished Device gives its descriptors back.
func TestNoDescriptorLeaks(t *testing.T) {
	count := func() int {
		ents, err := os.ReadDir("/proc/self/fd")
		require.NoError(t, err)
		return len(ents)
	}
	before := count()
	func() {
		exp, imp := New(WithFabric()), New(WithFabric())
		defer func() { _ = exp.Close() }() // test cleanup
		defer func() { _ = imp.Close() }() // test cleanup
		f, g := fx{t, exp}, fx{t, imp}
		p, fd := f.exported()
		ip := g.importPool(fd)
		require.NoError(t, unix.Close(fd))
		_, err := imp.MemPoolImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: 0})
		wantErr(t, err, cudart.ErrInvalidValue)
		fp := f.pool(cudart.PoolProps{HandleTypes: cudart.HandleTypeFabric, Location: cudart.DeviceLocation(0)})
		h, err := exp.MemPoolExportToShareableHandle(0, fp, cudart.HandleTypeFabric)
		require.NoError(t, err)
		w, _ := unseal(h.Fabric, fabricMagic)
		h.Fabric = sealed(w[0], w[1], w[2], w[3]^1, w[4]) // another pool's uid at that descriptor
		_, err = imp.MemPoolImportFromShareableHandle(0, h)
		wantErr(t, err, cudart.ErrInvalidValue)
		f.ipcEvent(g)
		ptr := f.alloc(p, 512)
		g.importPtr(ip, f.exportPtr(ptr))
		require.NoError(t, imp.MemPoolDestroy(0, ip))
	}()
	require.Equal(t, before, count(), "descriptors open before and after")
}
