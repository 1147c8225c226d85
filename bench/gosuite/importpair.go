package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/cudapool/cudapool/pool"
)

// exporterRole makes this program the exporter of the import pair:
//
//	gosuite exporter KIND N
//
// On the socket it inherits as fd 3 it sends its pool's descriptor, then the export
// records of N buffers of shareSize bytes, and exits once the parent says (one byte)
// that every import is freed.
const exporterRole = "exporter"

// importBuffers is how many distinct buffers a batch of the import pair imports and
// frees, as in bench/cref and bench/cudacore.py: a record is imported again only after
// the batch's synchronize, so no import aliases a free still queued (FACTS 4).
const importBuffers = 1000

func exporterMain(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "gosuite exporter:", err); return 1 }
	if len(args) != 2 {
		return fail(errors.New("want KIND N"))
	}
	n, err := strconv.Atoi(args[1])
	if err != nil || n <= 0 {
		return fail(fmt.Errorf("bad count %q", args[1]))
	}
	picked, err := choose.Runtime(args[0])
	rt := picked.Runtime
	if err != nil {
		return fail(err)
	}
	f := os.NewFile(3, "parent")
	c, err := net.FileConn(f)
	_ = f.Close() // cleanup: nothing is left to do if closing fails
	if err != nil {
		return fail(err)
	}
	conn := c.(*net.UnixConn)
	defer func() { _ = conn.Close() }() // cleanup: nothing is left to do if closing fails
	p, err := pool.New(rt, 0, pool.WithHandleType(cudart.HandleTypePosixFD))
	if err != nil {
		return fail(err)
	}
	defer func() { _, _ = p.Close(context.Background(), pool.Force()) }() // cleanup: nothing is left to do if closing fails
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	defer func() { _ = rt.StreamDestroy(0, s) }() // cleanup: nothing is left to undo if it fails
	h, err := p.ExportHandle()
	if err != nil {
		return fail(err)
	}
	records := make([]cudart.PtrExportData, n)
	for i := range records {
		b, err := p.Alloc(context.Background(), shareSize, s)
		if err != nil {
			return fail(err)
		}
		if records[i], err = b.ExportRecord(); err != nil {
			return fail(err)
		}
	}
	if err := rt.StreamSynchronize(0, s); err != nil {
		return fail(err)
	}
	if err := unixfd.Send(conn, binary.LittleEndian.AppendUint64(nil, uint64(n)), h.FD); err != nil {
		return fail(err)
	}
	if err := binary.Write(conn, binary.LittleEndian, records); err != nil {
		return fail(err)
	}
	if _, err := io.ReadFull(conn, make([]byte, 1)); err != nil {
		return fail(fmt.Errorf("waiting for the parent: %w", err))
	}
	return 0
}

// importPairs times cudaMemPoolImportPointer + cudaFreeAsync through the bare binding
// (the cudart layer, as C's column is the runtime itself), of records a child process
// exported: one untimed batch, then sh.batches batches of importBuffers pairs, each
// closed by a synchronize; a sample is a batch's time per pair, as in cref.
func importPairs(rt cudart.Runtime, kind string, sh shape) ([]float64, error) {
	n := min(importBuffers, sh.importBuffers)
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "exporter"), os.NewFile(uintptr(fds[1]), "parent")
	self, err := os.Executable()
	if err != nil {
		_ = mine.Close()   // cleanup: nothing is left to do if closing fails
		_ = theirs.Close() // cleanup: nothing is left to do if closing fails
		return nil, err
	}
	cmd := exec.Command(self, exporterRole, kind, strconv.Itoa(n))
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.Stderr = os.Stderr
	err = cmd.Start()
	_ = theirs.Close() // cleanup: nothing is left to do if closing fails
	if err != nil {
		_ = mine.Close() // cleanup: nothing is left to do if closing fails
		return nil, err
	}
	wait := waitFor(cmd)
	c, err := net.FileConn(mine)
	_ = mine.Close() // cleanup: nothing is left to do if closing fails
	if err != nil {
		_ = kill(cmd, wait) // its exit is the kill's; the error returned says why
		return nil, err
	}
	conn := c.(*net.UnixConn)
	defer func() { _ = conn.Close() }()             // cleanup: nothing is left to do if closing fails
	_ = conn.SetDeadline(time.Now().Add(opTimeout)) // it fails only on a closed connection, which the next read or write reports
	us, err := importLoop(rt, conn, n, sh.batches)
	if err == nil {
		_, err = conn.Write([]byte{'k'}) // every import is freed: the exporter may exit
	}
	if err != nil {
		_ = kill(cmd, wait) // its exit is the kill's; the error returned says why
		return nil, err
	}
	select {
	case err := <-wait:
		if err != nil {
			return nil, fmt.Errorf("exporter: %w", err)
		}
	case <-time.After(opTimeout):
		_ = kill(cmd, wait) // its exit is the kill's; the error returned says why
		return nil, fmt.Errorf("the exporter did not exit within %v", opTimeout)
	}
	return us, nil
}

// kill stops a child that the run gave up on and returns its exit, once reaped.
func kill(cmd *exec.Cmd, wait <-chan error) error {
	_ = cmd.Process.Kill() // the child may have exited already
	return <-wait
}

func waitFor(cmd *exec.Cmd) <-chan error {
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	return done
}

func importLoop(rt cudart.Runtime, conn *net.UnixConn, n, batches int) ([]float64, error) {
	head := make([]byte, 8)
	got, fds, err := unixfd.Recv(conn, head, 1)
	if err != nil {
		return nil, fmt.Errorf("from the exporter: %w", err)
	}
	if got != 8 || len(fds) != 1 || binary.LittleEndian.Uint64(head) != uint64(n) {
		for _, fd := range fds {
			_ = syscall.Close(fd) // cleanup: the descriptor is ours and unused
		}
		return nil, fmt.Errorf("the exporter sent %d bytes and %d descriptors, not its count and pool", got, len(fds))
	}
	imported, err := rt.MemPoolImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: fds[0]})
	_ = syscall.Close(fds[0]) // cleanup: the descriptor is ours and unused
	if err != nil {
		return nil, err
	}
	records := make([]cudart.PtrExportData, n)
	if err := binary.Read(conn, binary.LittleEndian, records); err != nil {
		return nil, fmt.Errorf("export records from the exporter: %w", err)
	}
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return nil, err
	}
	defer func() { _ = rt.StreamDestroy(0, s) }() // cleanup: nothing is left to undo if it fails
	var us []float64
	for b := -1; b < batches; b++ {
		start := monotonic()
		for _, rec := range records {
			p, err := rt.MemPoolImportPointer(0, imported, rec)
			if err != nil {
				return nil, err
			}
			if err := rt.FreeAsync(0, p, s); err != nil {
				return nil, err
			}
		}
		if err := rt.StreamSynchronize(0, s); err != nil {
			return nil, err
		}
		if b >= 0 {
			us = append(us, float64(monotonic()-start)/1e3/float64(n))
		}
	}
	return us, nil
}
