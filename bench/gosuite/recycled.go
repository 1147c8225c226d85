package main

import (
	"fmt"

	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/pool"
)

// recycled: issue 11's sustained rate on recycled buffers. A producer of its own, with
// a pool that caches freed buffers (pool.WithCache) and an exporter that lets its
// consumers retain imports (producer.WithRetainedImports), and sustainConsumers consumers
// of its own. Before each window the producer writes and publishes a ring of 2 MiB
// buffers under the window's names (rcy<round>-<i>), and after it retires them: the
// next window's buffers are the same memory, recycled through the cache, which the
// consumers find still mapped. In each window the consumers open and release the ring
// as fast as they can, as in sustained. It fails unless every buffer after the first
// window came from the cache: otherwise the row would not be the recycled path.
func (pr *producerSide) recycled(r *reporter) ([]float64, error) {
	cache := uint64(2 * pr.sh.ring * shareSize)
	rp, err := newProducerWith(pr.rt, pr.kind, pr.sh, pr.validate, "recycled.sock",
		[]pool.Option{pool.WithCache(cache)}, []producer.ListenOption{producer.WithRetainedImports()})
	if err != nil {
		return nil, err
	}
	var cs []*consumerSide
	defer func() {
		if rp.validate {
			rp.reportValidated(r, cs)
		}
		// The exporter goes first: its Close revokes the imports the consumers retain
		// while they are there to free them.
		rp.closeExporter(r)
		for _, c := range cs {
			if err := c.quit(); err != nil {
				r.fail("cudapool", "consumer", err)
			}
		}
		rp.close(r)
	}()
	for range sustainConsumers {
		c, err := rp.startConsumer(0)
		if err != nil {
			return nil, err
		}
		cs = append(cs, c)
	}
	var rates []float64
	for round := range pr.sh.rounds {
		name := fmt.Sprintf("rcy%d-", round)
		retire, err := rp.shared(name, pr.sh.ring, shareSize)
		if err != nil {
			return nil, err
		}
		// What the producer called to retire the last window's buffers and recycle
		// them into this one's.
		recycling := rp.calls.take()
		rate, err := rp.window(r, "sustained/4/recycled", cs, round, name, pr.sh.ring, 1)
		printCalls(r, "sustained/4/recycled", round, "recycling", recycling)
		if rerr := retire(); err == nil {
			err = rerr
		}
		if err != nil {
			return nil, err
		}
		rates = append(rates, rate)
	}
	st, err := rp.pool.Stats()
	if err != nil {
		return nil, err
	}
	if want := uint64((pr.sh.rounds - 1) * pr.sh.ring); st.CacheHits < want {
		return nil, fmt.Errorf("only %d of the %d buffers after the first window came from the cache: not the recycled path", st.CacheHits, want)
	}
	return rates, nil
}
