//go:build !linux

package session

import (
	"errors"
	"syscall"
)

// idleWatch is Linux's (epoll); elsewhere the client's watcher reads for good.
type idleWatch struct{}

func newIdleWatch(syscall.RawConn, Watch) (*idleWatch, error) {
	return nil, errors.New("no idle watch on this system")
}

func (*idleWatch) wait() error { return errors.New("no idle watch") }
func (*idleWatch) set(bool)    {}
func (*idleWatch) Close()      {}
