//go:build linux

package cudarttest

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
)

func TestFreeScheduleParse(t *testing.T) {
	s, err := ParseFreeSchedule("7, 100,200,150ms")
	require.NoError(t, err)
	assert.Equal(t, FreeSchedule{Seed: 7, Low: 100, High: 200, Period: 150 * time.Millisecond}, s)
	again, err := ParseFreeSchedule(s.String())
	require.NoError(t, err)
	assert.Equal(t, s, again, "String is what ParseFreeSchedule takes")
	for _, bad := range []string{"", "7,100,200", "7,100,200,1s,9", "x,100,200,1s", "7,-1,200,1s", "7,100,y,1s", "7,300,200,1s", "7,100,200,soon", "7,100,200,0s", "7,100,200,-1s"} {
		_, err := ParseFreeSchedule(bad)
		assert.Error(t, err, "%q", bad)
	}
}

func TestFreeScheduleAt(t *testing.T) {
	s := FreeSchedule{Seed: 3, Low: 1000, High: 1010, Period: 100 * time.Millisecond}
	seen := map[uint64]bool{}
	for i := range 200 {
		at := time.Duration(i) * 50 * time.Millisecond
		v := s.At(at, 0)
		require.GreaterOrEqual(t, v, s.Low)
		require.LessOrEqual(t, v, s.High)
		require.Equal(t, v, s.At(at, 0), "the same for the same arguments")
		require.Equal(t, v, s.At(at/s.Period*s.Period, 0), "one level a period")
		seen[v] = true
	}
	assert.Greater(t, len(seen), 5, "the levels of 100 periods vary")
	assert.Equal(t, uint64(5), FreeSchedule{Low: 5, High: 5, Period: time.Second}.At(time.Hour, 1))
}

func TestMemGetInfoFollowsFreeSchedule(t *testing.T) {
	d := New(WithMemory(1<<30), WithFreeSchedule(FreeSchedule{Seed: 1, Low: 1 << 20, High: 2 << 20, Period: time.Hour}))
	t.Cleanup(func() { _ = d.Close() })
	free, total, err := d.MemGetInfo(0)
	require.NoError(t, err)
	assert.Equal(t, uint64(1<<30), total)
	assert.Equal(t, d.cfg.free.At(0, 0), free, "the first hour's level")

	// Never more than the Device's own reservations leave.
	small := New(WithMemory(4<<20), WithFreeSchedule(FreeSchedule{Seed: 1, Low: 100 << 20, High: 100 << 20, Period: time.Hour}))
	t.Cleanup(func() { _ = small.Close() })
	h, err := small.MemCreate(0, 2<<20, cudart.HandleTypePosixFD)
	require.NoError(t, err)
	free, _, err = small.MemGetInfo(0)
	require.NoError(t, err)
	assert.Equal(t, uint64(2<<20), free)
	require.NoError(t, small.MemRelease(0, h))
}

func TestFreeEnvThatDoesNotParse(t *testing.T) {
	t.Setenv(FreeEnv, "7,200,100,1s")
	d := New()
	t.Cleanup(func() { _ = d.Close() })
	_, _, err := d.MemGetInfo(0)
	require.ErrorIs(t, err, cudart.ErrInvalidValue)
	assert.Contains(t, err.Error(), FreeEnv)

	t.Setenv(FreeEnv, "7,100,200,1s")
	e := New()
	t.Cleanup(func() { _ = e.Close() })
	free, _, err := e.MemGetInfo(1)
	require.NoError(t, err)
	assert.Equal(t, FreeSchedule{Seed: 7, Low: 100, High: 200, Period: time.Second}.At(0, 1), free)
}
