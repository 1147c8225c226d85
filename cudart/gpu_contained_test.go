package cudart_test

// FACTS 14, probed: what a consumer on another GPU can still do once the producer it
// imported from is SIGKILLed, and which copy path survives a kill in the middle of a
// copy. Each case runs the producer and the consumer as children (the consumer's
// context may be lost, and the test process's must not be); the consumer reports
// every observation as a line, which the test logs, and states the assumptions the
// export package builds on as "assume NAME: ok" or "assume NAME: FAILED ...", which
// the test requires.
//
// On the GPU host:
//
//	cd cudart && CUDAPOOL_REQUIRE_GPU=1 ../bin/gpu/cudart.test -test.v -test.run TestGPUPeerConsumerOfKilledProducer

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/gputest"
)

func init() {
	childRoles["f14-producer"] = f14ProducerMain
	childRoles["f14-consumer"] = f14ConsumerMain
}

const (
	// f14Size is the shared buffer: 1 GiB copies over NVLink take about 2.7 ms
	// (FACTS), so a kill at a random moment of a copy loop lands mid-copy.
	f14Size = 1 << 30
	f14Fill = 0x5a
	// f14MsgSize: the buffer's export data and an IPC event recorded after busy work.
	f14MsgSize = 64 + 64
)

// The cases: how the consumer uses the mapping around the producer's death.
var f14Cases = []struct{ name, doc string }{
	{"untouched", "made a replica before the death, then only frees its import and checks its context"},
	{"owner-stream", "copies the mapping to its own GPU through a stream of the owner GPU while the producer is killed"},
	{"peer-stream", "copies the mapping to its own GPU through a stream of its own GPU while the producer is killed"},
	{"wait-event", "makes a stream wait on the producer's IPC event, recorded after busy work, while the producer is killed"},
}

func TestGPUPeerConsumerOfKilledProducer(t *testing.T) {
	rt := gputest.Devices(t, 2)
	can, err := rt.DeviceCanAccessPeer(1, 0)
	require.NoError(t, err)
	if !can {
		t.Skip("device 1 cannot access device 0")
	}
	for _, c := range f14Cases {
		t.Run(c.name, func(t *testing.T) {
			t.Logf("the consumer %s", c.doc)
			lines := runF14(t, c.name)
			var done bool
			for _, l := range lines {
				t.Log(l)
				if rest, ok := strings.CutPrefix(l, "assume "); ok {
					assert.NotContains(t, rest, "FAILED", "an assumption the export package builds on")
				}
				// A probe that could not set itself up, or a consumer that failed, proved nothing.
				assert.False(t, strings.HasPrefix(l, "setup: "), "the consumer's setup failed: %s", l)
				assert.False(t, strings.HasPrefix(l, "(test) consumer exited: "), "the consumer failed: %s", l)
				done = done || l == "done"
			}
			require.True(t, done, "the consumer ended without reporting done")
		})
	}
}

// runF14 runs one case and returns the consumer's report.
func runF14(t *testing.T, name string) []string {
	prod, pconn := startChild(t, "f14-producer", name)
	msg, fd, err := recvWithFD(pconn, f14MsgSize)
	require.NoError(t, err, "from the producer")
	cons, cconn := startChild(t, "f14-consumer", name)
	err = sendWithFD(cconn, msg, fd)
	_ = unix.Close(fd) // test cleanup
	require.NoError(t, err, "to the consumer")

	var lines []string
	sc := bufio.NewScanner(cconn)
	for sc.Scan() {
		l := sc.Text()
		lines = append(lines, l)
		if l == "kill me" {
			if name != "wait-event" {
				time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond) // somewhere in a copy
			}
			start := time.Now()
			require.NoError(t, prod.Process.Kill())
			_ = prod.Wait() // test cleanup
			lines = append(lines, fmt.Sprintf("(test) producer SIGKILLed and reaped in %v", time.Since(start).Round(time.Microsecond)))
			_, err := cconn.Write([]byte{'k'})
			require.NoError(t, err)
		}
		if l == "done" {
			break
		}
	}
	if err := cons.Wait(); err != nil {
		lines = append(lines, fmt.Sprintf("(test) consumer exited: %v", err))
	}
	_ = prod.Process.Kill() // test cleanup
	_ = prod.Wait()         // test cleanup
	return lines
}

