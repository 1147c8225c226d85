package pages

import "fmt"

// Mapped is how many GPU pages t has: pages [0, Mapped) exist, their memory mapped
// by the caller.
func (t *Table) Mapped() int { return len(t.g) }

// Grow makes pages [Mapped, to) free: the caller has mapped their memory before
// it calls. A page's generation goes on from its life before a shrink gave it
// back, so that no [Ref] of then names it now. Growth is not journaled: a restart
// is told how many pages are mapped then ([Restart]). ErrInput, with nothing
// changed, for to not above Mapped or above the Bound.
func (t *Table) Grow(to int) error {
	if to <= len(t.g) || to > t.cfg.Bound {
		return fmt.Errorf("%w: grow to %d pages, the table has %d of at most %d", ErrInput, to, len(t.g), t.cfg.Bound)
	}
	from := len(t.g)
	full := t.g[:cap(t.g)]
	if to > len(full) {
		full = append(full, make([]gpage, to-len(full))...)
	}
	t.g = full[:to]
	for p := to - 1; p >= from; p-- { // the lowest on top of the stack
		t.g[p] = blank(t.g[p].gen)
		t.free = append(t.free, uint32(p))
	}
	t.count[Free] += to - from
	return nil
}
