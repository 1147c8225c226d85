package exporttest

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/internal/intercept"
)

// Stall holds side's stream until the returned resume is called (or the test ends).
func Stall(t testing.TB, s *Side) (resume func()) {
	t.Helper()
	resume, err := s.Dev.Stall(s.Ord, s.Stream)
	require.NoError(t, err)
	t.Cleanup(resume)
	return resume
}

// BusyGPU is a runtime whose stream is held by a stall until the host waits for the
// GPU: the first synchronising call (StreamSynchronize, EventSynchronize) ends the
// stall, as the long kernel would end while the host waits. Work that needs the stall
// to end and makes no host wait stays blocked, so a test can tell the two apart.
type BusyGPU struct {
	*intercept.Runtime
	mu     sync.Mutex
	resume func()
}

// NewBusyGPU is rt, busy as BusyGPU says once Stall is called.
func NewBusyGPU(rt cudart.Runtime) *BusyGPU {
	b := &BusyGPU{Runtime: intercept.Wrap(rt)}
	b.On.StreamSynchronize.Before(func(int, cudart.Stream) error { b.End(); return nil })
	b.On.EventSynchronize.Before(func(int, cudart.Event) error { b.End(); return nil })
	return b
}

// Stall holds s's stream until the next host wait (or End).
func (b *BusyGPU) Stall(t testing.TB, s *Side) {
	t.Helper()
	resume := Stall(t, s)
	b.mu.Lock()
	b.resume = resume
	b.mu.Unlock()
}

// End ends the stall, if any.
func (b *BusyGPU) End() {
	b.mu.Lock()
	resume := b.resume
	b.resume = nil
	b.mu.Unlock()
	if resume != nil {
		resume()
	}
}

// NewBusyConsumer is NewConsumer whose importer calls the device through a BusyGPU.
func NewBusyConsumer(t testing.TB, path string) (*Consumer, *BusyGPU) {
	t.Helper()
	s := NewSide(t, 0)
	busy := NewBusyGPU(s.Dev)
	imp, err := consumer.Dial(Ctx(t), path, busy, 0, consumer.WithLogger(DiscardLogger))
	require.NoError(t, err)
	t.Cleanup(func() { _ = imp.Close(context.Background()) }) // cleanup: what is tested is above
	return &Consumer{Side: s, Imp: imp}, busy
}

// Scratch allocates n bytes of s's own memory, on its stream.
func (s *Side) Scratch(t testing.TB, n uint64) cudart.DevicePtr {
	t.Helper()
	p, err := s.Dev.DeviceGetDefaultMemPool(s.Ord)
	require.NoError(t, err)
	ptr, err := s.Dev.MallocFromPoolAsync(s.Ord, n, p, s.Stream)
	require.NoError(t, err)
	return ptr
}

// ReadScratch copies n bytes of s's own memory to the host, after the work queued on
// its stream, whose violations fail the test.
func (s *Side) ReadScratch(t testing.TB, ptr cudart.DevicePtr, n uint64) []byte {
	t.Helper()
	out := make([]byte, n)
	require.NoError(t, s.Dev.MemcpyDtoHAsync(s.Ord, out, ptr, s.Stream))
	require.NoError(t, s.Dev.FreeAsync(s.Ord, ptr, s.Stream))
	return out
}