// f14ProducerMain fills a buffer on device 0, sends its pool and export data and, for
// wait-event, an IPC event recorded after about a second of busy work, and then waits
// to be killed.
func f14ProducerMain(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "f14 producer:", err); return 1 }
	rt, conn, err := childStart()
	if err != nil {
		return fail(err)
	}
	_ = conn.SetDeadline(time.Time{}) // test cleanup
	pool, err := rt.MemPoolCreate(cudart.PoolProps{HandleTypes: cudart.HandleTypePosixFD, Location: cudart.DeviceLocation(0)})
	if err != nil {
		return fail(err)
	}
	h, err := rt.MemPoolExportToShareableHandle(0, pool, cudart.HandleTypePosixFD)
	if err != nil {
		return fail(err)
	}
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	buf, err := rt.MallocFromPoolAsync(0, f14Size, pool, s)
	if err == nil {
		err = rt.MemsetAsync(0, buf, f14Fill, f14Size, s)
	}
	if err == nil {
		err = rt.StreamSynchronize(0, s)
	}
	if err != nil {
		return fail(err)
	}
	data, err := rt.MemPoolExportPointer(0, buf)
	if err != nil {
		return fail(err)
	}
	ev, err := rt.EventCreate(0, cudart.EventIPC)
	if err != nil {
		return fail(err)
	}
	if len(args) > 0 && args[0] == "wait-event" {
		busy, err := rt.MallocFromPoolAsync(0, f14Size, pool, s)
		for i := 0; err == nil && i < 3000; i++ { // about a second at 3 TB/s; the launch queue bounds what is left at the record
			err = rt.MemsetAsync(0, busy, byte(i), f14Size, s)
		}
		if err != nil {
			return fail(err)
		}
	}
	if err := rt.EventRecord(0, ev, s); err != nil {
		return fail(err)
	}
	eh, err := rt.IpcGetEventHandle(0, ev)
	if err != nil {
		return fail(err)
	}
	if err := sendWithFD(conn, append(data[:], eh[:]...), h.FD); err != nil {
		return fail(err)
	}
	_, _ = io.ReadFull(conn, make([]byte, 1)) // until killed
	return 0
}

// f14Consumer is the consumer's state: the mapping, a replica on device 1 and a
// stream on each device.
type f14Consumer struct {
	rt      cudart.Runtime
	conn    *net.UnixConn
	pool    cudart.MemPool // imported
	mapping cudart.DevicePtr
	local   cudart.MemPool // on device 1
	replica cudart.DevicePtr
	s0, s1  cudart.Stream
	killed  chan struct{}
}

func (c *f14Consumer) say(format string, args ...any) {
	fmt.Fprintf(c.conn, format+"\n", args...)
}

func (c *f14Consumer) assume(name string, err error) {
	if err != nil {
		c.say("assume %s: FAILED: %v", name, err)
		return
	}
	c.say("assume %s: ok", name)
}

// replicaHolds checks the replica's first, middle and last MiB on device 1.
func (c *f14Consumer) replicaHolds() error {
	got := make([]byte, 1<<20)
	for _, off := range []uint64{0, f14Size/2 - 1<<19, f14Size - 1<<20} {
		if err := c.rt.MemcpyDtoHAsync(1, got, c.replica+cudart.DevicePtr(off), c.s1); err != nil {
			return err
		}
		if i := bytes.IndexFunc(got, func(r rune) bool { return r != f14Fill }); i >= 0 {
			return fmt.Errorf("byte %d of the replica is %#x, want %#x", int(off)+i, got[i], f14Fill)
		}
	}
	return nil
}

// copyVia copies the mapping into the replica on stream s of device dev, n times.
func (c *f14Consumer) copyVia(dev int, s cudart.Stream, n int) error {
	for range n {
		if err := c.rt.MemcpyDtoDAsync(dev, c.replica, c.mapping, f14Size, s); err != nil {
			return err
		}
	}
	return c.rt.StreamSynchronize(dev, s)
}

