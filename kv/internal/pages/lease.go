package pages

import (
	"fmt"
	"slices"

	"github.com/cudapool/cudapool/kv"
)

type leaseState uint8

const (
	held      leaseState = iota
	sealing              // a write lease sealed, its writer's work pending (SealDone)
	releasing            // released, the holder's work pending (ReleaseDone)
	restoring            // a read lease whose restore copy is in flight (CopyDone)
	stranded             // granted before a restart, not reattached yet
)

// lease is a write lease (pages writing, then sealing or settling) or a read lease
// (sealed pages, each counted in its readers).
type lease struct {
	id     LeaseID
	holder Holder
	write  bool
	state  leaseState
	pages  []uint32
	hashes []kv.Hash // a read lease's: the hashes of pages; a sealed write lease's: those sealed
	parent Ref       // a sealed write lease's: the page its first page continues
	copy   CopyID    // restoring: the restore
}

// holder is what the table knows of one process: its leases.
type holder struct {
	leases map[LeaseID]*lease
	pages  int // pages of its leases
}

// Load is how many leases, of how many pages, h holds (stranded ones included), for
// the caller's caps. O(1).
func (t *Table) Load(h Holder) (leases, pages int) {
	if hd := t.holders[h]; hd != nil {
		return len(hd.leases), hd.pages
	}
	return 0, 0
}

// addLease books l, for its holder.
func (t *Table) addLease(l *lease) {
	t.leases[l.id] = l
	hd := t.holders[l.holder]
	if hd == nil {
		hd = &holder{leases: make(map[LeaseID]*lease)}
		t.holders[l.holder] = hd
	}
	hd.leases[l.id] = l
	hd.pages += len(l.pages)
	if l.state == stranded {
		t.nstranded++
	}
}

// dropLease takes l off the books; its pages are the caller's.
func (t *Table) dropLease(l *lease) {
	delete(t.leases, l.id)
	if l.state == stranded {
		t.nstranded--
	}
	if hd := t.holders[l.holder]; hd != nil {
		delete(hd.leases, l.id)
		hd.pages -= len(l.pages)
		if len(hd.leases) == 0 {
			delete(t.holders, l.holder)
		}
	}
}

// newLease grants a lease of pages to h.
func (t *Table) newLease(h Holder, write bool, pages []uint32, hashes []kv.Hash) *lease {
	t.next += LeaseID(t.cfg.Stride)
	l := &lease{id: t.next, holder: h, write: write, pages: pages, hashes: hashes, parent: NoRef}
	t.addLease(l)
	return l
}

// find returns h's lease id, in one of the states in, or why not.
func (t *Table) find(h Holder, id LeaseID, in ...leaseState) (*lease, error) {
	l, ok := t.leases[id]
	switch {
	case !ok:
		return nil, fmt.Errorf("%w: lease %d is not held", ErrStale, id)
	case l.holder != h:
		return nil, fmt.Errorf("%w: lease %d is another holder's", ErrStale, id)
	case !slices.Contains(in, l.state):
		return nil, fmt.Errorf("%w: lease %d is %s", ErrStale, id, l.state)
	}
	return l, nil
}

func (s leaseState) String() string {
	return [...]string{"held", "sealing", "releasing", "restoring", "stranded"}[s]
}

// LeaseInfo is what the table knows of a lease.
type LeaseInfo struct {
	ID       LeaseID
	Holder   Holder
	Write    bool
	Pages    []uint32
	Hashes   []kv.Hash
	Stranded bool // granted before the restart and not reattached yet
}

// Lease is lease id, if the table holds it.
func (t *Table) Lease(id LeaseID) (LeaseInfo, bool) {
	l, ok := t.leases[id]
	if !ok {
		return LeaseInfo{}, false
	}
	return LeaseInfo{ID: l.id, Holder: l.holder, Write: l.write, Pages: slices.Clone(l.pages), Hashes: slices.Clone(l.hashes), Stranded: l.state == stranded}, true
}
