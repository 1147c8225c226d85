package gputest

import "testing"

func TestSummarizeMatchesCrefStatistic(t *testing.T) {
	perOp := []float64{1000} // the warm-up batch, left out
	for i := range 15 {
		perOp = append(perOp, float64(100+i)) // median 107
	}
	if m, l := Summarize(perOp); m != 107 || l != 0 {
		t.Errorf("16 batches: measured %v, late %v; want 107, 0", m, l)
	}
	perOp = append(perOp, 300, 200, 500)
	if m, l := Summarize(perOp); m != 107 || l != 300 {
		t.Errorf("19 batches: measured %v, late %v; want 107, 300", m, l)
	}
	if m, l := Summarize(perOp[:3]); m != 101 || l != 0 {
		t.Errorf("3 batches: measured %v, late %v", m, l)
	}
	if m, l := Summarize(perOp[:1]); m != 0 || l != 0 {
		t.Errorf("the warm-up batch alone: measured %v, late %v; want nothing", m, l)
	}
}
