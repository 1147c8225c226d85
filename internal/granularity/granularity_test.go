package granularity

import (
	"errors"
	"math"
	"math/big"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

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
				assert.ErrorIs(t, err, ErrOverflow, "RoundUp(%d, %d) = %d", n, g, got)
				continue
			}
			if assert.NoError(t, err, "RoundUp(%d, %d)", n, g) {
				assert.Equal(t, want, got, "RoundUp(%d, %d)", n, g)
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
			got, err := RoundUp(n, g)
			require.NoError(t, err, "RoundUp(%d, %d)", n, g)
			require.Equal(t, want, got, "RoundUp(%d, %d)", n, g)
			got, err = RoundDown(n, g)
			require.NoError(t, err, "RoundDown(%d, %d)", n, g)
			require.Equal(t, n-n%g, got, "RoundDown(%d, %d)", n, g)
			require.Equal(t, n%g == 0, IsAligned(n, g), "IsAligned(%d, %d)", n, g)
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
		if c.err == nil {
			assert.NoError(t, err, "RoundUp(%d, %d)", c.n, c.g)
		} else {
			assert.ErrorIs(t, err, c.err, "RoundUp(%d, %d)", c.n, c.g)
		}
		assert.Equal(t, c.want, got, "RoundUp(%d, %d)", c.n, c.g)
	}
	_, err := RoundDown(1, 0)
	assert.ErrorIs(t, err, ErrZeroGranularity, "RoundDown(1, 0)")
	got, _ := RoundDown(math.MaxUint64, 2*mib)
	assert.Equal(t, top, got, "RoundDown(max, 2 MiB)")
	assert.False(t, IsAligned(0, 0), "IsAligned(0, 0) with granularity 0")
	assert.False(t, IsAligned(4, 0), "IsAligned(4, 0) with granularity 0")
	assert.True(t, IsAligned(0, 2*mib), "IsAligned at 0")
	assert.True(t, IsAligned(top, 2*mib), "IsAligned at the top multiple")
	assert.False(t, IsAligned(top+1, 2*mib), "IsAligned past the top multiple")
	assert.False(t, IsAligned(6144, 2*mib), "IsAligned 6144 bytes into a granule")
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
				g, err := c.Get(1, cudart.HandleTypePosixFD)
				if !assert.NoError(t, err, "Get(1, posix-fd)") || !assert.Equal(t, uint64(4*mib), g, "Get(1, posix-fd)") {
					return
				}
			}
		}()
	}
	wg.Wait()
	// Concurrent first callers may each ask; later ones must not.
	first := q.asked.Load()
	require.True(t, first >= 1 && first <= 16, "asked %d times for one key", first)
	g, err := c.Get(0, cudart.HandleTypeFabric)
	require.NoError(t, err, "Get(0, fabric)")
	require.Equal(t, uint64(4*mib), g, "Get(0, fabric)")
	_, _ = c.Get(0, cudart.HandleTypeFabric)  // test cleanup
	_, _ = c.Get(1, cudart.HandleTypePosixFD) // test cleanup
	require.Equal(t, first+1, q.asked.Load(), "times asked")
}

func TestCacheDoesNotRememberFailures(t *testing.T) {
	q := &countingQuerier{answers: map[cudart.HandleType]uint64{cudart.HandleTypePosixFD: 2 * mib, cudart.HandleTypeNone: 0}}
	q.fail.Store(1)
	c := NewCache(q)
	_, err := c.Get(0, cudart.HandleTypePosixFD)
	require.ErrorIs(t, err, cudart.ErrInvalidDevice, "Get: want the runtime's error")
	g, err := c.Get(0, cudart.HandleTypePosixFD)
	require.NoError(t, err, "Get after a failure")
	require.Equal(t, uint64(2*mib), g, "Get after a failure")
	for i := 0; i < 2; i++ {
		_, err := c.Get(0, cudart.HandleTypeNone)
		require.ErrorIs(t, err, ErrZeroGranularity, "Get of a zero granularity")
	}
	require.Equal(t, int32(4), q.asked.Load(), "times asked (failures and zeros are asked again)")
}

func TestAcquireSharesUntilReleased(t *testing.T) {
	q := &countingQuerier{answers: map[cudart.HandleType]uint64{cudart.HandleTypePosixFD: 2 * mib}}
	a, b := Acquire(q), Acquire(q)
	require.Same(t, a, b, "two Acquires of one Querier returned different caches")
	_, _ = a.Get(0, cudart.HandleTypePosixFD) // test cleanup
	_, _ = b.Get(0, cudart.HandleTypePosixFD) // test cleanup
	require.Equal(t, int32(1), q.asked.Load(), "times asked through a shared cache")
	other := Acquire(&countingQuerier{})
	require.NotSame(t, a, other, "different Queriers share a cache")
	other.Release()
	a.Release()
	c := Acquire(q)
	require.Same(t, b, c, "cache forgotten while still held")
	c.Release()
	b.Release()
	b.Release() // one too many: does nothing
	c = Acquire(q)
	defer c.Release()
	require.NotSame(t, a, c, "cache kept after its last Release")
	shared.mu.Lock()
	n := len(shared.caches)
	shared.mu.Unlock()
	require.Equal(t, 1, n, "shared caches remembered")
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
	require.NotSame(t, a, b, "an uncomparable Querier was shared")
	g, err := a.Get(0, cudart.HandleTypePosixFD)
	require.NoError(t, err)
	require.Equal(t, uint64(2*mib), g)
}
