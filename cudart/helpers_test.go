package cudart_test

import "testing"

// must returns a function that returns a call's value, failing t if the call failed.
func must[T any](t testing.TB, what string) func(T, error) T {
	return func(v T, err error) T {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return v
	}
}

func noErr(t testing.TB, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// pattern is n bytes that differ from seed to seed and from byte to nearby byte.
func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7)
	}
	return b
}

func TestSummarizeMatchesCrefStatistic(t *testing.T) {
	perOp := []float64{1000} // the warm-up batch, left out
	for i := range 15 {
		perOp = append(perOp, float64(100+i)) // median 107
	}
	if m, l := summarize(perOp); m != 107 || l != 0 {
		t.Errorf("16 batches: measured %v, late %v; want 107, 0", m, l)
	}
	perOp = append(perOp, 300, 200, 500)
	if m, l := summarize(perOp); m != 107 || l != 300 {
		t.Errorf("19 batches: measured %v, late %v; want 107, 300", m, l)
	}
	if m, l := summarize(perOp[:3]); m != 101 || l != 0 {
		t.Errorf("3 batches: measured %v, late %v", m, l)
	}
	if m, l := summarize(perOp[:1]); m != 0 || l != 0 {
		t.Errorf("the warm-up batch alone: measured %v, late %v; want nothing", m, l)
	}
}
