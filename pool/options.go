package pool

import "github.com/cudapool/cudapool/cudart"

// config is what New is asked for.
type config struct {
	handleType       cudart.HandleType
	maxSize          uint64
	peers            []int
	releaseThreshold *uint64
	name             string
	waitForMemory    bool
	cacheLimit       uint64
}

// Option configures [New].
type Option func(*config)

// WithHandleType makes the pool shareable as ht: [cudart.HandleTypePosixFD] (the
// default), [cudart.HandleTypeFabric], or [cudart.HandleTypeNone] for a pool that only this
// process uses (which neither rounds allocations nor can be exported).
func WithHandleType(ht cudart.HandleType) Option {
	return func(c *config) { c.handleType = ht }
}

// WithMaxSize bounds the memory the pool's buffers may hold. An exportable pool rounds
// it up to the allocation granularity. The pool keeps the bound itself, since the
// driver's cap is looser than the maxSize it is given; an Alloc past it fails with
// [cudart.ErrOutOfMemory] (or waits, with [WaitForMemory]). 0, the default, leaves the
// driver's bound: the device's memory.
func WithMaxSize(bytes uint64) Option {
	return func(c *config) { c.maxSize = bytes }
}

// WithPeerAccess lets kernels on the given devices read and write the pool's memory
// in this process. It does not carry over to importers: each sets access for its
// own imported pool.
func WithPeerAccess(devs ...int) Option {
	return func(c *config) { c.peers = append(c.peers, devs...) }
}

// WithReleaseThreshold sets how much reserved memory the pool keeps when streams
// synchronize instead of returning it to the device. The driver ignores it for
// exportable pools, which never return memory.
func WithReleaseThreshold(bytes uint64) Option {
	return func(c *config) { c.releaseThreshold = &bytes }
}

// MaxNameLen is the longest pool name, in bytes.
const MaxNameLen = 128

// WithName names the pool in errors, [Stats] and [CloseReport], and so in what other
// processes show of it (poolstat, metrics): [New] refuses, with [ErrInvalidOption], a name
// of more than [MaxNameLen] bytes, or one that is not UTF-8 or holds a character that
// does not show as itself (a control or bidirectional control character, a line or
// paragraph separator).
func WithName(name string) Option {
	return func(c *config) { c.name = name }
}

// WaitForMemory makes Alloc on a full pool wait for a Free in this process and
// try again, until it succeeds or its context ends, instead of failing at once. A
// request that can never fit (larger than [WithMaxSize] or the device) still fails at
// once.
func WaitForMemory() Option {
	return func(c *config) { c.waitForMemory = true }
}

// WithCache lets the pool keep up to bytes of freed buffers for reuse: a buffer freed
// on a stream serves the next Alloc of a fitting size on that stream at once, without
// calling the driver, and an exportable one keeps its export record. 0, the default,
// returns every free to the driver. The cached memory stays reserved ([Stats] counts it
// as CachedBytes, and against [WithMaxSize]); a full pool returns it to the driver before
// failing, and so do Trim and Close.
func WithCache(bytes uint64) Option {
	return func(c *config) { c.cacheLimit = bytes }
}

// CloseOption configures Close.
type CloseOption func(*closeConfig)

type closeConfig struct{ force bool }

// Force makes Close release a pool that still has live buffers. It frees them on the
// pool's release stream (the legacy default stream if it has none), without waiting
// for work the program queued on them on other streams. Buffers that importers may
// still hold (live leases, or a lease ended after Close began) are not freed but
// abandoned: their memory stays allocated until the process exits, because freeing it
// before every importer has would break CUDA's rule.
func Force() CloseOption {
	return func(c *closeConfig) { c.force = true }
}
