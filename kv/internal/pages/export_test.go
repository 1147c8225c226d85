package pages

import "fmt"

// Rules turns the restart contract's rules off, one by one, to show the defect each
// prevents: NoStrand frees a stranded write lease's pages (a reattach takes them back
// if they are still free), RestoreInWindow lets a Match (and its restore) run in the
// reattach window, EndAtSeal journals a write lease's end at its seal,
// ShrinkTakes lets a shrink end the leases of the pages it gives back.
type Rules struct{ NoStrand, RestoreInWindow, EndAtSeal, ShrinkTakes bool }

func (r Rules) rules() rules {
	return rules{noStrand: r.NoStrand, restoreInWindow: r.RestoreInWindow, endAtSeal: r.EndAtSeal, shrinkTakes: r.ShrinkTakes}
}

// NewWith is New with rules off.
func NewWith(cfg Config, r Rules) (*Table, error) {
	t, err := New(cfg)
	if t != nil {
		t.rules = r.rules()
	}
	return t, err
}

// RestartWith is Restart with rules off.
func RestartWith(cfg Config, rec Recovered, r Rules) (*Table, error) {
	return restart(cfg, rec, r.rules())
}

// Writer is the lease that writes (or seals) page p, or 0 (a page not mapped).
func Writer(t *Table, p uint32) LeaseID {
	if int(p) >= len(t.g) {
		return 0
	}
	if st := t.g[p].state; st == Writing || st == Sealing || st == Settling {
		return t.g[p].lease
	}
	return 0
}

// Readers is page p's readers (0: a page not mapped).
func Readers(t *Table, p uint32) int {
	if int(p) >= len(t.g) {
		return 0
	}
	return int(t.g[p].readers)
}

// LeavesFirst says where the GPU LRU list has a child more recent than its live
// parent: eviction would take the parent first.
func LeavesFirst(t *Table) error {
	pos := map[uint32]int{}
	i := 0
	for p := t.glru.head; p != none; p = t.g[p].next {
		pos[p] = i
		i++
	}
	for c, ci := range pos {
		if r := t.g[c].parent; t.alive(r) {
			if pi, ok := pos[r.Page]; ok && pi > ci {
				return fmt.Errorf("page %d is more recent (%d) than its parent %d (%d)", c, ci, r.Page, pi)
			}
		}
	}
	return nil
}

// Tail is the least recent evictable GPU page, or false.
func Tail(t *Table) (uint32, bool) { return t.glru.tail, t.glru.tail != none }

// Order is the GPU LRU list, most recent first, and the host one.
func Order(t *Table) (gpu, host []uint32) {
	for p := t.glru.head; p != none; p = t.g[p].next {
		gpu = append(gpu, p)
	}
	for p := t.hlru.head; p != none; p = t.h[p].next {
		host = append(host, p)
	}
	return gpu, host
}
