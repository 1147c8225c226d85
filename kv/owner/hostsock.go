package owner

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sync"

	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/keep"
)

// hostSide is what the host tiers run besides the slabs: a spiller per tier and the
// socket that hands their memfds to replicas (kv.HostSocket).
type hostSide struct {
	srv      *session.Server // dir/host.sock
	spillers sync.WaitGroup
}

// makeTiers makes every device's host tier's memory, if WithHostBytes asks for
// them. teardown undoes what it got to.
func (o *Owner) makeTiers() error {
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
	return nil
}

// startTiers starts the host tiers' spillers and listens on dir/host.sock, once the
// tables are made. teardown undoes what it got to.
func (o *Owner) startTiers() error {
	if o.opts.HostBytes == 0 {
		return nil
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
	// Served like the page socket: accept errors backed off, handshakes and connections
	// capped by the handshake and connection limits, a panic contained to its connection.
	o.host.srv = session.Serve(ln, o.log, "kv/owner: host tier", o.opts.Limits, func(c *session.Conn) {
		if err := o.handOutTier(c); err != nil && o.stopped.Err() == nil {
			o.log.Warn("kv: handing out a host tier", "err", err)
		}
	})
	return nil
}

// stopTiers stops the host side, once o.stopped has ended and no connection is served:
// the socket, the spillers, then each tier's memory. It returns what failed.
func (o *Owner) stopTiers() []error {
	var errs []error
	if o.host.srv != nil {
		o.host.srv.Close()                                 // the listener and every connection
		_ = os.Remove(filepath.Join(o.dir, kv.HostSocket)) // best effort: the next Listen replaces a stale socket
	}
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

// handOutTier answers one connection of the host tier's socket (keep.ServeHostTier):
// the policy admits the process, which names its device, and gets that device's
// tier's memfd. It runs within the server's handshake timeout: one answer per
// connection.
func (o *Owner) handOutTier(c *session.Conn) error {
	return keep.ServeHostTier(o.stopped, c, func(m keep.HostHello) (keep.HostTier, int, error) {
		if reason := session.Admits(o.opts.Policy.AllowUIDs, o.opts.Policy.AllowGIDs, c.Cred, "the owner"); reason != "" {
			return keep.HostTier{}, -1, fmt.Errorf("%w: %s", keep.ErrRefused, reason)
		}
		o.mu.Lock()
		defer o.mu.Unlock()
		s := o.byDev[int(m.Device)]
		if m.Device > math.MaxInt32 || s == nil || s.tier == nil {
			return keep.HostTier{}, -1, keep.ErrNoTier
		}
		t := s.tier
		// The fd stays open until stopTiers, after every hand-out.
		return keep.HostTier{Device: m.Device, Pages: uint32(t.pages), PageBytes: t.pageBytes, Bytes: uint64(len(t.mem))}, t.fd, nil
	})
}
