//go:build linux

package cudarttest

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// Devices read one allocation at once, each under its own lock only, while another
// looks at the marks (as a free's check does). Every mark it sees must be one that was
// written: export's TestConcurrentOpensAndReleases saw, about once in 300 runs, one
// Device's ident with another's stream and later epoch, which made an ordered free an
// unordered one. Without the marks lock this fails within a few thousand looks.
func TestMarksAreSeenWhole(t *testing.T) {
	reg, err := newRegion("cudarttest-marks-test", marksOff(1))
	require.NoError(t, err)
	t.Cleanup(reg.release)
	const devices, streams, looks, most = 3, 3, 20000, 500 * time.Millisecond
	ids := make([]ident, devices+1)
	for d := range ids {
		ids[d] = registerInstance() // alive, so that no one takes its lock over
		t.Cleanup(func() { unregisterInstance(ids[d]) })
	}
	// The mark of Device n's read number i on its stream s says n and s in every word:
	// stream n*100+s, epoch n*1e9 + s*1e6 + i%1e6.
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for d := range devices {
		n, m := uint64(d+1), marks{reg, entryOff(0), marksOff(0), ids[d]}
		wg.Go(func() {
			for i := uint64(0); ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				s := i % streams
				m.read(&stream{id: n*100 + s}, n*1e9+s*1e6+i%1e6, n*64, n*64+64)
			}
		})
	}
	defer func() { close(stop); wg.Wait() }()
	checker := marks{reg, entryOff(0), marksOff(0), ids[devices]}
	end := time.Now().Add(most) // the lock makes looks slow on a busy machine
	for i := 0; i < looks && time.Now().Before(end); i++ {
		for _, a := range checker.overlapping(0, ^uint64(0)) {
			n := uint64(a.id.nonce()-ids[0].nonce()) + 1
			require.Equal(t, n, a.stream/100, "mark %v at epoch %d is half another's", a, a.epoch)
			require.Equal(t, n, a.epoch/1e9, "mark %v at epoch %d is half another's", a, a.epoch)
			require.Equal(t, a.stream%100, a.epoch/1e6%1000, "mark %v at epoch %d is half another's", a, a.epoch)
		}
	}
}

// Marks are per byte range: two Devices writing different bytes of one allocation at
// once are not reported (a KV slab is one allocation, and replicas write different
// pages of it at once), while writes of the same bytes still are. With one mark per
// allocation the first importer write below was an unordered write.
func TestMarksArePerRange(t *testing.T) {
	exp, imp := newFx(t), newFx(t)
	p, fd := exp.exported()
	defer func() { _ = unix.Close(fd) }() // test cleanup
	ptr := exp.alloc(p, 4096)
	exp.write(ptr, make([]byte, 4096))
	e, o := exp.ipcEvent(imp)
	ready(exp, e, imp, o)
	iptr := imp.importPtr(imp.importPool(fd), exp.exportPtr(ptr))

	// The importer's write is queued before the exporter's runs, and runs after it.
	resume := imp.stall()
	imp.write(iptr+1000, []byte("importer's bytes"))
	exp.write(ptr, []byte("exporter's bytes"))
	require.NoError(t, exp.sync())
	resume()
	require.NoError(t, imp.sync(), "different bytes of one allocation")
	imp.wantBytes(iptr, []byte("exporter's bytes"))
	exp.wantBytes(ptr+1000, []byte("importer's bytes"))

	// The same again, over bytes the exporter writes too.
	resume = imp.stall()
	imp.write(iptr+8, []byte("overlap"))
	exp.write(ptr, []byte("exporter's bytes"))
	require.NoError(t, exp.sync())
	resume()
	wantViolation(t, imp.sync(), ViolationUnorderedWrite)
}
