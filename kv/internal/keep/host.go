package keep

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// The host tier socket, dir/host.sock (kv.HostSocket): where a replica gets the memfd
// of its device's host tier from the owner, in one exchange a connection: HostHello,
// answered by HostTier with the memfd riding with it, or by HostRefused; then the
// owner closes. Its frames are this package's, of their own types (from 48).

// HostVersion is the host tier socket's version; HostHello carries it. Version 1 was
// unframed: 4 bytes of device, a JSON answer.
const HostVersion = 2

// The host tier socket's frame types.
const (
	TypeHostHello   Type = 48 // replica: version, pid, device
	TypeHostTier    Type = 49 // owner: the device's tier; its memfd rides with the frame
	TypeHostRefused Type = 50 // owner: no memfd: a code and why
)

// CodeNoTier is HostRefused's code for a device with no host tier here.
const CodeNoTier uint16 = 6

type (
	// HostHello asks for device Device's host tier: the replica's version and pid
	// (for logs; the owner judges by the kernel's credentials).
	HostHello struct{ Version, PID, Device uint32 }
	// HostTier is a device's host tier: a memfd of Bytes (sealed against shrinking
	// and growing) holding Pages host pages of PageBytes, page p at p*PageBytes.
	HostTier struct {
		Device, Pages    uint32
		PageBytes, Bytes uint64
	}
)

// HostPayloadLimits are the payload lengths each frame type of the host tier socket
// may have.
var HostPayloadLimits = map[Type]Limit{
	TypeHostHello:   {12, 12},
	TypeHostTier:    {24, 24},
	TypeHostRefused: {4, 4 + kvwire.MaxText},
}

// hostTimeout bounds a replica's exchange on the host tier socket where its context
// has no earlier deadline.
const hostTimeout = 10 * time.Second

// AskHostTier asks the owner on the host tier socket at path for device dev's tier:
// its description and memfd, which the caller owns. It fails with an error wrapping
// [ErrNoTier] where the owner has no tier on dev, [ErrRefused] where it does not admit
// this process or speaks another version (naming both, an owner of the unframed
// version 1 included), [ErrMalformed] for an answer that breaks the layout, and with the
// dial's error where nothing listens. On failure no descriptor is left open.
func AskHostTier(ctx context.Context, path string, dev int) (HostTier, int, error) {
	nc, err := session.Dial(ctx, path, false)
	if err != nil {
		return HostTier{}, -1, err
	}
	defer func() { _ = nc.Close() }() // cleanup: the owner answers once
	w := session.NewWriter(nc, hostTimeout)
	err = w.Write(ctx, func(b []byte) ([]byte, error) {
		return Append(b, TypeHostHello, 1, HostHello{Version: HostVersion, PID: uint32(os.Getpid()), Device: uint32(dev)})
	})
	if err != nil {
		return HostTier{}, -1, fmt.Errorf("keep: asking for the host tier: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { _ = nc.SetReadDeadline(time.Unix(1, 0)) }) // it only wakes the read
	defer stop()
	_ = nc.SetReadDeadline(time.Now().Add(hostTimeout)) // it fails only on a closed connection, which the read reports
	f := newFrames(nc, kvwire.NewReader())
	defer f.close()
	first := firstByte(nc)
	h, p, fd, err := f.next(true)
	if err != nil && first == '{' { // an owner of version 1 answers JSON, unframed
		return HostTier{}, -1, fmt.Errorf("%w: the owner speaks host tier socket version 1 (unframed JSON); this replica speaks %d", ErrRefused, HostVersion)
	}
	if err != nil {
		if ctx.Err() != nil {
			err = errors.Join(ctx.Err(), err)
		}
		return HostTier{}, -1, fmt.Errorf("keep: the host tier's answer: %w", err)
	}
	m, err := Decode(h, p)
	switch {
	case err != nil:
	case h.Type == TypeHostRefused:
		pm := m.(Problem)
		if pm.Code == CodeNoTier {
			err = fmt.Errorf("%w: %s", ErrNoTier, pm.Text)
		} else {
			err = remote(TypeRefused, pm)
		}
	case h.Type != TypeHostTier:
		err = fmt.Errorf("%w: the owner answered HostHello with %s", ErrMalformed, h.Type)
	case m.(HostTier).Device != uint32(dev):
		err = fmt.Errorf("%w: the owner answered with device %d's tier, not %d's", ErrMalformed, m.(HostTier).Device, dev)
	}
	if err != nil {
		closeFD(fd)
		return HostTier{}, -1, err
	}
	return m.(HostTier), fd, nil
}

// firstByte waits for the first byte of nc's answer, as a read does (until its
// deadline), and returns it without taking it, or -1 where none came: an owner of
// version 1 answers with JSON, whose first byte tells.
func firstByte(nc *net.UnixConn) int {
	rc, err := nc.SyscallConn()
	if err != nil {
		return -1
	}
	var b [1]byte
	first := -1
	_ = rc.Read(func(fd uintptr) bool { // its error is the next read's too
		n, _, err := unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		if errors.Is(err, unix.EAGAIN) {
			return false // wait until the socket is readable
		}
		if err == nil && n == 1 {
			first = int(b[0])
		}
		return true
	})
	return first
}

// ServeHostTier answers one connection of the host tier socket: it reads the
// HostHello and answers it with what tier says for the device (a tier and its memfd,
// which stays the caller's, or an error: one wrapping [ErrNoTier] or [ErrRefused] is said
// with its code), or refuses another version, naming both. It returns what went
// wrong, for the caller's log: a refusal, a malformed frame, a failed write.
func ServeHostTier(ctx context.Context, c *session.Conn, tier func(HostHello) (HostTier, int, error)) error {
	f := newFrames(c.UnixConn, kvwire.NewHandshakeReader())
	defer f.close()
	w := session.NewWriter(c.UnixConn, hostTimeout)
	h, p, _, err := f.next(true)
	if err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
			return fmt.Errorf("pid %d sent no HostHello: %w", c.Cred.PID, err)
		}
		return fmt.Errorf("pid %d: %w (a replica of the unframed version 1 sends 4 bytes)", c.Cred.PID, err)
	}
	refuse := func(code uint16, why string) error {
		werr := w.Write(ctx, func(b []byte) ([]byte, error) {
			return Append(b, TypeHostRefused, h.ID, Problem{Code: code, Text: why})
		})
		return errors.Join(fmt.Errorf("refused pid %d: %s", c.Cred.PID, why), werr)
	}
	if h.Type != TypeHostHello {
		return refuse(CodeRefused, fmt.Sprintf("the first frame is %s, not HostHello", h.Type))
	}
	m, err := Decode(h, p)
	if err != nil {
		return refuse(CodeRefused, err.Error())
	}
	hello := m.(HostHello)
	if hello.Version != HostVersion {
		return refuse(CodeRefused, fmt.Sprintf("host tier socket version %d; this owner speaks %d", hello.Version, HostVersion))
	}
	t, fd, err := tier(hello)
	switch {
	case errors.Is(err, ErrNoTier):
		return refuse(CodeNoTier, fmt.Sprintf("device %d has no host tier here", hello.Device))
	case err != nil:
		return refuse(codeOf(err), err.Error())
	}
	return w.WriteFD(ctx, fd, func(b []byte) ([]byte, error) { return Append(b, TypeHostTier, h.ID, t) })
}
