package keep

// SetUIDOf makes s see each peer's uid as f makes it.
func SetUIDOf(s *Server, f func(uint32) uint32) { s.uidOf.Store(&f) }
