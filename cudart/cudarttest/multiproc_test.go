//go:build linux

package cudarttest

import (
	"fmt"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/stretchr/testify/require"
)

func TestChildImportsReadsAndWrites(t *testing.T) {
	exp := newFx(t)
	child := startRemote(t)
	p, fd := exp.exported()
	defer func() { _ = unix.Close(fd) }() // test cleanup
	ptr := exp.alloc(p, 4096)
	exp.write(ptr, []byte("parent wrote this"))
	e, err := exp.EventCreate(0, cudart.EventIPC)
	require.NoError(t, err)
	h, err := exp.IpcGetEventHandle(0, e)
	require.NoError(t, err)
	require.NoError(t, exp.EventRecord(0, e, 0))

	child.do(request{Op: "import-pool"}, fd)
	child.do(request{Op: "open-event", Data: h[:]})
	data := exp.exportPtr(ptr)
	require.Equal(t, uint64(ptr), child.do(request{Op: "import-ptr", Data: data[:]}).Ptr, "the child's import is at the parent's address")
	child.do(request{Op: "wait"})
	require.Equal(t, "parent wrote this", string(child.do(request{Op: "read", Ptr: uint64(ptr), N: 17}).Data), "the child read")
	child.do(request{Op: "write", Ptr: uint64(ptr) + 1000, Data: []byte("child wrote this")})
	child.do(request{Op: "free", Ptr: uint64(ptr)})
	child.do(request{Op: "record"})
	require.NoError(t, exp.StreamWaitEvent(0, 0, e))
	exp.wantBytes(ptr+1000, []byte("child wrote this"))
	require.NoError(t, exp.FreeAsync(0, ptr, 0))
	require.Empty(t, child.do(request{Op: "violations"}).Kinds, "the child saw violations")
	child.exit()
	require.NoError(t, exp.Err())
}

// childImporter starts a child Device and gives it the exporter's pool.
func childImporter(t *testing.T, exp fx) (*remote, cudart.MemPool) {
	t.Helper()
	child := startRemote(t)
	p, fd := exp.exported()
	defer func() { _ = unix.Close(fd) }() // test cleanup
	child.do(request{Op: "import-pool"}, fd)
	return child, p
}

func (r *remote) importPtr(data cudart.PtrExportData) uint64 {
	r.t.Helper()
	return r.do(request{Op: "import-ptr", Data: data[:]}).Ptr
}

// wantKinds fails unless a failed remote call reported exactly kinds.
func wantKinds(t *testing.T, rep reply, kinds ...ViolationKind) {
	t.Helper()
	require.NotEmpty(t, rep.Err, "remote reply %+v, want an error reporting %v", rep, kinds)
	require.Equal(t, kinds, rep.Kinds, "remote reply %+v", rep)
}

func TestChildStaleAndDoubleImports(t *testing.T) {
	exp := newFx(t)
	child, p := childImporter(t, exp)
	ptr := exp.alloc(p, 512)
	stale := exp.exportPtr(ptr)
	require.NoError(t, exp.FreeAsync(0, ptr, 0))
	require.NoError(t, exp.sync())
	iptr := child.importPtr(stale) // FACTS 3: accepted
	rep, _ := child.call(request{Op: "read", Ptr: iptr, N: 4})
	wantKinds(t, rep, ViolationUseAfterRelease)
	child.do(request{Op: "free", Ptr: iptr})
	child.do(request{Op: "sync"}) // else the free, run later, unmaps the next import there

	live := exp.alloc(p, 512)
	rec := exp.exportPtr(live)
	first, second := child.importPtr(rec), child.importPtr(rec)
	require.Equal(t, first, second, "two imports of one record")
	require.Equal(t, uint64(live), first, "the import is at the allocation's address")
	child.do(request{Op: "free", Ptr: second})
	rep, _ = child.call(request{Op: "free", Ptr: first}) // FACTS 4
	wantKinds(t, rep, ViolationUseAfterRelease)
	require.Contains(t, rep.Err, "invalid argument", "the second free fails as the driver's does")
	h := child.do(request{Op: "create-event"}).Data
	child.do(request{Op: "record"})
	e, err := exp.IpcOpenEventHandle(0, cudart.IpcEventHandle(h))
	require.NoError(t, err)
	require.NoError(t, exp.StreamWaitEvent(0, 0, e))
	require.NoError(t, exp.FreeAsync(0, live, 0))
	require.NoError(t, exp.Err())
	child.exit()
}

