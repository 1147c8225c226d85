package owner

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/cudapool/cudapool/kv"
)

// hostSide is what the host tiers run besides the slabs: a spiller per tier and the
// socket that hands their memfds to replicas (kv.HostSocket).
type hostSide struct {
	ln       *net.UnixListener
	serving  sync.WaitGroup // the accept loop and its connections
	spillers sync.WaitGroup
}

// startTiers makes every device's host tier, if Options.HostBytes asks for them, starts
// their spillers and listens on dir/host.sock. teardown undoes what it got to.
func (o *Owner) startTiers() error {
	if o.opts.HostBytes == 0 {
		return nil
	}
	for _, s := range o.slabs {
		t, err := o.makeTier(s)
		if err != nil {
			return err
		}
		o.mu.Lock()
		s.tier = t
		o.mu.Unlock()
	}
	for _, s := range o.slabs {
		o.host.spillers.Add(1)
		go func() {
			defer o.host.spillers.Done()
			o.spiller(o.stopped, s.tier)
		}()
	}
	ln, err := listenPages(filepath.Join(o.dir, kv.HostSocket), opensToOthers(o.opts.Policy))
	if err != nil {
		return err
	}
	o.host.ln = ln
	o.host.serving.Add(1)
	go func() {
		defer o.host.serving.Done()
		for {
			nc, err := ln.AcceptUnix()
			if err != nil {
				if o.stopped.Err() == nil && !errors.Is(err, net.ErrClosed) {
					o.log.Error("kv: accepting on the host tier's socket failed; replicas get no host tier", "err", err)
				}
				return
			}
			o.host.serving.Add(1)
			go func() {
				defer o.host.serving.Done()
				if err := o.handOutTier(nc); err != nil && o.stopped.Err() == nil {
					o.log.Warn("kv: handing out a host tier", "err", err)
				}
			}()
		}
	}()
	return nil
}

// stopTiers stops the host side, once o.stopped has ended and no connection is served:
// the socket, the spillers, then each tier's memory. It returns what failed.
func (o *Owner) stopTiers() []error {
	var errs []error
	if o.host.ln != nil {
		_ = o.host.ln.Close()                              // cleanup: nothing is left to do if closing fails
		_ = os.Remove(filepath.Join(o.dir, kv.HostSocket)) // best effort: the next Listen replaces a stale socket
	}
	o.host.serving.Wait()
	o.host.spillers.Wait()
	for _, s := range o.slabs {
		if s.tier != nil {
			if err := o.closeTier(s.tier); err != nil {
				errs = append(errs, err)
			}
			s.tier = nil
		}
	}
	return errs
}

// handOutTier answers one connection of the host tier's socket: the policy admits the
// process, which names its device, and gets that device's tier's memfd.
func (o *Owner) handOutTier(nc *net.UnixConn) error {
	defer func() { _ = nc.Close() }()                    // cleanup: one answer per connection
	_ = nc.SetDeadline(time.Now().Add(handshakeTimeout)) // it fails only on a closed connection, which the next read or write reports
	cred, err := peercred.Get(nc)
	if err != nil {
		return err
	}
	var req [4]byte
	if _, err := io.ReadFull(nc, req[:]); err != nil {
		return fmt.Errorf("pid %d sent no device: %w", cred.PID, err)
	}
	dev := int(binary.LittleEndian.Uint32(req[:]))
	info := kv.HostTierInfo{Device: dev}
	fd := -1
	o.mu.Lock()
	s := o.byDev[dev]
	switch reason := admits(o.opts.Policy, cred); {
	case reason != "":
		info.Error = reason
	case s == nil || s.tier == nil:
		info.Error = fmt.Sprintf("device %d has no host tier here", dev)
	default:
		t := s.tier
		info.Bytes, info.Pages, info.PageBytes, fd = uint64(len(t.mem)), len(t.pages), t.pageBytes, t.fd
	}
	o.mu.Unlock()
	b, err := json.Marshal(info)
	if err != nil {
		return err
	}
	if fd < 0 {
		return errors.Join(unixfd.Send(nc, b), fmt.Errorf("refused pid %d: %s", cred.PID, info.Error))
	}
	return unixfd.Send(nc, b, fd) // the fd stays open until stopTiers, after every hand-out
}
