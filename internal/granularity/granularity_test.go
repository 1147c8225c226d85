package granularity

import (
	"errors"
	"math"
	"math/big"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/cudapool/cudapool/cudart"
)

const mib = 1 << 20

// bigRoundUp is RoundUp computed without overflow, for checking.
func bigRoundUp(n, g uint64) (uint64, bool) {
	bn, bg := new(big.Int).SetUint64(n), new(big.Int).SetUint64(g)
	q := new(big.Int).Add(bn, new(big.Int).Sub(bg, big.NewInt(1)))
	q.Quo(q, bg).Mul(q, bg)
	if !q.IsUint64() {
		return 0, false
	}
	return q.Uint64(), true
}

// granularities are the ones checked: the unit, small powers of two and odd values,
// the target GPUs' 2 MiB, and values whose multiples sit at the top of the range.
var granularities = []uint64{1, 2, 3, 7, 512, 4096, 2 * mib, 3 * mib, 1 << 32, 1<<63 - 1, 1 << 63, 1<<63 + 1, math.MaxUint64 - 1, math.MaxUint64}

// sizesFor are the sizes checked against g: 0, 1, around each of the first few
// multiples of g, and around the largest multiples below 2^64.
func sizesFor(g uint64) []uint64 {
	ns := []uint64{0, 1, 2, math.MaxUint64, math.MaxUint64 - 1}
	top := math.MaxUint64 / g * g
	for _, m := range []uint64{g, 2 * g, 3 * g, top, top - g} {
		if m/g == 0 || m > top {
			continue // the multiple itself overflowed
		}
		ns = append(ns, m-1, m, m+1)
	}
	return ns
}

func TestRoundUpAgainstBigIntegers(t *testing.T) {
	for _, g := range granularities {
		for _, n := range sizesFor(g) {
			want, ok := bigRoundUp(n, g)
			got, err := RoundUp(n, g)
			if !ok {
				if !errors.Is(err, ErrOverflow) {
					t.Errorf("RoundUp(%d, %d) = %d, %v; want ErrOverflow", n, g, got, err)
				}
				continue
			}
			if err != nil || got != want {
				t.Errorf("RoundUp(%d, %d) = %d, %v; want %d", n, g, got, err, want)
			}
		}
	}
}

func TestRoundUpExhaustiveSmall(t *testing.T) {
	for g := uint64(1); g <= 64; g++ {
		for n := uint64(0); n <= 1024; n++ {
			want := n
			for want%g != 0 {
				want++
			}
			if got, err := RoundUp(n, g); err != nil || got != want {
				t.Fatalf("RoundUp(%d, %d) = %d, %v; want %d", n, g, got, err, want)
			}
			down := n - n%g
			if got, err := RoundDown(n, g); err != nil || got != down {
				t.Fatalf("RoundDown(%d, %d) = %d, %v; want %d", n, g, got, err, down)
			}
			if IsAligned(n, g) != (n%g == 0) {
				t.Fatalf("IsAligned(%d, %d) = %v", n, g, IsAligned(n, g))
			}
		}
	}
}

func TestRoundingEdges(t *testing.T) {
	top := uint64(math.MaxUint64 / (2 * mib) * (2 * mib))
	cases := []struct {
		n, g, want uint64
		err        error
	}{
		{0, 2 * mib, 0, nil},
		{1, 2 * mib, 2 * mib, nil},
		{2 * mib, 2 * mib, 2 * mib, nil},
		{2*mib + 1, 2 * mib, 4 * mib, nil},
		{top, 2 * mib, top, nil},
		{top + 1, 2 * mib, 0, ErrOverflow},
		{math.MaxUint64, 2 * mib, 0, ErrOverflow},
		{math.MaxUint64, 1, math.MaxUint64, nil},
		{math.MaxUint64, math.MaxUint64, math.MaxUint64, nil},
		{1, math.MaxUint64, math.MaxUint64, nil},
		{1<<63 + 1, 1 << 63, 0, ErrOverflow},
		{5, 0, 0, ErrZeroGranularity},
		{0, 0, 0, ErrZeroGranularity},
	}
	for _, c := range cases {
		got, err := RoundUp(c.n, c.g)
		if !errors.Is(err, c.err) || got != c.want || (c.err == nil) != (err == nil) {
			t.Errorf("RoundUp(%d, %d) = %d, %v; want %d, %v", c.n, c.g, got, err, c.want, c.err)
		}
	}
	if _, err := RoundDown(1, 0); !errors.Is(err, ErrZeroGranularity) {
		t.Errorf("RoundDown(1, 0) error = %v; want ErrZeroGranularity", err)
	}
	if got, _ := RoundDown(math.MaxUint64, 2*mib); got != top {
		t.Errorf("RoundDown(max, 2 MiB) = %d; want %d", got, top)
	}
	if IsAligned(0, 0) || IsAligned(4, 0) {
		t.Error("IsAligned with granularity 0 reported true")
	}
	if !IsAligned(0, 2*mib) || !IsAligned(top, 2*mib) || IsAligned(top+1, 2*mib) || IsAligned(6144, 2*mib) {
		t.Error("IsAligned wrong at 0, the top multiple, or 6144 bytes into a granule")
	}
}