func TestExporterFreesWhileChildHolds(t *testing.T) {
	exp := newFx(t)
	child, p := childImporter(t, exp)
	ptr := exp.alloc(p, 512)
	child.importPtr(exp.exportPtr(ptr))
	require.NoError(t, exp.FreeAsync(0, ptr, 0))
	err := exp.sync()
	wantViolation(t, err, ViolationExporterFreedWhileImported)
	require.Contains(t, err.Error(), fmt.Sprintf("pid %d ", child.pid), "the violation names the importer")
	rep, _ := child.call(request{Op: "read", Ptr: uint64(ptr), N: 1})
	wantKinds(t, rep, ViolationUseAfterRelease)
	child.exit()
}

// A killed importer's mappings are gone, as with the driver: it holds nothing,
// whether already reaped or still a zombie.
func TestKilledImporterHoldsNothing(t *testing.T) {
	for _, reap := range []bool{false, true} {
		exp := newFx(t)
		child, p := childImporter(t, exp)
		ptr := exp.alloc(p, 512)
		child.importPtr(exp.exportPtr(ptr))
		require.NoError(t, syscall.Kill(child.pid, syscall.SIGKILL))
		if reap {
			_ = child.cmd.Wait() // test cleanup
		} else {
			// Wait for it to be a zombie without reaping it.
			var info unix.Siginfo
			require.NoError(t, unix.Waitid(unix.P_PID, child.pid, &info, unix.WEXITED|unix.WNOWAIT, nil))
		}
		require.NoError(t, exp.FreeAsync(0, ptr, 0))
		require.NoError(t, exp.Err())
	}
}

// FACTS 7: the exporting process dies; the importer reads on, frees its import, and
// then cannot destroy the pool.
func TestExporterChildDiesFirst(t *testing.T) {
	imp := newFx(t)
	child := startRemote(t)
	rep, fds := child.call(request{Op: "export-pool"})
	require.Empty(t, rep.Err, "export-pool")
	require.Len(t, fds, 1, "export-pool's descriptors")
	p := imp.importPool(fds[0])
	_ = unix.Close(fds[0]) // test cleanup
	ptr := child.do(request{Op: "alloc", N: 1000}).Ptr
	child.do(request{Op: "write", Ptr: ptr, Data: []byte("written by the dead")})
	h := child.do(request{Op: "create-event"}).Data
	child.do(request{Op: "record"})
	child.do(request{Op: "sync"}) // the write is done before the child dies
	rec := child.do(request{Op: "export-ptr", Ptr: ptr}).Data
	e, err := imp.IpcOpenEventHandle(0, cudart.IpcEventHandle(h))
	require.NoError(t, err)
	require.NoError(t, imp.StreamWaitEvent(0, 0, e))
	iptr := imp.importPtr(p, cudart.PtrExportData(rec))

	require.NoError(t, syscall.Kill(child.pid, syscall.SIGKILL))
	_ = child.cmd.Wait() // test cleanup
	imp.wantBytes(iptr, []byte("written by the dead"))
	require.NoError(t, imp.FreeAsync(0, iptr, 0))
	wantErr(t, imp.MemPoolDestroy(0, p), cudart.ErrInvalidValue)
	_, err = imp.EventQuery(0, e) // its events died with it
	wantViolation(t, err, ViolationUseAfterRelease)
}

func TestChildExportsAndParentImportsOverEvents(t *testing.T) {
	imp := newFx(t)
	child := startRemote(t)
	_, fds := child.call(request{Op: "export-pool"})
	p := imp.importPool(fds[0])
	_ = unix.Close(fds[0])         // test cleanup
	child.do(request{Op: "stall"}) // the child's GPU is busy
	ptr := child.do(request{Op: "alloc", N: 64}).Ptr
	iptr := imp.importPtr(p, cudart.PtrExportData(child.do(request{Op: "export-ptr", Ptr: ptr}).Data))
	h := child.do(request{Op: "create-event"}).Data
	e, err := imp.IpcOpenEventHandle(0, cudart.IpcEventHandle(h))
	require.NoError(t, err)
	child.do(request{Op: "write", Ptr: ptr, Data: []byte("round 1")})
	_, err = imp.MemcpyDtoHAsyncN(iptr, 7) // not waited for: its allocation has not run
	wantViolation(t, err, ViolationUnorderedRead)
	child.do(request{Op: "record"})
	child.do(request{Op: "resume"})
	require.NoError(t, imp.StreamWaitEvent(0, 0, e))
	imp.wantBytes(iptr, []byte("round 1"))
	require.NoError(t, imp.FreeAsync(0, iptr, 0))
	require.NoError(t, imp.EventRecord(0, e, 0)) // the importer's free is done: tell the exporter
	child.do(request{Op: "wait"})
	child.do(request{Op: "free", Ptr: ptr})
	require.Empty(t, child.do(request{Op: "violations"}).Kinds, "the child saw violations")
	child.exit()
	// A Device that closed while its process lives on cannot be destroyed from either.
	wantErr(t, imp.MemPoolDestroy(0, p), cudart.ErrInvalidValue)
}
