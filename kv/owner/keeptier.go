package owner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/internal/unixfd"
)

// The host tier's memory outlives the page server as the slabs do: a page server of a
// keeper's slabs (WithKeeper) makes each device's memfd and gives it to the keeper
// on dir/tier.sock, or, restarted, takes back the one the keeper holds. The page server
// makes the memfd, not the keeper, so that the keeper needs no host tier setting and a
// new -host-bytes needs no new keeper: a memfd of another size is replaced (the old
// tier dropped, and the page server says why).
//
// The keeper holds the memory only. The host pages' index is journaled with the slab's
// pages in the index file (WithIndex, journal.go): a host page is sealed there
// once its spill copy has completed, and its eviction is written out before the page
// is filled again, so a page whose copy had not completed never comes back. A
// restarted page server that takes back both the index and the kept memfd restores
// those host pages (Recovery.HostPages); with a memfd made anew (none kept, or one of
// another size) the index's host pages are dropped.

// TierSocket is the keeper's socket that holds the host tiers' memfds.
const TierSocket = "tier.sock"

// tierMsg is one message of dir/tier.sock, JSON, with at most one memfd. The page
// server asks for Device's memfd of Bytes; the keeper answers with it (Held), or
// without it, saying the size it held (0: none); the page server then gives it its
// new memfd (Put), which the keeper acknowledges.
type tierMsg struct {
	Device int    `json:"device"`
	Bytes  uint64 `json:"bytes"`
	Put    bool   `json:"put,omitempty"`
	Held   bool   `json:"held,omitempty"`
	Error  string `json:"error,omitempty"`
}

// keptTiers are the memfds a keeper holds, by device.
type keptTiers struct {
	srv *session.Server
	// peerUID, set by tests alone, replaces the uid the kernel names for each peer
	// (tests run as root, which the keeper admits).
	peerUID atomic.Pointer[uint32]
	mu      sync.Mutex
	fds     map[int]keptTier
}

type keptTier struct {
	fd    int
	bytes uint64
}

// serveTiers listens on dir/tier.sock for the page servers of k's slabs.
func (k *Keeper) serveTiers() error {
	o := k.o
	k.tiers.fds = map[int]keptTier{}
	ln, err := listenPages(filepath.Join(o.dir, TierSocket), false)
	if err != nil {
		return err
	}
	k.tiers.srv = session.Serve(ln, o.log, "kv/owner: keeper's host tiers", o.opts.Limits, func(c *session.Conn) {
		uid := c.Cred.UID
		if seam := k.tiers.peerUID.Load(); seam != nil {
			uid = *seam
		}
		if err := k.serveTier(c.UnixConn, uid); err != nil && o.stopped.Err() == nil {
			o.log.Warn("kv: keeping a host tier", "pid", c.Cred.PID, "err", err)
		}
	})
	return nil
}

