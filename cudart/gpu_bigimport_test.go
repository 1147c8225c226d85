package cudart_test

// Imports of large pool allocations, probed: for each size, an exporter child
// allocates that much from a fresh IPC pool on device 0, writes markers at its start,
// around the 4 GiB boundary and at its end, and exports it; an importer child imports
// the pool and the allocation through this binding and reads the markers back. Each
// size has its own pair of children, so that a crash in the driver kills only them.
// An importer that crashed is run once more with a large stack limit (RLIMIT_STACK,
// which glibc turns into the default stack of every thread, cgo's included), to tell a
// stack overflow in the driver from a crash that does not depend on the stack.
//
// A crash or an error is a finding, logged in the table; the test fails only where a
// size could not be measured (a child that failed to set up) or where an import read
// bytes other than the exporter's. The table has a row per size: "import" is imported,
// error (the driver's error in the detail), crashed (the signal and the call it
// interrupted in the detail), skipped (not enough free memory) or unmeasured; "read"
// is ok (every marker, the last byte included, read back right), WRONG, crashed or not
// read; the stack column is the second run's import and read, after a crash.
//
// On the GPU host:
//
//	cd cudart && CUDAPOOL_REQUIRE_GPU=1 ../bin/gpu/cudart.test -test.v -test.run TestGPUBigImport

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/gputest"
	"github.com/cudapool/cudapool/internal/unixfd"
)

func init() {
	childRoles["big-exporter"] = bigExporterMain
	childRoles["big-importer"] = bigImporterMain
}

const (
	GiB = 1 << 30

	// bigChunk is the length of each marker.
	bigChunk = 4 * KiB
	// bigMargin is the free memory a size must leave on the device besides itself.
	bigMargin = 512 * MiB
	// bigExportMsgSize is the exporter's answer: the export data, the allocation's
	// address and an error text, NUL-padded (empty on success, when the pool's
	// descriptor comes with it).
	bigExportMsgSize = 64 + 8 + 248
	// bigImportMsgSize is what the importer is given: the size, the export data and
	// the exporter's address.
	bigImportMsgSize = 8 + 64 + 8
	// bigStack is the stack limit of an importer's second run.
	bigStack = 256 * MiB
)

// bigSizes are the sizes probed; 4 GiB and one granule tells whether a limit lies at
// 2^32.
var bigSizes = []uint64{2 * GiB, 4 * GiB, 4*GiB + 2*MiB, 6 * GiB, 8 * GiB, 12 * GiB}

// sizeString is size in GiB, and the MiB beyond them if any.
func sizeString(size uint64) string {
	if mib := size % GiB >> 20; mib != 0 {
		return fmt.Sprintf("%d GiB + %d MiB", size>>30, mib)
	}
	return fmt.Sprintf("%d GiB", size>>30)
}

// bigMarker is a range the exporter fills with a pattern of seed.
type bigMarker struct {
	off  uint64
	seed byte
}

// bigMarkers are the ranges of an allocation of size that hold a pattern: its start,
// both sides of every 4 GiB boundary in it, and its end (the last byte included).
// Every range of a size has a seed of its own, so that an import that reads one range
// where another lies (an offset wrapped at 2^32) reads wrong bytes.
func bigMarkers(size uint64) []bigMarker {
	seed := byte(size>>30) * 16
	ms := []bigMarker{{0, seed + 1}}
	for b := uint64(4 * GiB); b < size; b += 4 * GiB {
		ms = append(ms, bigMarker{b - bigChunk, seed + byte(len(ms)) + 1}, bigMarker{b, seed + byte(len(ms)) + 2})
	}
	return append(ms, bigMarker{size - bigChunk, seed + 15})
}

// bigResult is what one size came to.
type bigResult struct {
	size    uint64
	outcome string // skipped, imported, error, crashed, exporter failed
	read    string // ok, WRONG, not read
	detail  string
	// retry is what the run with a large stack came to, after a crash.
	retry string
}