// contextWorks does fresh work on both devices: allocation, set, copy back, free.
func (c *f14Consumer) contextWorks() {
	for dev := range 2 {
		err := func() error {
			p, err := c.rt.MemPoolCreate(cudart.PoolProps{Location: cudart.DeviceLocation(dev)})
			if err != nil {
				return err
			}
			defer func() { _ = c.rt.MemPoolDestroy(dev, p) }() // test cleanup
			s, err := c.rt.StreamCreate(dev, cudart.StreamNonBlocking)
			if err != nil {
				return err
			}
			defer func() { _ = c.rt.StreamDestroy(dev, s) }() // test cleanup
			ptr, err := c.rt.MallocFromPoolAsync(dev, 1<<20, p, s)
			if err != nil {
				return err
			}
			got := make([]byte, 4096)
			if err := c.rt.MemsetAsync(dev, ptr, 7, 1<<20, s); err != nil {
				return err
			}
			if err := c.rt.MemcpyDtoHAsync(dev, got, ptr, s); err != nil {
				return err
			}
			if got[4095] != 7 {
				return fmt.Errorf("read %#x back, want 7", got[4095])
			}
			if err := c.rt.FreeAsync(dev, ptr, s); err != nil {
				return err
			}
			return c.rt.StreamSynchronize(dev, s)
		}()
		c.say("fresh work on device %d after the death: %v", dev, errText(err))
	}
}

func errText(err error) string {
	if err == nil {
		return "ok"
	}
	return err.Error()
}

func f14ConsumerMain(args []string) int {
	rt, conn, raw, fd, err := childSetup(f14MsgSize)
	if err != nil {
		fmt.Fprintln(os.Stderr, "f14 consumer:", err)
		return 1
	}
	defer func() { _ = conn.Close() }()             // test cleanup
	_ = conn.SetDeadline(time.Now().Add(hangGuard)) // test cleanup
	c := &f14Consumer{rt: rt, conn: conn, killed: make(chan struct{})}
	defer c.say("done")
	err = c.setup(fd, cudart.PtrExportData(raw[:64]))
	_ = unix.Close(fd) // test cleanup
	if err != nil {
		c.say("setup: %v", err)
		return 1
	}
	go func() {
		if _, err := io.ReadFull(conn, make([]byte, 1)); err == nil {
			close(c.killed)
		}
	}()
	var eh cudart.IpcEventHandle
	copy(eh[:], raw[64:])
	switch args[0] {
	case "untouched":
		c.untouched()
	case "owner-stream":
		c.copyThroughKill(0, c.s0)
	case "peer-stream":
		c.copyThroughKill(1, c.s1)
	case "wait-event":
		c.waitThroughKill(eh)
	}
	c.contextWorks()
	return 0
}

// setup imports the buffer, grants device 1 access and makes a replica on device 1
// through a stream of the owner device, checked.
func (c *f14Consumer) setup(fd int, data cudart.PtrExportData) error {
	rt := c.rt
	var err error
	if c.pool, err = rt.MemPoolImportFromShareableHandle(1, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: fd}); err != nil {
		return fmt.Errorf("import pool: %w", err)
	}
	if err = rt.MemPoolSetAccess(1, c.pool, []cudart.AccessDesc{{Location: cudart.DeviceLocation(1), Flags: cudart.AccessReadWrite}}); err != nil {
		return fmt.Errorf("grant device 1: %w", err)
	}
	if c.mapping, err = rt.MemPoolImportPointer(1, c.pool, data); err != nil {
		return fmt.Errorf("import pointer: %w", err)
	}
	if c.local, err = rt.MemPoolCreate(cudart.PoolProps{Location: cudart.DeviceLocation(1)}); err != nil {
		return err
	}
	// The owner-stream cases copy into the replica on a stream of device 0, which must be
	// granted access to the replica's pool first (pool memory is reachable only from the
	// devices its pool grants; the copy is refused with invalid argument otherwise).
	if err = rt.MemPoolSetAccess(1, c.local, []cudart.AccessDesc{{Location: cudart.DeviceLocation(0), Flags: cudart.AccessReadWrite}}); err != nil {
		return fmt.Errorf("grant device 0 the replica's pool: %w", err)
	}
	if c.s0, err = rt.StreamCreate(0, cudart.StreamNonBlocking); err != nil {
		return err
	}
	if c.s1, err = rt.StreamCreate(1, cudart.StreamNonBlocking); err != nil {
		return err
	}
	if c.replica, err = rt.MallocFromPoolAsync(1, f14Size, c.local, c.s1); err != nil {
		return err
	}
	if err = rt.StreamSynchronize(1, c.s1); err != nil {
		return err
	}
	start := time.Now()
	if err = c.copyVia(0, c.s0, 1); err != nil {
		return fmt.Errorf("first copy: %w", err)
	}
	c.say("replica through the owner device, producer alive: %v for 1 GiB", time.Since(start).Round(time.Microsecond))
	return c.replicaHolds()
}

