//go:build linux

package cudarttest

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Devices read one allocation at once, each under its own lock only, while another
// looks at the marks (as a free's check does). Every mark it sees must be one that was
// written: export's TestConcurrentOpensAndReleases saw, about once in 300 runs, one
// Device's ident with another's stream and later epoch, which made an ordered free an
// unordered one. Without the marks lock this fails within a few thousand looks.
func TestMarksAreSeenWhole(t *testing.T) {
	reg, err := newRegion("cudarttest-marks-test", entryOff(1))
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
		n, m := uint64(d+1), marks{reg, entryOff(0), ids[d]}
		wg.Go(func() {
			for i := uint64(0); ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				s := i % streams
				m.read(&stream{id: n*100 + s}, n*1e9+s*1e6+i%1e6)
			}
		})
	}
	defer func() { close(stop); wg.Wait() }()
	checker := marks{reg, entryOff(0), ids[devices]}
	end := time.Now().Add(most) // the lock makes looks slow on a busy machine
	for i := 0; i < looks && time.Now().Before(end); i++ {
		for _, a := range checker.readers() {
			n := uint64(a.id.nonce()-ids[0].nonce()) + 1
			require.Equal(t, n, a.stream/100, "mark %v at epoch %d is half another's", a, a.epoch)
			require.Equal(t, n, a.epoch/1e9, "mark %v at epoch %d is half another's", a, a.epoch)
			require.Equal(t, a.stream%100, a.epoch/1e6%1000, "mark %v at epoch %d is half another's", a, a.epoch)
		}
	}
}