func TestGPUBigImport(t *testing.T) {
	rt := gputest.Runtime(t)
	t.Log(rt.Name())
	var results []bigResult
	for _, size := range bigSizes {
		free, total, err := rt.MemGetInfo(0)
		if err != nil {
			t.Fatalf("MemGetInfo: %v", err)
		}
		if size+bigMargin > free {
			results = append(results, bigResult{size: size, outcome: "skipped", read: "-",
				detail: fmt.Sprintf("%d GiB free of %d GiB, needs %s and a margin", free>>30, total>>30, sizeString(size))})
			continue
		}
		r := probeBigImport(t, size)
		results = append(results, r)
		t.Logf("%s: import %s, read %s: %s", sizeString(size), r.outcome, r.read, r.detail)
	}
	var tab strings.Builder
	fmt.Fprintf(&tab, "\n%-15s  %-16s  %-8s  %-28s  %s\n", "size", "import", "read", "with a 256 MiB stack", "detail")
	for _, r := range results {
		fmt.Fprintf(&tab, "%-15s  %-16s  %-8s  %-28s  %s\n", sizeString(r.size), r.outcome, r.read, orDash(r.retry), r.detail)
	}
	t.Log(tab.String())
	for _, r := range results {
		assert.NotEqual(t, "WRONG", r.read, "%s: the import read other bytes than the exporter wrote: %s", sizeString(r.size), r.detail)
		assert.NotEqual(t, "unmeasured", r.outcome, "%s: not measured: %s", sizeString(r.size), r.detail)
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// probeBigImport runs one size's exporter and importer.
func probeBigImport(t *testing.T, size uint64) (res bigResult) {
	res = bigResult{size: size, read: "not read"}
	exp, econn := startChild(t, "big-exporter", strconv.FormatUint(size, 10))
	defer func() {
		econn.Write([]byte{'f'}) // free, destroy and exit
		if exp.ProcessState != nil {
			return // waited for already
		}
		if err := exp.Wait(); err != nil {
			res.detail += fmt.Sprintf("; exporter exited: %v", err)
		}
	}()
	msg := make([]byte, bigExportMsgSize)
	n, fds, err := unixfd.Recv(econn, msg, 1)
	if err == nil {
		_, err = io.ReadFull(econn, msg[n:])
	}
	if err != nil {
		for _, fd := range fds {
			unix.Close(fd)
		}
		res.outcome, res.detail = "unmeasured", fmt.Sprintf("exporter: %v (%s)", err, exitOf(exp))
		if exp.ProcessState != nil && exp.ProcessState.Sys().(syscall.WaitStatus).Signaled() {
			res.outcome = "exporter crashed"
		}
		return res
	}
	if text := string(bytes.TrimRight(msg[72:], "\x00")); text != "" || len(fds) != 1 {
		for _, fd := range fds {
			unix.Close(fd)
		}
		res.outcome, res.detail = "unmeasured", "exporter: "+text
		return res
	}
	defer unix.Close(fds[0])
	in := make([]byte, 0, bigImportMsgSize)
	in = binary.LittleEndian.AppendUint64(in, size)
	in = append(in, msg[:72]...)
	out := runBigImporter(t, in, fds[0], false)
	res.outcome, res.read, res.detail = out.outcome, out.read, out.detail
	if out.outcome == "crashed" || out.read == "crashed" {
		again := runBigImporter(t, in, fds[0], true)
		res.retry = again.outcome + ", read " + again.read
		res.detail += "; with a large stack: " + again.detail
	}
	return res
}

// runBigImporter runs one importer and reads its report.
func runBigImporter(t *testing.T, in []byte, fd int, bigStackLimit bool) bigResult {
	var restore func()
	if bigStackLimit {
		restore = raiseStackLimit(t)
	}
	var args []string
	if bigStackLimit {
		args = append(args, "large-stack")
	}
	cmd, conn := startChild(t, "big-importer", args...)
	if restore != nil {
		restore()
	}
	if err := sendWithFD(conn, in, fd); err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return bigResult{outcome: "unmeasured", read: "not read", detail: fmt.Sprintf("sending to the importer: %v", err)}
	}
	var lines []string
	sc := bufio.NewScanner(conn)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	if err := sc.Err(); err != nil {
		lines = append(lines, "note reading the importer: "+err.Error())
		cmd.Process.Kill() // hung: the guard ran out
	}
	return bigReport(lines, cmd.Wait())
}

// bigReport is what an importer's lines and its exit (cmd.Wait's error) say.
func bigReport(lines []string, werr error) bigResult {
	res := bigResult{read: "not read"}
	stage := ""
	var reads []string
	for _, l := range lines {
		switch {
		case strings.HasPrefix(l, "stage "):
			stage = strings.TrimPrefix(l, "stage ")
		case strings.HasPrefix(l, "imported"):
			res.outcome = "imported"
			reads = append(reads, l)
		case strings.HasPrefix(l, "error "):
			res.outcome = "error"
			reads = append(reads, strings.TrimPrefix(l, "error "))
		case strings.HasPrefix(l, "read ok"):
			if res.read != "WRONG" {
				res.read = "ok"
			}
		case strings.HasPrefix(l, "read WRONG"):
			res.read = "WRONG"
			reads = append(reads, l)
		case strings.HasPrefix(l, "note "):
			reads = append(reads, strings.TrimPrefix(l, "note "))
		}
	}
	var ee *exec.ExitError
	switch {
	case errors.As(werr, &ee) && ee.Sys().(syscall.WaitStatus).Signaled():
		sig := ee.Sys().(syscall.WaitStatus).Signal()
		if res.outcome == "imported" {
			if res.read != "WRONG" {
				res.read = "crashed"
			}
		} else {
			res.outcome = "crashed"
		}
		reads = append(reads, fmt.Sprintf("%v (signal %d) during %q", sig, int(sig), stage))
	case errors.As(werr, &ee) && ee.ExitCode() == 2 && stage != "" && res.outcome == "":
		// The Go runtime exits 2 when a signal arrives during a cgo call (a SIGSEGV in
		// the driver): its trace goes to the child's stderr, which is the test's.
		res.outcome = "crashed"
		reads = append(reads, fmt.Sprintf("a fault in C code (the Go runtime's exit status 2; its trace is in the test's output) during %q", stage))
	case werr != nil || res.outcome == "":
		res.outcome = "unmeasured"
		reads = append(reads, fmt.Sprintf("importer exited: %v during %q", werr, stage))
	}
	res.detail = strings.Join(reads, "; ")
	return res
}

// raiseStackLimit raises this process's RLIMIT_STACK, which children started next
// inherit, and returns the function that puts it back.
func raiseStackLimit(t *testing.T) func() {
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_STACK, &old); err != nil {
		t.Logf("getrlimit: %v; the retry keeps the stack limit", err)
		return func() {}
	}
	raised := old
	raised.Cur = bigStack
	if old.Max != unix.RLIM_INFINITY && raised.Cur > old.Max {
		raised.Cur = old.Max
	}
	if err := unix.Setrlimit(unix.RLIMIT_STACK, &raised); err != nil {
		t.Logf("setrlimit: %v; the retry keeps the stack limit", err)
		return func() {}
	}
	return func() { unix.Setrlimit(unix.RLIMIT_STACK, &old) }
}

