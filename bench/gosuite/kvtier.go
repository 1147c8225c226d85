package main

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// The host tier's rows ("gosuite kvtier"): an owner in this process
// with a host tier (owner.WithHostBytes) and one replica process, the llama-0.85b
// layout. Each cycle the replica seals a prompt of its own (distinct bytes in every
// piece of every page), allocs the whole slab, which evicts it to the host tier, gives
// the pages back, and matches the prompt again, which restores it; it then checks
// every byte of every restored page.
//
//	kv/host/restore32k  the prompt's bytes over the Match's time (effective GB/s: the
//	                    restore copy, its wait and the round trip), bytes checked
//	kv/host/spill       the bytes the owner copied into the host tier in the cycle over
//	                    the time those copies took, submission to completion (GB/s)
//
// On a GPU the prompt is 32,768 tokens (2,048 pages, 1 GiB); on the software device
// 128 pages, to stay small.
func kvTierRows(r *reporter, rt cudart.Runtime, onGPU bool, sh shape) {
	kind := choose.Software
	g, _ := kv.Layout("llama-0.85b")
	prompt, cycles := 128, sh.rounds
	if onGPU {
		kind, prompt = choose.GPU, 2048
	}
	g.Pages = 2 * prompt
	dir, err := os.MkdirTemp("", "gosuite-kvtier")
	if err != nil {
		r.fail("cudapool", "kv/host", err)
		return
	}
	defer func() { _ = os.RemoveAll(dir) }() // best effort: a leftover file is harmless, and the first error is the one returned
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	host := uint64(prompt+prompt/4) * owner.HostPageBytes(g)
	o, err := owner.Listen(dir, rt, g, owner.WithLogger(quiet), owner.WithHostBytes(host), owner.WithInitialPages(g.Pages))
	if err != nil {
		r.fail("cudapool", "kv/host", err)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	defer func() {
		if err := o.Close(ctx); err != nil {
			r.fail("cudapool", "kv/owner", err)
		}
	}()
	c, err := startRole(kvReplicaRole, kind, dir)
	if err != nil {
		r.fail("cudapool", "kv/host", err)
		return
	}
	defer func() {
		if err := c.quit(); err != nil {
			r.fail("cudapool", "kv/replica", err)
		}
	}()
	var restore, spill []float64
	for cycle := range cycles {
		before := *o.Stats().Devices[0].Host
		// The owner's copies never overlap the replica's writes: the software device
		// orders whole allocations, and the slab is one.
		steps := []struct{ cmd, want string }{
			{fmt.Sprintf("tierprep %d %d", prompt, cycle), "prepared"},
			{fmt.Sprintf("tierevict %d", g.Pages), "evicted"},
			{"tiermatch", "restored"},
		}
		for _, st := range steps {
			v, err := c.ask(st.cmd, st.want)
			if err == nil {
				err = o.WaitSpills(ctx)
			}
			if err != nil {
				r.fail("cudapool", "kv/host/restore32k", err)
				return
			}
			if st.want == "restored" {
				if len(v) != 1 || v[0] <= 0 {
					r.fail("cudapool", "kv/host/restore32k", fmt.Errorf("the replica said %v", v))
					return
				}
				restore = append(restore, float64(uint64(prompt)*owner.HostPageBytes(g))/v[0]/1e9)
			}
		}
		after := *o.Stats().Devices[0].Host
		if after.SpillNanos > before.SpillNanos {
			spill = append(spill, float64(after.SpillBytes-before.SpillBytes)/float64(after.SpillNanos-before.SpillNanos))
		}
	}
	h := o.Stats().Devices[0].Host
	fmt.Fprintf(r.w, "# kv host tier: %d pages of %d bytes, copies by %s: %d spills, %d restores (their copies alone %.1f GB/s), %d spilled, %d lost, %d evicted\n",
		h.Pages, h.PageBytes, h.CopyPath, h.Spills, h.Restores, float64(h.RestoreBytes)/float64(max(h.RestoreNanos, 1)), h.Spilled, h.Lost, h.Evictions)
	r.result("cudapool", "kv/host/restore32k", "GB/s", restore)
	r.result("cudapool", "kv/host/spill", "GB/s", spill)
}

// tierPrep seals a prompt of n pages, seed's own, every piece of every page written
// with the bytes tierPattern gives.
func (k *kvLoad) tierPrep(ctx context.Context, n, seed int) error {
	g := k.r.Geometry()
	tokens := make([]int32, n*g.TokensPerPage)
	for i := range tokens {
		tokens[i] = int32(i) + int32(seed)<<24 + int32(k.seq>>32)<<16
	}
	k.tierChain = k.r.Hashes(tokens)
	buf := make([]byte, g.PageBytes())
	return k.sealed(ctx, k.tierChain, func(pages []uint32) error {
		for i, p := range pages {
			for layer := range g.Layers {
				for v := range 2 {
					tierPattern(buf, k.tierChain[i], layer, v)
					if err := k.rt.MemcpyHtoDAsync(0, k.piece(layer, v, p), buf, k.s); err != nil {
						return err
					}
				}
			}
		}
		return nil
	})
}

// tierEvict allocs n pages, which evicts what is sealed, and gives them back.
func (k *kvLoad) tierEvict(ctx context.Context, n int) error {
	l, err := k.r.Alloc(ctx, n)
	if err != nil {
		return err
	}
	return k.r.Release(ctx, l, k.s)
}

// tierMatch matches the prompt, timing the Match, checks every byte of every page,
// and releases them: "restored SECONDS".
func (k *kvLoad) tierMatch(ctx context.Context) (string, error) {
	var m *replica.Lease
	var err error
	var t0 time.Time
	// The alloc's pages settle once their release event has completed: until then
	// the restore finds no room and the run ends short; try again then.
	for {
		t0 = time.Now()
		if m, err = k.r.Match(ctx, k.tierChain); err != nil {
			return "", err
		}
		if len(m.Pages()) == len(k.tierChain) {
			break
		}
		if err := k.r.Release(ctx, m, k.s); err != nil {
			return "", err
		}
		select {
		case <-time.After(time.Millisecond):
		case <-ctx.Done():
			return "", fmt.Errorf("the prompt never matched whole: %w", ctx.Err())
		}
	}
	d := time.Since(t0)
	g := k.r.Geometry()
	want, got := make([]byte, g.PageBytes()), make([]byte, g.PageBytes())
	for i, p := range m.Pages() {
		for layer := range g.Layers {
			for v := range 2 {
				if err := k.rt.MemcpyDtoHAsync(0, got, k.piece(layer, v, p), k.s); err != nil {
					return "", err
				}
				tierPattern(want, k.tierChain[i], layer, v)
				if string(got) != string(want) {
					return "", fmt.Errorf("page %d of the prompt (slab page %d), layer %d %s: the restored bytes differ from the sealed ones", i, p, layer, [2]string{"K", "V"}[v])
				}
			}
		}
	}
	if err := k.r.Release(ctx, m, k.s); err != nil {
		return "", err
	}
	return fmt.Sprintf("restored %.6f", d.Seconds()), nil
}

// piece is layer's K (v 0) or V piece of slab page p.
func (k *kvLoad) piece(layer, v int, p uint32) cudart.DevicePtr {
	return k.r.Addr(layer, kv.Part(v), int(p))
}

// tierPattern fills b with the bytes of layer's K (v 0) or V piece of the page of h.
func tierPattern(b []byte, h kv.Hash, layer, v int) {
	x := binary.LittleEndian.Uint64(h[:8]) ^ uint64(layer)<<48 ^ uint64(v)<<56
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], x^uint64(i)*0x9e3779b97f4a7c15)
	}
}
