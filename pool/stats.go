package pool

import (
	"fmt"
	"strings"

	"github.com/cudapool/cudapool/cudart"
)

// Stats is a snapshot of a pool: the driver's figures and the pool's own.
type Stats struct {
	Name        string
	Device      int
	HandleType  cudart.HandleType
	MaxSize     uint64
	Granularity uint64

	// From the driver. For a device's default pool they cover every user of it.
	ReservedCurrent, ReservedHigh, UsedCurrent, UsedHigh uint64

	// LiveBuffers counts the buffers not yet returned to the driver: those not
	// freed, those whose free waits for leases, and those whose deferred free failed.
	LiveBuffers int
	// BytesRequested is what the live buffers asked for; BytesReserved is what
	// they hold after rounding.
	BytesRequested, BytesReserved uint64
	// SharedBuffers counts the buffers with at least one live lease; ActiveLeases
	// counts the leases.
	SharedBuffers, ActiveLeases int
	// DeferredFrees counts the buffers freed while leased, waiting for their last
	// lease to end.
	DeferredFrees int
	// FailedFrees counts deferred frees that failed, and FailedFreeBytes the memory
	// they left reserved.
	FailedFrees     int
	FailedFreeBytes uint64

	// CacheLimit is WithCache's bound; CachedBuffers and CachedBytes are what the
	// cache holds (reserved in the driver, not counted as live). CacheHits counts the
	// Allocs the cache served, CacheMisses those that went to the driver while the
	// cache was on.
	CacheLimit             uint64
	CachedBuffers          int
	CachedBytes            uint64
	CacheHits, CacheMisses uint64

	// Retentions counts importers' mappings kept past their leases (retained imports);
	// RevokingBuffers and RevokingBytes are the memory waiting for its retainers to
	// let go before it goes back to the driver.
	Retentions      int
	RevokingBuffers int
	RevokingBytes   uint64
}

// RoundingOverhead is the memory the live buffers hold beyond what they asked for.
func (s Stats) RoundingOverhead() uint64 { return s.BytesReserved - s.BytesRequested }

// driverAttrs are the pool attributes Stats reads, and where each goes.
var driverAttrs = []struct {
	attr  cudart.PoolAttr
	field func(*Stats) *uint64
}{
	{cudart.PoolReservedMemCurrent, func(s *Stats) *uint64 { return &s.ReservedCurrent }},
	{cudart.PoolReservedMemHigh, func(s *Stats) *uint64 { return &s.ReservedHigh }},
	{cudart.PoolUsedMemCurrent, func(s *Stats) *uint64 { return &s.UsedCurrent }},
	{cudart.PoolUsedMemHigh, func(s *Stats) *uint64 { return &s.UsedHigh }},
}

// Stats returns the pool's figures. The driver's are read after the pool's own, so
// the two may differ by what happened in between. It fails with [ErrClosed] after
// Close, and if the driver cannot be asked (then the pool's own figures are still
// returned).
func (p *Pool) Stats() (Stats, error) {
	s := Stats{Name: p.name, Device: p.dev, HandleType: p.handleType, MaxSize: p.maxSize, Granularity: p.gran}
	if !p.gate.enter() {
		return s, p.closedError("stats")
	}
	defer p.gate.leave()
	p.mu.Lock()
	c := p.counts
	s.FailedFrees = len(p.failed)
	s.CacheLimit, s.CachedBuffers, s.CachedBytes = p.cache.limit, p.cache.buffers, p.cache.bytes
	s.CacheHits, s.CacheMisses = p.cache.hits, p.cache.misses
	s.Retentions, s.RevokingBuffers, s.RevokingBytes = c.retentions, c.revokingBuffers, c.revokingBytes
	p.mu.Unlock()
	s.LiveBuffers, s.BytesRequested, s.BytesReserved = c.liveBuffers, c.bytesRequested, c.bytesReserved
	s.SharedBuffers, s.ActiveLeases, s.DeferredFrees = c.sharedBuffers, c.activeLeases, c.deferredFrees
	s.FailedFreeBytes = c.failedFreeBytes
	for _, a := range driverAttrs {
		v, err := p.rt.MemPoolGetAttribute(p.dev, p.handle, a.attr)
		if err != nil {
			return s, p.errorf("stats: reading pool attribute %d: %w", a.attr, err)
		}
		*a.field(&s) = v
	}
	return s, nil
}

// ResetHighWatermarks resets the driver's reserved and used high marks, which then
// climb again from the current figures. It fails with [ErrClosed] after Close.
func (p *Pool) ResetHighWatermarks() error {
	if !p.gate.enter() {
		return p.closedError("reset high watermarks")
	}
	defer p.gate.leave()
	for _, a := range []cudart.PoolAttr{cudart.PoolReservedMemHigh, cudart.PoolUsedMemHigh} {
		// The driver accepts only 0, meaning reset.
		if err := p.rt.MemPoolSetAttribute(p.dev, p.handle, a, 0); err != nil {
			return p.errorf("reset high watermarks: attribute %d: %w", a, err)
		}
	}
	return nil
}

func (s Stats) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "pool %q on device %d (%v, granularity %s, max size %s): driver reserved %s (high %s), used %s (high %s); "+
		"%d live buffers, %s requested, %s reserved; %d shared, %d leases, %d deferred frees, %d failed frees (%s)",
		s.Name, s.Device, s.HandleType, human(s.Granularity), human(s.MaxSize), human(s.ReservedCurrent), human(s.ReservedHigh),
		human(s.UsedCurrent), human(s.UsedHigh), s.LiveBuffers, human(s.BytesRequested), human(s.BytesReserved),
		s.SharedBuffers, s.ActiveLeases, s.DeferredFrees, s.FailedFrees, human(s.FailedFreeBytes))
	if s.CacheLimit != 0 {
		fmt.Fprintf(&b, "; cache %d buffers, %s of %s (%d hits, %d misses)",
			s.CachedBuffers, human(s.CachedBytes), human(s.CacheLimit), s.CacheHits, s.CacheMisses)
	}
	if s.Retentions != 0 || s.RevokingBuffers != 0 {
		fmt.Fprintf(&b, "; %d retentions, %d buffers (%s) being revoked", s.Retentions, s.RevokingBuffers, human(s.RevokingBytes))
	}
	return b.String()
}