// serveTier answers one page server: the memfd it asks for, or the one it gives.
func (k *Keeper) serveTier(nc *net.UnixConn, uid uint32) error {
	var req tierMsg
	fd, err := recvTierMsg(nc, &req)
	if err != nil {
		return err
	}
	if fd >= 0 {
		_ = unix.Close(fd) // a question carries no memfd; cleanup
		return errors.New("a memfd came with the question")
	}
	if uid != uint32(os.Getuid()) && uid != 0 {
		return errors.Join(sendTierMsg(nc, tierMsg{Error: fmt.Sprintf("uid %d is not the keeper's", uid)}, -1), fmt.Errorf("refused uid %d", uid))
	}
	if _, ok := k.o.byDev[req.Device]; !ok {
		return sendTierMsg(nc, tierMsg{Device: req.Device, Error: fmt.Sprintf("the keeper has no slab on device %d", req.Device)}, -1)
	}
	k.tiers.mu.Lock()
	kt, ok := k.tiers.fds[req.Device]
	k.tiers.mu.Unlock()
	if ok && kt.bytes == req.Bytes {
		return sendTierMsg(nc, tierMsg{Device: req.Device, Bytes: kt.bytes, Held: true}, kt.fd)
	}
	if err := sendTierMsg(nc, tierMsg{Device: req.Device, Bytes: kt.bytes}, -1); err != nil {
		return err
	}
	var put tierMsg
	if fd, err = recvTierMsg(nc, &put); err != nil {
		return err
	}
	if fd < 0 || !put.Put || put.Device != req.Device {
		if fd >= 0 {
			_ = unix.Close(fd) // cleanup: refused
		}
		return sendTierMsg(nc, tierMsg{Error: "expected the device's memfd"}, -1)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || uint64(st.Size) != put.Bytes {
		_ = unix.Close(fd) // cleanup: refused
		return sendTierMsg(nc, tierMsg{Error: fmt.Sprintf("the memfd is not of %d bytes", put.Bytes)}, -1)
	}
	k.tiers.mu.Lock()
	old, had := k.tiers.fds[req.Device]
	k.tiers.fds[req.Device] = keptTier{fd: fd, bytes: put.Bytes}
	k.tiers.mu.Unlock()
	if had {
		_ = unix.Close(old.fd) // the old tier is dropped; mappings keep its memory until unmapped
	}
	return sendTierMsg(nc, tierMsg{Device: req.Device, Bytes: put.Bytes, Held: true}, -1)
}

// closeTiers stops dir/tier.sock and closes the memfds the keeper holds.
func (k *Keeper) closeTiers() {
	if k.tiers.srv != nil {
		k.tiers.srv.Close()
		_ = os.Remove(filepath.Join(k.o.dir, TierSocket)) // best effort: the next Keep replaces a stale socket
	}
	k.tiers.mu.Lock()
	defer k.tiers.mu.Unlock()
	for d, kt := range k.tiers.fds {
		_ = unix.Close(kt.fd) // cleanup: nothing is left to do if closing fails
		delete(k.tiers.fds, d)
	}
}

// keptTierFD returns the keeper's memfd of dev's host tier if it holds one of size
// bytes (kept true), else makes one with mk and gives it to the keeper. dropped says
// why an old one was not taken back ("" if there was none or it was). On failure no
// descriptor is left open.
func (o *Owner) keptTierFD(ctx context.Context, dev int, size uint64, mk func() (int, error)) (fd int, kept bool, dropped string, err error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", filepath.Join(o.dir, TierSocket))
	if err != nil {
		return -1, false, "", fmt.Errorf("kv/owner: the keeper's host tiers: %w", err)
	}
	nc := c.(*net.UnixConn)
	defer func() { _ = nc.Close() }() // cleanup: one question per connection
	if dl, ok := ctx.Deadline(); ok {
		_ = nc.SetDeadline(dl) // bounded by ctx; a failure shows as the read's error
	}
	fail := func(err error) (int, bool, string, error) {
		return -1, false, "", fmt.Errorf("kv/owner: the keeper's host tier of device %d: %w", dev, err)
	}
	if err := sendTierMsg(nc, tierMsg{Device: dev, Bytes: size}, -1); err != nil {
		return fail(err)
	}
	var ans tierMsg
	if fd, err = recvTierMsg(nc, &ans); err != nil {
		return fail(err)
	}
	switch {
	case ans.Error != "":
		if fd >= 0 {
			_ = unix.Close(fd) // cleanup: refused
		}
		return fail(errors.New(ans.Error))
	case ans.Held && fd >= 0:
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || uint64(st.Size) != size {
			_ = unix.Close(fd) // cleanup: refused
			return fail(fmt.Errorf("the kept memfd is not of %d bytes", size))
		}
		return fd, true, "", nil
	case fd >= 0:
		_ = unix.Close(fd) // cleanup: an answer without Held carries none
		return fail(errors.New("the keeper sent a memfd it does not hold"))
	}
	if ans.Bytes != 0 {
		dropped = fmt.Sprintf("device %d's host tier was of %d bytes, now %d: its pages are dropped", dev, ans.Bytes, size)
	}
	if fd, err = mk(); err != nil {
		return -1, false, "", err
	}
	keep := func() error {
		if err := sendTierMsg(nc, tierMsg{Device: dev, Bytes: size, Put: true}, fd); err != nil {
			return err
		}
		var ack tierMsg
		afd, err := recvTierMsg(nc, &ack)
		if afd >= 0 {
			_ = unix.Close(afd) // cleanup: an acknowledgement carries none
		}
		if err != nil {
			return err
		}
		if ack.Error != "" || !ack.Held {
			return fmt.Errorf("the keeper refused it: %s", ack.Error)
		}
		return nil
	}
	if err := keep(); err != nil {
		_ = unix.Close(fd) // cleanup: the keeper's refusal is the error returned
		return fail(err)
	}
	return fd, false, dropped, nil
}

// sendTierMsg writes m, with fd if it is not negative.
func sendTierMsg(nc *net.UnixConn, m tierMsg, fd int) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if fd < 0 {
		return unixfd.Send(nc, b)
	}
	return unixfd.Send(nc, b, fd)
}

// recvTierMsg reads one message into m and the memfd it carried (-1: none).
func recvTierMsg(nc *net.UnixConn, m *tierMsg) (int, error) {
	buf := make([]byte, 512)
	n, fds, err := unixfd.Recv(nc, buf, 1)
	if err != nil {
		return -1, err
	}
	fd := -1
	if len(fds) == 1 {
		fd = fds[0]
	}
	if err := json.Unmarshal(buf[:n], m); err != nil {
		if fd >= 0 {
			_ = unix.Close(fd) // cleanup: the message is refused
		}
		return -1, fmt.Errorf("a malformed message: %w", err)
	}
	return fd, nil
}
