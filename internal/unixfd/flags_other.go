//go:build !linux

package unixfd

// recvFlags: the descriptors are made close-on-exec just after they arrive.
const recvFlags = 0