// exitOf is how cmd ended, killing it first if it is still running (hung in a call).
func exitOf(cmd *exec.Cmd) string {
	cmd.Process.Kill()
	if err := cmd.Wait(); err != nil {
		return "exited: " + err.Error()
	}
	return "exited: 0"
}

// bigExporterMain allocates args[0] bytes from a fresh IPC pool on device 0, fills
// its markers, exports it and sends the export data with the pool's descriptor; then
// it waits for a byte (or the end of the connection), frees, destroys the pool and
// exits.
func bigExporterMain(args []string) int {
	rt, conn, err := childStart()
	if err != nil {
		fmt.Fprintln(os.Stderr, "big exporter:", err)
		return 1
	}
	size, err := strconv.ParseUint(args[0], 10, 64)
	if err != nil {
		fmt.Fprintln(os.Stderr, "big exporter:", err)
		return 1
	}
	msg := make([]byte, bigExportMsgSize)
	fail := func(what string, err error) int {
		copy(msg[72:len(msg)-1], fmt.Sprintf("%s: %v", what, err))
		unixfd.Send(conn, msg)
		return 1
	}
	pool, err := rt.MemPoolCreate(cudart.PoolProps{HandleTypes: cudart.HandleTypePosixFD, Location: cudart.DeviceLocation(0)})
	if err != nil {
		return fail("MemPoolCreate", err)
	}
	h, err := rt.MemPoolExportToShareableHandle(0, pool, cudart.HandleTypePosixFD)
	if err != nil {
		return fail("MemPoolExportToShareableHandle", err)
	}
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return fail("StreamCreate", err)
	}
	ptr, err := rt.MallocFromPoolAsync(0, size, pool, s)
	if err != nil {
		return fail("MallocFromPoolAsync "+sizeString(size), err)
	}
	if err := rt.MemsetAsync(0, ptr, 0, size, s); err != nil {
		return fail("MemsetAsync", err)
	}
	for _, m := range bigMarkers(size) {
		if err := rt.MemcpyHtoDAsync(0, ptr+cudart.DevicePtr(m.off), pattern(bigChunk, m.seed), s); err != nil {
			return fail("MemcpyHtoDAsync", err)
		}
	}
	if err := rt.StreamSynchronize(0, s); err != nil {
		return fail("StreamSynchronize", err)
	}
	data, err := rt.MemPoolExportPointer(0, ptr)
	if err != nil {
		return fail("MemPoolExportPointer", err)
	}
	copy(msg, data[:])
	binary.LittleEndian.PutUint64(msg[64:], uint64(ptr))
	if err := unixfd.Send(conn, msg, h.FD); err != nil {
		fmt.Fprintln(os.Stderr, "big exporter:", err)
		return 1
	}
	conn.SetDeadline(time.Now().Add(hangGuard))
	conn.Read(make([]byte, 1)) // a byte, the end of the connection or the guard: free either way
	status := 0
	for _, err := range []error{rt.FreeAsync(0, ptr, s), rt.StreamSynchronize(0, s), rt.StreamDestroy(0, s), rt.MemPoolDestroy(0, pool)} {
		if err != nil {
			fmt.Fprintln(os.Stderr, "big exporter:", err)
			status = 1
		}
	}
	return status
}

