package cudarttest

import (
	"testing"

	"golang.org/x/sys/unix"
)

func TestTwoDevicesShareAPool(t *testing.T) {
	exp, imp := newFx(t), newFx(t)
	p, fd := exp.exported()
	defer unix.Close(fd)
	ptr := exp.alloc(p, 1000)
	exp.write(ptr, []byte("from the exporter"))
	e, o := exp.ipcEvent(imp)
	ready(exp, e, imp, o)

	ip := imp.importPool(fd)
	iptr := imp.importPtr(ip, exp.exportPtr(ptr))
	if iptr != ptr {
		t.Fatalf("imported at %#x, exported at %#x: addresses must match", iptr, ptr)
	}
	imp.wantBytes(iptr, []byte("from the exporter"))
	imp.write(iptr+100, []byte("from the importer"))
	ready(imp, o, exp, e)
	exp.wantBytes(ptr+100, []byte("from the importer"))
	ok(t, imp.FreeAsync(0, iptr, 0))
	ready(imp, o, exp, e)
	ok(t, exp.FreeAsync(0, ptr, 0))
	ok(t, imp.Err())
	ok(t, exp.Err())
}
