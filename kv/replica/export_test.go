package replica

// ForgeLease is a Lease the owner never issued, for tests of its refusals.
func ForgeLease(id uint64, write bool, pages ...uint32) *Lease {
	return &Lease{id: id, write: write, pages: pages}
}
