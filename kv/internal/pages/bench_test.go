package pages_test

import (
	"fmt"
	"testing"

	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/pages"
)

// BenchmarkCycle is the page table's share of a replica's cycle at batch n: alloc n
// pages, seal them, settle the seal, match them, release and settle the release, on
// tables of 16 Ki and 1 Mi pages filled with sealed pages, so that every alloc
// evicts. Its cost per page must not grow with the table (issue 29: 2.0M pages/s on 4
// GiB, 1.37M on 100 GiB, through the whole owner).
func BenchmarkCycle(b *testing.B) {
	for _, pagesN := range []int{16 << 10, 1 << 20} {
		for _, n := range []int{64, 512} {
			b.Run(fmt.Sprintf("pages=%d/batch=%d", pagesN, n), func(b *testing.B) {
				tab, err := pages.New(pages.Config{Pages: pagesN, Epoch: 1})
				if err != nil {
					b.Fatal(err)
				}
				h := pages.Holder{PID: 1, Start: 1}
				hashes := make([]kv.Hash, n)
				next := uint64(0)
				fill := func() {
					for i := range hashes {
						next++
						hashes[i] = chainHash(int(next>>20), int(next&(1<<20-1)))
					}
				}
				cycle := func() {
					fill()
					id, _, _, err := tab.Alloc(h, n)
					if err != nil {
						b.Fatal(err)
					}
					if _, err := tab.Seal(h, id, hashes, pages.NoRef); err != nil {
						b.Fatal(err)
					}
					if _, _, _, err := tab.SealDone(id, true); err != nil {
						b.Fatal(err)
					}
					res, _, err := tab.Match(h, hashes)
					if err != nil || len(res.Pages) != n {
						b.Fatal(err, len(res.Pages))
					}
					if err := tab.Release(h, res.Lease); err != nil {
						b.Fatal(err)
					}
					if _, err := tab.ReleaseDone(res.Lease); err != nil {
						b.Fatal(err)
					}
				}
				for range pagesN / n { // fill the table: every alloc below evicts
					cycle()
				}
				b.ResetTimer()
				for b.Loop() {
					cycle()
				}
				b.ReportMetric(float64(b.N*n)/b.Elapsed().Seconds(), "pages/s")
			})
		}
	}
}

// BenchmarkMatch is a match and lease of 512 visible pages, and its release, on
// tables of 16 Ki and 1 Mi pages.
func BenchmarkMatch(b *testing.B) {
	for _, pagesN := range []int{16 << 10, 1 << 20} {
		b.Run(fmt.Sprintf("pages=%d", pagesN), func(b *testing.B) {
			tab, err := pages.New(pages.Config{Pages: pagesN, Epoch: 1})
			if err != nil {
				b.Fatal(err)
			}
			h := pages.Holder{PID: 1, Start: 1}
			const n = 512
			var hashes []kv.Hash
			for c := 0; c < pagesN/n; c++ {
				hs := make([]kv.Hash, n)
				for i := range hs {
					hs[i] = chainHash(c, i)
				}
				id, _, _, err := tab.Alloc(h, n)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := tab.Seal(h, id, hs, pages.NoRef); err != nil {
					b.Fatal(err)
				}
				if _, _, _, err := tab.SealDone(id, true); err != nil {
					b.Fatal(err)
				}
				hashes = hs
			}
			for b.Loop() {
				res, _, err := tab.Match(h, hashes)
				if err != nil || len(res.Pages) != n {
					b.Fatal(err)
				}
				if err := tab.Release(h, res.Lease); err != nil {
					b.Fatal(err)
				}
				if _, err := tab.ReleaseDone(res.Lease); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkPickSpill is the spiller's pick, under the owner's lock after seals, on a
// 100 GiB slab of llama-0.85b pages (204,800) whose window of pages to copy ahead
// (kv/owner's 8192) is all copied already: what a pick costs when it finds nothing,
// O(the window).
func BenchmarkPickSpill(b *testing.B) {
	const pagesN, ahead, batch = 204800, 8192, 512
	tab, err := pages.New(pages.Config{Pages: pagesN, HostPages: 8 * ahead, Epoch: 1})
	if err != nil {
		b.Fatal(err)
	}
	h := pages.Holder{PID: 1, Start: 1}
	for c := 0; c < pagesN/batch; c++ {
		hs := make([]kv.Hash, batch)
		for i := range hs {
			hs[i] = chainHash(c, i)
		}
		id, _, _, err := tab.Alloc(h, batch)
		if err == nil {
			_, err = tab.Seal(h, id, hs, pages.NoRef)
		}
		if err == nil {
			_, _, _, err = tab.SealDone(id, true)
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	for {
		cp, _, ok := tab.PickSpill(ahead, batch)
		if !ok {
			break
		}
		if _, _, err := tab.CopyDone(cp.ID, true); err != nil {
			b.Fatal(err)
		}
	}
	for b.Loop() {
		if cp, _, ok := tab.PickSpill(ahead, batch); ok {
			b.Fatalf("picked %d pages of a window copied already", len(cp.GPU))
		}
	}
}