// countingQuerier answers granularities from a table and counts the questions.
type countingQuerier struct {
	answers map[cudart.HandleType]uint64
	fail    atomic.Int32 // fail this many more questions
	asked   atomic.Int32
}

func (q *countingQuerier) AllocationGranularity(dev int, ht cudart.HandleType, recommended bool) (uint64, error) {
	q.asked.Add(1)
	if recommended {
		return 0, errors.New("the cache must ask for the minimum granularity")
	}
	if q.fail.Load() > 0 {
		q.fail.Add(-1)
		return 0, cudart.NewError("cuMemGetAllocationGranularity", cudart.ErrInvalidDevice)
	}
	return q.answers[ht] * uint64(dev+1), nil
}

func TestCacheAsksOncePerDeviceAndHandleType(t *testing.T) {
	q := &countingQuerier{answers: map[cudart.HandleType]uint64{cudart.HandleTypePosixFD: 2 * mib, cudart.HandleTypeFabric: 4 * mib}}
	c := NewCache(q)
	var wg sync.WaitGroup
	for i := 0; i < 16; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; j < 100; j++ {
				if g, err := c.Get(1, cudart.HandleTypePosixFD); err != nil || g != 4*mib {
					t.Errorf("Get(1, posix-fd) = %d, %v; want 4 MiB", g, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	// Concurrent first callers may each ask; later ones must not.
	first := q.asked.Load()
	if first < 1 || first > 16 {
		t.Fatalf("asked %d times for one key", first)
	}
	if g, err := c.Get(0, cudart.HandleTypeFabric); err != nil || g != 4*mib {
		t.Fatalf("Get(0, fabric) = %d, %v", g, err)
	}
	c.Get(0, cudart.HandleTypeFabric)
	c.Get(1, cudart.HandleTypePosixFD)
	if got := q.asked.Load(); got != first+1 {
		t.Fatalf("asked %d times; want %d", got, first+1)
	}
}

func TestCacheDoesNotRememberFailures(t *testing.T) {
	q := &countingQuerier{answers: map[cudart.HandleType]uint64{cudart.HandleTypePosixFD: 2 * mib, cudart.HandleTypeNone: 0}}
	q.fail.Store(1)
	c := NewCache(q)
	if _, err := c.Get(0, cudart.HandleTypePosixFD); !errors.Is(err, cudart.ErrInvalidDevice) {
		t.Fatalf("Get error = %v; want the runtime's ErrInvalidDevice", err)
	}
	if g, err := c.Get(0, cudart.HandleTypePosixFD); err != nil || g != 2*mib {
		t.Fatalf("Get after a failure = %d, %v; want 2 MiB", g, err)
	}
	for i := 0; i < 2; i++ {
		if _, err := c.Get(0, cudart.HandleTypeNone); !errors.Is(err, ErrZeroGranularity) {
			t.Fatalf("Get of a zero granularity: error = %v; want ErrZeroGranularity", err)
		}
	}
	if got := q.asked.Load(); got != 4 {
		t.Fatalf("asked %d times; want 4 (failures and zeros are asked again)", got)
	}
}

func TestAcquireSharesUntilReleased(t *testing.T) {
	q := &countingQuerier{answers: map[cudart.HandleType]uint64{cudart.HandleTypePosixFD: 2 * mib}}
	a, b := Acquire(q), Acquire(q)
	if a != b {
		t.Fatal("two Acquires of one Querier returned different caches")
	}
	a.Get(0, cudart.HandleTypePosixFD)
	b.Get(0, cudart.HandleTypePosixFD)
	if q.asked.Load() != 1 {
		t.Fatalf("asked %d times through a shared cache; want 1", q.asked.Load())
	}
	if other := Acquire(&countingQuerier{}); other == a {
		t.Fatal("different Queriers share a cache")
	} else {
		other.Release()
	}
	a.Release()
	if c := Acquire(q); c != b {
		t.Fatal("cache forgotten while still held")
	} else {
		c.Release()
	}
	b.Release()
	b.Release() // one too many: does nothing
	c := Acquire(q)
	defer c.Release()
	if c == a {
		t.Fatal("cache kept after its last Release")
	}
	shared.mu.Lock()
	n := len(shared.caches)
	shared.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d shared caches remembered; want 1", n)
	}
}

// valueQuerier cannot be a map key: it holds a slice and is passed by value.
type valueQuerier struct{ answers []uint64 }

func (q valueQuerier) AllocationGranularity(dev int, ht cudart.HandleType, recommended bool) (uint64, error) {
	return q.answers[dev], nil
}

func TestAcquireOfUncomparableQuerier(t *testing.T) {
	q := valueQuerier{answers: []uint64{2 * mib}}
	a, b := Acquire(q), Acquire(q)
	defer a.Release()
	defer b.Release()
	if a == b {
		t.Fatal("an uncomparable Querier was shared")
	}
	if g, err := a.Get(0, cudart.HandleTypePosixFD); err != nil || g != 2*mib {
		t.Fatalf("Get = %d, %v", g, err)
	}
}
