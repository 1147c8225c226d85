package replica

// ForgeLease is a Lease the owner never issued, for tests of its refusals.
func ForgeLease(id uint64, write bool, pages ...uint32) *Lease {
	return &Lease{id: id, write: write, pages: pages}
}

// HangUp closes r's page connection without Bye, as a process does as it dies.
func HangUp(r *Replica) {
	r.nc.CloseWrite() // the hang-up watch holds a duplicate of the socket
	r.nc.Close()
}

// OpenEvents counts the events r created and has not destroyed.
func OpenEvents(r *Replica) int {
	r.evMu.Lock()
	defer r.evMu.Unlock()
	return len(r.events) + len(r.retired) + len(r.leftEvents)
}

// TornDown is closed once r's Close has completed its teardown, in the background
// where Close gave up waiting.
func TornDown(r *Replica) <-chan struct{} { return r.tornDown }
