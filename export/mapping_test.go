package export

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/cudapool/cudapool/cudart"
)

func TestOpenTwiceSharesOneMapping(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 7)
	if err := pr.ex.Publish(testCtx(t), "alias", pr.ex.pubs["a"].buf, pr.stream); err != nil {
		t.Fatal(err)
	}
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m1, err := c.imp.Open(ctx, "a", c.stream)
	if err != nil {
		t.Fatal(err)
	}
	m2, err := c.imp.Open(ctx, "alias", c.stream)
	if err != nil {
		t.Fatal(err)
	}
	if m1 != m2 {
		t.Fatal("the same buffer opened twice gave two Mappings")
	}
	if err := m1.Release(ctx, c.stream); err != nil {
		t.Fatal(err)
	}
	// Still mapped: the second reference holds it.
	if got := c.read(t, m2); !allAre(got, 7) {
		t.Fatal("mapping unreadable after the first of two releases")
	}
	// Both grants stay with the exporter until the last reference goes: the import
	// is one, and it is freed once.
	if n := pr.activeLeases(t); n != 2 {
		t.Fatalf("%d pool leases while one of two references is held, want 2", n)
	}
	if err := m2.Release(ctx, c.stream); err != nil {
		t.Fatal(err)
	}
	if n := pr.activeLeases(t); n != 0 {
		t.Fatalf("%d pool leases after the last release, want 0", n)
	}
	if err := m2.Release(ctx, c.stream); !errors.Is(err, ErrReleased) {
		t.Fatalf("third release = %v, want ErrReleased", err)
	}
	pr.checkClean(t)
	c.checkClean(t)
}

func TestConsumerOnOtherDeviceReadsProducerBytes(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 3<<20, 0xc3)
	c := newConsumer(t, pr.path, 1)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.read(t, m); !allAre(got, 0xc3) {
		t.Fatal("device 1 read wrong bytes")
	}
	if err := m.Release(ctx, c.stream); err != nil {
		t.Fatal(err)
	}
	pr.checkClean(t)
	c.checkClean(t)
}

func TestFreeWhileLeasedWaitsForRelease(t *testing.T) {
	pr := newProducer(t, nil, nil)
	b := pr.publish(t, "a", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Free(pr.stream); err != nil {
		t.Fatal(err)
	}
	s, _ := pr.pool.Stats()
	if s.DeferredFrees != 1 || s.LiveBuffers != 1 {
		t.Fatalf("free of a leased buffer: %d deferred, %d live; want 1, 1", s.DeferredFrees, s.LiveBuffers)
	}
	if got := c.read(t, m); !allAre(got, 1) {
		t.Fatal("leased buffer changed after the producer freed it")
	}
	// A new open must not get the freed buffer.
	if _, err := c.imp.Open(ctx, "a", c.stream); !errors.Is(err, ErrBufferGone) {
		t.Fatalf("open of a freed buffer = %v, want ErrBufferGone", err)
	}
	if err := m.Release(ctx, c.stream); err != nil {
		t.Fatal(err)
	}
	s, _ = pr.pool.Stats()
	if s.DeferredFrees != 0 || s.LiveBuffers != 0 || s.ActiveLeases != 0 {
		t.Fatalf("after release: %d deferred, %d live, %d leases; want 0, 0, 0", s.DeferredFrees, s.LiveBuffers, s.ActiveLeases)
	}
	pr.checkClean(t)
	c.checkClean(t)
}

// Many goroutines in several consumers open and release the same and different
// buffers at once; every read sees the producer's bytes and, at the end, nothing is
// held and no rule was broken.
func TestConcurrentOpensAndReleases(t *testing.T) {
	pr := newProducer(t, nil, nil)
	const names = 4
	for i := range names {
		pr.publish(t, fmt.Sprint("b", i), 1<<20, byte(i+1))
	}
	const consumers, workers, rounds = 3, 4, 25
	var wg sync.WaitGroup
	errs := make(chan error, consumers*workers)
	cs := make([]*consumer, consumers)
	for i := range cs {
		cs[i] = newConsumer(t, pr.path, i%2)
	}
	ctx := testCtx(t)
	for _, c := range cs {
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s, err := c.dev.StreamCreate(c.ord, cudart.StreamNonBlocking)
				if err != nil {
					errs <- err
					return
				}
				buf := make([]byte, 1<<20)
				for r := range rounds {
					i := (w + r) % names
					m, err := c.imp.Open(ctx, fmt.Sprint("b", i), s)
					if err != nil {
						errs <- err
						return
					}
					if err := c.dev.MemcpyDtoHAsync(c.ord, buf, m.Ptr(), s); err != nil || !allAre(buf, byte(i+1)) {
						errs <- fmt.Errorf("read of b%d: %v", i, err)
						return
					}
					if err := m.Release(ctx, s); err != nil {
						errs <- err
						return
					}
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := pr.activeLeases(t); n != 0 {
		t.Fatalf("%d pool leases after every release", n)
	}
	for _, p := range pr.ex.Peers() {
		if p.Leases != 0 {
			t.Fatalf("peer %d still holds %d leases", p.PID, p.Leases)
		}
	}
	pr.checkClean(t)
	for _, c := range cs {
		c.checkClean(t)
	}
}