// bigImporterMain imports the pool and the allocation it is sent and reads the
// markers back, reporting each step as a line: "stage NAME" before each driver call
// that may crash, then "imported ..." or "error ...", a "read ok ..." or "read WRONG
// ..." per marker, and "note ..." for what else it saw.
func bigImporterMain(args []string) int {
	rt, conn, raw, fd, err := childSetup(bigImportMsgSize)
	if err != nil {
		fmt.Fprintln(os.Stderr, "big importer:", err)
		return 1
	}
	defer conn.Close()
	say := func(format string, args ...any) { fmt.Fprintf(conn, format+"\n", args...) }
	// A crash writes no core: the test reads only the signal.
	unix.Setrlimit(unix.RLIMIT_CORE, &unix.Rlimit{})
	if len(args) > 0 && args[0] == "large-stack" {
		var lim unix.Rlimit
		switch err := unix.Getrlimit(unix.RLIMIT_STACK, &lim); {
		case err != nil:
			say("note getrlimit: %v", err)
		case lim.Cur == unix.RLIM_INFINITY:
			say("note stack limit unlimited")
		default:
			say("note stack limit %d MiB", lim.Cur>>20)
		}
	}
	size := binary.LittleEndian.Uint64(raw)
	var data cudart.PtrExportData
	copy(data[:], raw[8:72])
	exported := cudart.DevicePtr(binary.LittleEndian.Uint64(raw[72:]))

	say("stage MemPoolImportFromShareableHandle")
	pool, err := rt.MemPoolImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: fd})
	unix.Close(fd)
	if err != nil {
		say("error MemPoolImportFromShareableHandle: %v", err)
		return 0
	}
	say("stage MemPoolImportPointer")
	ptr, err := rt.MemPoolImportPointer(0, pool, data)
	if err != nil {
		say("error MemPoolImportPointer: %v", err)
		rt.MemPoolDestroy(0, pool)
		return 0
	}
	say("imported at %#x (the exporter's address %#x)", uint64(ptr), uint64(exported))
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		say("note StreamCreate: %v", err)
		return 1
	}
	got := make([]byte, bigChunk)
	for _, m := range bigMarkers(size) {
		say("stage read at %#x", m.off)
		err := rt.MemcpyDtoHAsync(0, got, ptr+cudart.DevicePtr(m.off), s)
		if err == nil {
			err = rt.StreamSynchronize(0, s)
		}
		want := pattern(bigChunk, m.seed)
		switch {
		case err != nil:
			say("read WRONG at %#x: %v", m.off, err)
		case !bytes.Equal(got, want):
			i := 0
			for got[i] == want[i] {
				i++
			}
			say("read WRONG at %#x: byte %#x is %#x, want %#x", m.off, m.off+uint64(i), got[i], want[i])
		default:
			say("read ok at %#x", m.off)
		}
	}
	say("stage FreeAsync")
	if err := rt.FreeAsync(0, ptr, s); err != nil {
		say("note FreeAsync of the import: %v", err)
	}
	if err := rt.StreamSynchronize(0, s); err != nil {
		say("note StreamSynchronize after the free: %v", err)
	}
	rt.StreamDestroy(0, s)
	if err := rt.MemPoolDestroy(0, pool); err != nil {
		say("note MemPoolDestroy of the imported pool: %v", err)
	}
	say("stage done")
	return 0
}
