//go:build !linux

package peercred

import "net"

// Get returns ErrUnsupported: only Linux's SO_PEERCRED is read.
func Get(c *net.UnixConn) (Cred, error) { return Cred{}, ErrUnsupported }
