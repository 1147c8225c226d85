package pages

import (
	"slices"

	"github.com/cudapool/cudapool/kv"
)

// Kind is what a journal record says.
type Kind uint8

// The journal's records.
const (
	RecSeal     Kind = iota + 1 // GPU page Page became visible under Hash
	RecFree                     // visible GPU page Page was evicted (before it is reused)
	RecHostSeal                 // host page Page holds Hash (after the copy into it completed)
	RecHostFree                 // sealed host page Page was evicted (before it is refilled)
	RecLeased                   // lease Lease granted to Holder: Write, Pages (a read lease's: Hashes)
	RecEnd                      // lease Lease ended
)

var kindNames = [...]string{"?", "seal", "free", "hostseal", "hostfree", "leased", "end"}

func (k Kind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return "?"
}

// Record is one journal record. Seq orders them: the caller writes them in Seq order.
type Record struct {
	Seq    Seq
	Kind   Kind
	Page   uint32  // RecSeal, RecFree: a GPU page; RecHostSeal, RecHostFree: a host page
	Hash   kv.Hash // RecSeal, RecHostSeal
	Lease  LeaseID // RecLeased, RecEnd
	Holder Holder  // RecLeased
	Write  bool    // RecLeased
	Pages  []uint32
	Hashes []kv.Hash // RecLeased of a read lease: the hashes of Pages
}

// CopyKind is what a copy moves.
type CopyKind uint8

// The copies a table asks for.
const (
	Spill   CopyKind = iota + 1 // GPU pages to host pages
	Restore                     // host pages to GPU pages
)

// Copy is a copy to make, page GPU[i] to (Restore: from) host page Host[i], every
// layer. It may start once the journal is durable through After and the copies in
// Wait have completed; its completion is reported with [Table.CopyDone].
type Copy struct {
	ID    CopyID
	Kind  CopyKind
	GPU   []uint32
	Host  []uint32
	After Seq
	Wait  []CopyID
}

// Effects is what the caller does after an operation, outside its lock, in this
// order: journal Records; start Copies; and answer (if the operation has an answer)
// only once the journal is durable through Wait and the copies in Await completed.
type Effects struct {
	Records []Record
	Copies  []Copy
	Wait    Seq
	Await   []CopyID
}

// Empty says there is nothing to do.
func (e *Effects) Empty() bool {
	return len(e.Records) == 0 && len(e.Copies) == 0 && e.Wait == 0 && len(e.Await) == 0
}

// journal appends a record to the operation's effects, numbered.
func (t *Table) journal(r Record) Seq {
	t.seq++
	r.Seq = t.seq
	t.fx.Records = append(t.fx.Records, r)
	return t.seq
}

// must makes the reply wait for the journal through the latest record.
func (t *Table) must() { t.fx.Wait = t.seq }

// effects hands over what the operation in progress gathered.
func (t *Table) effects() Effects {
	fx := t.fx
	t.fx = Effects{}
	return fx
}

// Seq is the sequence number of the last record t returned.
func (t *Table) Seq() Seq { return t.seq }

// leaseRecord is lease l's RecLeased record.
func leaseRecord(l *lease) Record {
	r := Record{Kind: RecLeased, Lease: l.id, Holder: l.holder, Write: l.write, Pages: slices.Clone(l.pages)}
	if !l.write {
		r.Hashes = slices.Clone(l.hashes)
	}
	return r
}