// untouched: the producer dies while the consumer does nothing with the mapping; it
// then releases its import, as an Importer told of the death does.
func (c *f14Consumer) untouched() {
	c.say("kill me")
	<-c.killed
	c.assume("a replica made before the death reads right on device 1", c.replicaHolds())
	err := c.rt.FreeAsync(1, c.mapping, c.s1)
	if err == nil {
		err = c.rt.StreamSynchronize(1, c.s1)
	}
	c.assume("freeing the import of a dead producer on the peer device keeps the context", err)
	c.say("destroying the imported pool: %v", errText(c.rt.MemPoolDestroy(1, c.pool)))
	c.assume("the replica still reads right after the import is freed", c.replicaHolds())
}

// copyThroughKill copies the mapping into the replica in batches of 4 on stream s of
// dev while the producer is killed, and one batch more once the kill is reported (the
// test reaps the producer first), and reports which batch failed first, if any; then
// what a copy after the death does.
func (c *f14Consumer) copyThroughKill(dev int, s cudart.Stream) {
	c.say("kill me")
	var (
		batches, failedAt int
		firstErr          error
		deadline          = time.Now().Add(hangGuard / 2)
	)
	batch := func() {
		batches++
		if err := c.copyVia(dev, s, 4); err != nil && firstErr == nil {
			firstErr, failedAt = err, batches
		}
	}
	for killed := false; !killed; {
		if time.Now().After(deadline) {
			c.say("the kill was never reported")
			return
		}
		batch()
		select {
		case <-c.killed:
			killed = true
		default:
		}
	}
	batch()
	if firstErr != nil {
		c.say("copies on device %d's stream: %d batches, the first failure in batch %d: %v", dev, batches, failedAt, firstErr)
	} else {
		c.say("copies on device %d's stream: all %d batches succeeded, the last ones after the producer was reaped", dev, batches)
	}
	if dev == 0 {
		// export's WithLocalCopy copies through the owner device for this (2026-11-30:
		// all 16 batches succeeded; on the peer's stream, batch 6 was contained).
		c.assume("copies through the owner device survive a kill mid-copy", firstErr)
	}
	c.afterKill(dev, s)
}

func (c *f14Consumer) afterKill(dev int, s cudart.Stream) {
	err := c.rt.MemsetAsync(1, c.replica, 0, f14Size, c.s1)
	if err == nil {
		err = c.rt.StreamSynchronize(1, c.s1)
	}
	c.say("clearing the replica on device 1 after the death: %v", errText(err))
	err = c.copyVia(dev, s, 1)
	if err == nil {
		err = c.replicaHolds()
	}
	c.say("a whole copy on device %d's stream after the death, then its bytes: %v", dev, errText(err))
	if dev == 0 {
		c.assume("a copy through the owner device after the death reads the right bytes (FACTS 14)", err)
	}
	err = c.rt.FreeAsync(1, c.mapping, c.s1)
	if err == nil {
		err = c.rt.StreamSynchronize(1, c.s1)
	}
	c.say("freeing the import: %v", errText(err))
}

// waitThroughKill makes a device 1 stream wait on the producer's event, recorded
// after about a second of work, and reports whether the wait ever ends once the
// producer is killed with that work queued.
func (c *f14Consumer) waitThroughKill(h cudart.IpcEventHandle) {
	ev, err := c.rt.IpcOpenEventHandle(1, h)
	if err != nil {
		c.say("opening the producer's event: %v", err)
		return
	}
	mine, err := c.rt.EventCreate(1, cudart.EventDisableTiming)
	if err == nil {
		err = c.rt.StreamWaitEvent(1, c.s1, ev)
	}
	if err == nil {
		err = c.rt.EventRecord(1, mine, c.s1)
	}
	if err != nil {
		c.say("waiting on the producer's event: %v", err)
		return
	}
	done, err := c.rt.EventQuery(1, mine)
	c.say("before the kill, the wait has ended: %v (%v)", done, errText(err))
	c.say("kill me")
	<-c.killed
	start := time.Now()
	for time.Since(start) < 5*time.Second {
		done, err := c.rt.EventQuery(1, mine)
		if err != nil || done {
			c.say("a stream waiting on a killed producer's event: ended %v after the kill was reported (%v)", time.Since(start).Round(time.Millisecond), errText(err))
			return
		}
		time.Sleep(time.Millisecond)
	}
	c.say("a stream waiting on a killed producer's event: still waiting 5 s after the kill")
}
