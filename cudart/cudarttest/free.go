package cudarttest

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"time"
)

// FreeEnv names the environment variable that gives every Device made without
// WithFreeSchedule a free-memory schedule: "SEED,LOW,HIGH,PERIOD" (ParseFreeSchedule),
// e.g. "7,1073741824,1107296256,150ms". It is how a test makes another process's
// software device (kvpoold -runtime test) see its free memory fall and rise. A value
// that does not parse makes every MemGetInfo of the Device fail, saying why.
const FreeEnv = "CUDAPOOL_SOFTDEV_FREE"

// FreeSchedule makes MemGetInfo report a free memory that falls and rises, as where
// other processes take and give back memory: every Period from the Device's creation
// each device's free memory is drawn anew, uniformly from [Low, High], from Seed, the
// period's number and the device (At), and it is never more than what this Device's
// own reservations leave. Only MemGetInfo sees it: allocations are bounded by the
// Device's memory (WithMemory) alone.
type FreeSchedule struct {
	Seed      uint64
	Low, High uint64        // bytes
	Period    time.Duration // > 0
}

// At is the free memory the schedule gives device dev at elapsed since the Device's
// creation: the same for the same arguments, in every process.
func (s FreeSchedule) At(elapsed time.Duration, dev int) uint64 {
	i := uint64(max(elapsed, 0) / s.Period)
	rng := rand.New(rand.NewPCG(s.Seed, i<<8|uint64(dev&0xff)))
	return s.Low + rng.Uint64N(s.High-s.Low+1)
}

// String is the schedule as FreeEnv takes it.
func (s FreeSchedule) String() string {
	return fmt.Sprintf("%d,%d,%d,%v", s.Seed, s.Low, s.High, s.Period)
}

// ParseFreeSchedule parses "SEED,LOW,HIGH,PERIOD": decimal integers (LOW and HIGH in
// bytes, LOW ≤ HIGH) and a Go duration above 0. On failure the error says which part
// is wrong.
func ParseFreeSchedule(v string) (FreeSchedule, error) {
	parts := strings.Split(v, ",")
	if len(parts) != 4 {
		return FreeSchedule{}, fmt.Errorf("cudarttest: free schedule %q: want SEED,LOW,HIGH,PERIOD", v)
	}
	var s FreeSchedule
	var err error
	for i, p := range []*uint64{&s.Seed, &s.Low, &s.High} {
		if *p, err = strconv.ParseUint(strings.TrimSpace(parts[i]), 10, 64); err != nil {
			return FreeSchedule{}, fmt.Errorf("cudarttest: free schedule %q: %s: %w", v, [...]string{"SEED", "LOW", "HIGH"}[i], err)
		}
	}
	if s.Low > s.High {
		return FreeSchedule{}, fmt.Errorf("cudarttest: free schedule %q: LOW %d is above HIGH %d", v, s.Low, s.High)
	}
	if s.Period, err = time.ParseDuration(strings.TrimSpace(parts[3])); err != nil {
		return FreeSchedule{}, fmt.Errorf("cudarttest: free schedule %q: PERIOD: %w", v, err)
	}
	if s.Period <= 0 {
		return FreeSchedule{}, fmt.Errorf("cudarttest: free schedule %q: PERIOD %v is not above 0", v, s.Period)
	}
	return s, nil
}

// WithFreeSchedule makes MemGetInfo follow s (FreeSchedule), instead of $CUDAPOOL_SOFTDEV_FREE.
// A schedule ParseFreeSchedule would refuse makes every MemGetInfo fail, saying why.
func WithFreeSchedule(s FreeSchedule) Option {
	return func(c *config) {
		c.free, c.freeErr = &s, nil
		if s.Low > s.High || s.Period <= 0 {
			c.freeErr = fmt.Errorf("cudarttest: free schedule %v: want LOW ≤ HIGH and a PERIOD above 0", s)
		}
	}
}

// freeFromEnv sets c's schedule from $CUDAPOOL_SOFTDEV_FREE where no option set one.
func freeFromEnv(c *config) {
	if c.free != nil || c.freeErr != nil {
		return
	}
	v, ok := os.LookupEnv(FreeEnv)
	if !ok || v == "" {
		return
	}
	s, err := ParseFreeSchedule(v)
	if err != nil {
		c.freeErr = fmt.Errorf("$%s: %w", FreeEnv, err)
		return
	}
	c.free = &s
}

// scheduledFree is what MemGetInfo reports free on dev, of left, the memory this
// Device's reservations leave: left, or less where a schedule says so. d.mu is held.
func (d *Device) scheduledFree(dev int, left uint64) (uint64, error) {
	if d.cfg.freeErr != nil {
		return 0, invalid("cudaMemGetInfo", d.cfg.freeErr.Error())
	}
	if d.cfg.free == nil {
		return left, nil
	}
	return min(left, d.cfg.free.At(time.Duration(now()-d.born), dev)), nil
}
