package gputest

import (
	"slices"
	"testing"
	"time"
)

// MeasuredBatches is how many batches after the warm-up one give ns/op, as in
// bench/cref.
const MeasuredBatches = 15

// Batches times a benchmark loop in batches of n operations, each ended by the
// caller's synchronize, so that a Go benchmark reports the statistic bench/cref
// prints: after one warm-up batch, the median of the next MeasuredBatches batches'
// time per operation. Medians keep a stray descheduling or clock step out of the
// comparison with C.
type Batches struct {
	n, done int
	start   time.Time
	perOp   []float64
}

// NewBatches starts timing batches of n operations.
func NewBatches(n int) *Batches { return &Batches{n: n, start: time.Now()} }

// Full counts one operation and reports whether it ended a batch; the caller then
// synchronizes and calls Lap.
func (bt *Batches) Full() bool {
	bt.done++
	return bt.done%bt.n == 0
}

// Done is how many operations Full has counted.
func (bt *Batches) Done() int { return bt.done }

// Lap ends a batch.
func (bt *Batches) Lap() {
	now := time.Now()
	bt.perOp = append(bt.perOp, float64(now.Sub(bt.start).Nanoseconds())/float64(bt.n))
	bt.start = now
}

// Report replaces ns/op with the median of the measured batches and adds
// late-ns/op, the median of the batches b.Loop ran beyond those, when there were
// batches enough. Where late-ns/op exceeds ns/op, the driver's cost grows with the
// operations a pool has seen.
func (bt *Batches) Report(b *testing.B) {
	measured, late := Summarize(bt.perOp)
	if measured > 0 {
		b.ReportMetric(measured, "ns/op")
	}
	if late > 0 {
		b.ReportMetric(late, "late-ns/op")
	}
}

// Summarize is the median of the measured batches (after the first, at most
// MeasuredBatches) and of the batches after those; 0 where there are none.
func Summarize(perOp []float64) (measured, late float64) {
	if len(perOp) < 2 {
		return 0, 0
	}
	end := min(len(perOp), 1+MeasuredBatches)
	measured = median(perOp[1:end])
	if end < len(perOp) {
		late = median(perOp[end:])
	}
	return measured, late
}

func median(v []float64) float64 {
	v = slices.Clone(v)
	slices.Sort(v)
	return v[len(v)/2]
}
