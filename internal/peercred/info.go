package peercred

import "time"

// Info is what the host shows of a running process, for people reading about it: its
// command name and when it started.
type Info struct {
	// Command is the process's command name as ps shows it (the kernel keeps at most
	// 15 bytes of it).
	Command string
	// Started is when the process started, to the kernel's clock tick (10 ms).
	Started time.Time
}
