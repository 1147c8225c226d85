package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	_ "github.com/cudapool/cudapool/cudart/choose/softdevice" // the tests run on the software device
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/pool"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata")

func TestMain(m *testing.M) {
	proctest.Main(m, map[string]func([]string) int{"exporter": exporterRole, "consumer": consumerRole})
}

// hangGuard bounds waits that only a bug could make long.
const hangGuard = time.Minute

// poolstat runs the command in this process and returns its exit status and output.
func poolstat(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(context.Background(), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// report runs poolstat -json, checks its output against the schema and decodes it; it
// fails unless the exit status is wantCode.
func report(t *testing.T, wantCode int, args ...string) *Report {
	t.Helper()
	code, out, errOut := poolstat(t, append([]string{"-json"}, args...)...)
	require.Equal(t, wantCode, code, "poolstat %q\n%s%s", args, out, errOut)
	checkSchema(t, []byte(out))
	var r Report
	require.NoError(t, json.Unmarshal([]byte(out), &r), "poolstat -json printed what is not a report:\n%s", out)
	return &r
}

// eventually takes reports until cond holds for one, which it returns. Only a bug makes
// it wait long: the exporter sees a consumer's exit through its pidfd.
func eventually(t *testing.T, what string, cond func(*Report) bool) *Report {
	t.Helper()
	deadline := time.Now().Add(hangGuard)
	for {
		r := report(t, 0)
		if cond(r) {
			return r
		}
		require.False(t, time.Now().After(deadline), "poolstat never showed %s; last report: %+v", what, r.Exporters)
		time.Sleep(10 * time.Millisecond)
	}
}

// onGPU reports whether the children run on the real runtime (a GPU host), where the
// golden files, taken on the software device, do not apply.
func onGPU(t *testing.T) bool {
	picked, err := testRuntime()
	gpu := picked.OnGPU
	require.NoError(t, err)
	return gpu
}

// otherDevice is device 1 where the children's runtime has two devices or more, and
// device 0 on a host with one.
func otherDevice(t *testing.T) int {
	picked, err := testRuntime()
	require.NoError(t, err)
	if d, ok := picked.Runtime.(*cudarttest.Device); ok {
		defer d.Close()
	}
	n, err := picked.Runtime.DeviceCount()
	require.NoError(t, err, "counting the devices")
	if n < 2 {
		t.Logf("one device (%s): both consumers on device 0", picked.Runtime.Name())
		return 0
	}
	return 1
}

func peer(st *export.State, pid int) *export.PeerState {
	if i := slices.IndexFunc(st.Peers, func(p export.PeerState) bool { return p.PID == pid }); i >= 0 {
		return &st.Peers[i]
	}
	return nil
}

// TestLifecycle follows one exporter and two consumers through their lives, as an
// operator would watch them: nothing running, an exporter alone, two consumers holding
// leases (table and JSON checked against golden files), a free that waits on them, one
// consumer releasing, the other killed, the exporter killed and its dead entry cleaned.
func TestLifecycle(t *testing.T) {
	t.Run("the host's devices", func(t *testing.T) { lifecycle(t, true) })
	t.Run("one device", func(t *testing.T) {
		if onGPU(t) {
			t.Skip("the software device is given one device; the GPU host has its own count")
		}
		t.Setenv(softDevicesEnv, "1") // the children's too
		lifecycle(t, false)
	})
}

func lifecycle(t *testing.T, compareGolden bool) {
	dir := t.TempDir()
	t.Setenv(discover.DirEnv, dir) // the children announce here too
	sock := filepath.Join(dir, "test.sock")

	code, out, _ := poolstat(t)
	require.Equal(t, 0, code, out)
	require.True(t, strings.HasPrefix(out, "No cudapool exporter is announced in "+dir), "with nothing running poolstat said:\n%s", out)

	ex := proctest.Start(t, "exporter", sock)
	ex.Expect("ready")
	r := report(t, 0)
	require.Len(t, r.Exporters, 1, "with the exporter alone")
	e := r.Exporters[0]
	require.Equal(t, ex.PID(), e.PID)
	require.Equal(t, Live, e.Status, e.Error)
	require.Empty(t, e.State.Peers, "with the exporter alone")

	a := proctest.Start(t, "consumer", sock, "0", "alpha", "beta")
	a.Expect("holding")
	b := proctest.Start(t, "consumer", sock, strconv.Itoa(otherDevice(t)), "alpha")
	b.Expect("holding")

	r = report(t, 0)
	st := r.Exporters[0].State
	pa, pb := peer(st, a.PID()), peer(st, b.PID())
	require.NotNil(t, pa, "peers with both consumers holding: %+v", st.Peers)
	require.NotNil(t, pb, "peers with both consumers holding: %+v", st.Peers)
	require.Equal(t, 2, pa.Leases)
	require.Equal(t, 1, pb.Leases)
	require.Equal(t, uint64(7<<20), pa.BytesLeased)
	require.Equal(t, uint64(4<<20), pb.BytesLeased)
	assert.Equal(t, 3, st.Pools[0].ActiveLeases, "pool with both consumers holding: %+v", st.Pools[0])
	assert.Equal(t, 2, st.Pools[0].SharedBuffers, "pool with both consumers holding: %+v", st.Pools[0])
	// The children are this test binary: the report names their command.
	me, err := peercred.Lookup(os.Getpid())
	require.NoError(t, err)
	assert.Equal(t, me.Command, r.Exporters[0].Processes[a.PID()])
	if compareGolden && !onGPU(t) {
		golden(t, r, me.Command, map[int]int{ex.PID(): 100, a.PID(): 101, b.PID(): 102})
	}
	// -socket asks that one exporter, without the announce directory.
	r = report(t, 0, "-socket", sock)
	assert.Empty(t, r.Dir, "poolstat -socket")
	if assert.Len(t, r.Exporters, 1, "poolstat -socket") {
		assert.Equal(t, ex.PID(), r.Exporters[0].PID, "poolstat -socket")
	}

	// beta's free waits for a, which releases it; b is killed holding only alpha, which
	// stays published. (export's own tests cover a free waiting on a killed consumer.)
	ex.Send("free beta")
	ex.Expect("freed beta")
	p := report(t, 0).Exporters[0].State.Pools[0]
	assert.Equal(t, 1, p.DeferredFrees, "after freeing beta while a holds it: %+v", p)
	assert.Equal(t, 2, p.LiveBuffers, "after freeing beta while a holds it: %+v", p)

	a.Finish()
	r = eventually(t, "the released consumer gone", func(r *Report) bool { return peer(r.Exporters[0].State, a.PID()) == nil })
	p = r.Exporters[0].State.Pools[0]
	assert.Equal(t, 1, p.ActiveLeases, "after a released beta, b's lease is left: %+v", p)
	assert.Equal(t, 0, p.DeferredFrees, "after a released beta, its free is done: %+v", p)
	assert.Equal(t, 1, p.LiveBuffers, "after a released beta, its free is done: %+v", p)

	b.Kill()
	r = eventually(t, "the killed consumer gone", func(r *Report) bool { return peer(r.Exporters[0].State, b.PID()) == nil })
	p = r.Exporters[0].State.Pools[0]
	assert.Equal(t, 0, p.ActiveLeases, "after the killed consumer's lease ended: %+v", p)
	assert.Equal(t, 0, p.SharedBuffers, "after the killed consumer's lease ended: %+v", p)

	// A killed exporter leaves its announcement: -keep-dead lists it as dead, a
	// failure; poolstat removes it, shows it once as removed, and is content.
	ex.Kill()
	_ = ex.Wait() // test cleanup
	code, out, _ = poolstat(t, "-keep-dead")
	assert.Equal(t, 1, code, out)
	assert.Contains(t, out, "1 dead")
	code, out, _ = poolstat(t)
	assert.Equal(t, 0, code, "a killed exporter's announcement is no failure\n%s", out)
	assert.Contains(t, out, "1 removed")
	assert.Empty(t, report(t, 0).Exporters, "after poolstat removed the dead announcement")
}

// golden checks r against testdata/lifecycle.{txt,json} with its volatile fields (pids,
// times, paths, ids, the test binary's name) replaced by fixed ones: pids maps real pids
// to fixed ones.
func golden(t *testing.T, r *Report, self string, pids map[int]int) {
	t.Helper()
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	r.Time, r.Dir = t0.Add(time.Hour), "/run/user/1000/cudapool"
	for i := range r.Exporters {
		e := &r.Exporters[i]
		e.PID, e.Socket = pids[e.PID], "/run/user/1000/cudapool/test.sock"
		st := e.State
		st.PID, st.Socket, st.Started = pids[st.PID], e.Socket, t0
		for j := range st.Peers {
			p := &st.Peers[j]
			p.PID, p.UID, p.GID, p.ConnectedSince = pids[p.PID], 0, 0, t0.Add(time.Minute)
		}
		slices.SortFunc(st.Peers, func(a, b export.PeerState) int { return a.PID - b.PID })
		commands := map[int]string{}
		for pid, c := range e.Processes {
			if c == self {
				c = "poolstat.test"
			}
			commands[pids[pid]] = c
		}
		e.Processes = commands
	}
	var table bytes.Buffer
	render(&table, r, r.Time)
	js, err := json.MarshalIndent(r, "", "  ")
	require.NoError(t, err)
	compare(t, "testdata/lifecycle.txt", table.Bytes())
	compare(t, "testdata/lifecycle.json", append(js, '\n'))
	checkSchema(t, js)
}

func compare(t *testing.T, path string, got []byte) {
	t.Helper()
	if *update {
		require.NoError(t, os.WriteFile(path, got, 0o644))
		return
	}
	want, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, string(want), string(got), "%s differs (go test -update rewrites it)", path)
}

// testExporter starts an exporter in this process on the software device, announced
// in dir, with its socket there.
func testExporter(t *testing.T, dir string, opts ...producer.ListenOption) *producer.Exporter {
	t.Helper()
	picked, err := choose.Runtime(choose.Software)
	rt := picked.Runtime
	require.NoError(t, err)
	ex, err := producer.Listen(filepath.Join(dir, "x.sock"), rt, append([]producer.ListenOption{producer.WithAnnounceDir(dir)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = ex.Close(context.Background()) }) // test cleanup
	return ex
}

// shortDir is a fresh directory with a path short enough for a Unix socket (108 bytes),
// which t.TempDir() under a long test name does not promise.
func shortDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "cps")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) }) // test cleanup
	return dir
}

// TestRefused shows what an operator sees when an exporter's policy does not admit them,
// e.g. another user's exporter in a shared $CUDAPOOL_DIR.
func TestRefused(t *testing.T) {
	dir := shortDir(t)
	testExporter(t, dir, producer.WithPolicy(export.Policy{AllowUIDs: []uint32{uint32(os.Getuid()) + 1}}))
	code, out, _ := poolstat(t, "-dir", dir)
	assert.Equal(t, 1, code, out)
	assert.Contains(t, out, "1 unreachable")
	assert.Contains(t, out, "refused by exporter")
}

// -socket to a path that is wrong says what is wrong with it.
func TestSocketDiagnosis(t *testing.T) {
	dir := shortDir(t)
	file := filepath.Join(dir, "file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	fifo := filepath.Join(dir, "fifo")
	require.NoError(t, syscall.Mkfifo(fifo, 0o600))
	// A socket whose listener is gone: what a killed exporter leaves.
	stale := filepath.Join(dir, "stale.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: stale, Net: "unix"})
	require.NoError(t, err)
	ln.SetUnlinkOnClose(false)
	require.NoError(t, ln.Close())

	for path, want := range map[string]string{
		filepath.Join(dir, "none.sock"): "does not exist: no exporter listens there",
		file:                            "is a regular file, not a Unix socket",
		dir:                             "is a directory, not a Unix socket",
		fifo:                            "is a named pipe, not a Unix socket",
		stale:                           "",
	} {
		code, out, _ := poolstat(t, "-socket", path)
		assert.Equal(t, 1, code, "poolstat -socket %s\n%s", path, out)
		assert.Contains(t, out, "Exporter at "+path+": unreachable")
		if want == "" {
			want = "nobody listens on " + stale + ": the exporter that made it is gone"
		} else {
			want = path + " " + want
		}
		assert.Contains(t, out, want, "poolstat -socket %s", path)
	}
}

func TestExplainPermission(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("giving a socket to another user needs root")
	}
	dir := shortDir(t)
	sock := filepath.Join(dir, "s.sock")
	ln, err := net.Listen("unix", sock)
	require.NoError(t, err)
	defer func() { _ = ln.Close() }() // test cleanup
	require.NoError(t, os.Chown(sock, 4242, 4242))
	got := explain(&os.SyscallError{Syscall: "connect", Err: syscall.EACCES}, sock)
	assert.Contains(t, got, "permission denied on "+sock+": it belongs to uid 4242, another user's exporter")
}

// TestWatch stops a -watch after three reports: each is one line of JSON.
func TestWatch(t *testing.T) {
	for _, every := range []string{"1ms", "0.001"} {
		ctx, cancel := context.WithCancel(context.Background())
		w := &lineCounter{after: 3, cancel: cancel}
		code := run(ctx, []string{"-json", "-watch", every, "-dir", t.TempDir()}, w, io.Discard)
		cancel()
		assert.Equal(t, 0, code, "poolstat -watch %s exited after Ctrl-C", every)
		lines := strings.Split(strings.TrimSpace(w.buf.String()), "\n")
		require.GreaterOrEqual(t, len(lines), 3, "poolstat -watch %s printed too few reports before it was stopped", every)
		for _, l := range lines {
			checkSchema(t, []byte(l))
			var r Report
			if assert.NoError(t, json.Unmarshal([]byte(l), &r), "line %q", l) {
				assert.Equal(t, ReportSchema, r.Schema, "line %q", l)
			}
		}
	}
}

func TestInterval(t *testing.T) {
	for in, want := range map[string]time.Duration{"2": 2 * time.Second, "0.5": 500 * time.Millisecond, "2s": 2 * time.Second,
		"1m30s": 90 * time.Second, "0": 0} {
		var i interval
		if assert.NoError(t, i.Set(in), "-watch %s", in) {
			assert.Equal(t, want, time.Duration(i), "-watch %s", in)
		}
	}
	for _, in := range []string{"", "two", "2x", "NaN", "1e300", "Inf"} {
		var i interval
		assert.Error(t, i.Set(in), "-watch %q", in)
	}
}

// lineCounter cancels after it has taken after lines.
type lineCounter struct {
	buf    bytes.Buffer
	after  int
	cancel context.CancelFunc
}

func (w *lineCounter) Write(p []byte) (int, error) {
	w.buf.Write(p)
	if bytes.Count(w.buf.Bytes(), []byte("\n")) >= w.after {
		w.cancel()
	}
	return len(p), nil
}

func TestUsage(t *testing.T) {
	for _, args := range [][]string{{"extra"}, {"-keep-dead", "-socket", "x"}, {"-watch", "-1s"}, {"-watch", "-1"},
		{"-watch", "soon"}, {"-timeout", "0s"}, {"-nope"}, {"-serve", ":0", "-json"}, {"-serve", ":0", "-watch", "1"},
		{"-clean"}, {"-kv", "x", "-keep-dead"}} {
		code, out, errOut := poolstat(t, args...)
		assert.Equal(t, 2, code, "poolstat %q", args)
		assert.Empty(t, out, "poolstat %q printed on stdout", args)
		assert.NotEmpty(t, errOut, "poolstat %q said nothing on stderr", args)
	}
}

func TestHelp(t *testing.T) {
	for _, arg := range []string{"-h", "-help", "--help"} {
		code, out, errOut := poolstat(t, arg)
		assert.Equal(t, 0, code, "poolstat %s", arg)
		assert.Contains(t, out, "usage: poolstat", "poolstat %s", arg)
		assert.Contains(t, out, "-watch INTERVAL", "poolstat %s", arg)
		assert.Empty(t, errOut, "poolstat %s", arg)
	}
}

func TestVersion(t *testing.T) {
	code, out, _ := poolstat(t, "-version")
	assert.Equal(t, 0, code)
	assert.Regexp(t, `^poolstat \S+.*; protocol `+strconv.Itoa(export.ProtocolVersion)+`, report schema 1, state schema 1; go\S+\n$`, out)
}

// A -dir named on the command line must exist; the default one appears with the first
// exporter, so its absence means that none runs.
func TestDirMissing(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "nowhere")
	code, out, errOut := poolstat(t, "-dir", missing)
	assert.Equal(t, 2, code, out)
	assert.Contains(t, errOut, missing+" does not exist")

	file := filepath.Join(t.TempDir(), "file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	code, _, errOut = poolstat(t, "-dir", file)
	assert.Equal(t, 2, code)
	assert.Contains(t, errOut, file+" is not a directory")

	t.Setenv(discover.DirEnv, missing)
	code, out, _ = poolstat(t)
	assert.Equal(t, 0, code, out)
	assert.Contains(t, out, "No cudapool exporter is announced in "+missing)
}

// TestTableWidth renders the widest report the table can meet: every size at its widest,
// names past their cut. No line but the socket path may pass Width.
func TestTableWidth(t *testing.T) {
	const widest = 1023 << 20 // "1023 MiB"
	long := strings.Repeat("n", 80)
	now := time.Now()
	st := &export.State{Name: long, PID: 4194304, Started: now.Add(-1000 * time.Hour),
		Devices: []export.DeviceState{{Ordinal: 7, UUID: "GPU-x"}}}
	for i := range 3 {
		st.Pools = append(st.Pools, export.PoolState{ID: uint64(i), Stats: pool.Stats{Name: long, Device: 15, HandleType: cudart.HandleTypePosixFD,
			MaxSize: widest, ReservedCurrent: widest, ReservedHigh: widest, UsedCurrent: widest, UsedHigh: widest,
			BytesReserved: widest, LiveBuffers: 99999, SharedBuffers: 99999, ActiveLeases: 99999, DeferredFrees: 99999,
			FailedFrees: 99999}})
		st.Published = append(st.Published, export.NameState{Name: long, Pool: uint64(i), Size: widest},
			export.NameState{Name: long, Route: export.RouteVMM, Size: widest, Chunks: export.MaxChunks})
		st.Peers = append(st.Peers, export.PeerState{PID: 4194304 - i, UID: 4000000000, Device: "GPU-" + long, Leases: 99999,
			BytesLeased: widest, ConnectedSince: now.Add(-999 * time.Hour), AwaitingExit: true})
	}
	r := &Report{Dir: "/run/user/1000/cudapool", Exporters: []Exporter{
		{Socket: "/s", Status: Live, State: st, Processes: map[int]string{4194304: long, 4194303: strings.Repeat("c", 15)}},
		{PID: 4194304, Name: long, Socket: "/s", Status: Dead, Error: "process 4194304 is gone"}}}
	var b bytes.Buffer
	render(&b, r, now)
	for _, line := range strings.Split(b.String(), "\n") {
		if !strings.HasPrefix(line, "  socket ") {
			assert.LessOrEqual(t, len([]rune(line)), Width, "%q", line)
		}
	}
}

// poolstat leaves an announcement it cannot read, as it cannot tell whether it is
// stale, and names the file for the operator to look at.
func TestPruneLeavesUnreadableAnnouncement(t *testing.T) {
	dir := t.TempDir()
	junk := filepath.Join(dir, "123.json")
	require.NoError(t, os.WriteFile(junk, []byte("{"), 0o600))
	r := report(t, 1, "-dir", dir)
	require.Len(t, r.Exporters, 1)
	assert.Equal(t, Dead, r.Exporters[0].Status)
	assert.Contains(t, r.Exporters[0].Error, "remove "+junk+" by hand")
	assert.FileExists(t, junk, "poolstat removed an unreadable announcement")
}

// announce writes an announcement for pid, its socket at socket, as an exporter would.
func announce(t *testing.T, dir string, pid int, socket string, started time.Time) string {
	t.Helper()
	body, err := json.Marshal(discover.Announcement{PID: pid, Socket: socket, Name: "planted", Started: started})
	require.NoError(t, err)
	path := filepath.Join(dir, strconv.Itoa(pid)+".json")
	require.NoError(t, os.WriteFile(path, body, 0o600))
	return path
}

// poolstat removes an announcement only when its exporter is dead beyond doubt: a live
// process whose socket does not answer (or cannot be dialled, as a path past the
// kernel's 108 bytes cannot) keeps it, and counts as a failure.
func TestPruneSparesLiveProcesses(t *testing.T) {
	dir := shortDir(t)
	me, err := peercred.Lookup(os.Getpid())
	require.NoError(t, err)
	for name, socket := range map[string]string{
		"socket not there":  filepath.Join(dir, "gone.sock"),
		"socket too long":   filepath.Join(dir, strings.Repeat("x", 120)+".sock"),
		"socket is no sock": dir,
	} {
		path := announce(t, dir, os.Getpid(), socket, me.Started.Add(time.Second))
		r := report(t, 1, "-dir", dir)
		if assert.Len(t, r.Exporters, 1, name) {
			assert.Equal(t, Dead, r.Exporters[0].Status, "%s: %s", name, r.Exporters[0].Error)
			assert.Contains(t, r.Exporters[0].Error, "not removed", name)
		}
		assert.FileExists(t, path, "%s: poolstat removed a live process's announcement", name)
		require.NoError(t, os.Remove(path))
	}

	// The same pid, taken by a process that started after the announcement was
	// written: the announced exporter is dead.
	path := announce(t, dir, os.Getpid(), filepath.Join(dir, "gone.sock"), me.Started.Add(-time.Hour))
	r := report(t, 1, "-dir", dir, "-keep-dead")
	if assert.Len(t, r.Exporters, 1) {
		assert.Equal(t, Dead, r.Exporters[0].Status, r.Exporters[0].Error)
	}
	assert.FileExists(t, path, "-keep-dead removed an announcement")
	r = report(t, 0, "-dir", dir)
	if assert.Len(t, r.Exporters, 1) {
		assert.Equal(t, Removed, r.Exporters[0].Status, r.Exporters[0].Error)
	}
	assert.NoFileExists(t, path)
}

// poolstat reads announcements only from a directory private to this user: one that
// others can write to (or another user made first) is refused, and nothing in it is
// shown or cleaned.
func TestDirNotPrivate(t *testing.T) {
	dir := shortDir(t)
	path := announce(t, dir, 1<<22+1, filepath.Join(dir, "planted.sock"), time.Now())
	require.NoError(t, os.Chmod(dir, 0o777))
	for _, args := range [][]string{{"-dir", dir}, {"-dir", dir, "-keep-dead"}} {
		code, out, errOut := poolstat(t, args...)
		assert.Equal(t, 1, code, "poolstat %q\n%s", args, out)
		assert.Empty(t, out, "poolstat %q showed a directory it does not trust", args)
		assert.Contains(t, errOut, "announce directory is not private: "+dir+" has mode")
	}
	assert.FileExists(t, path, "poolstat removed a file from a directory it does not trust")
}

// Every string another process sends (its names, published names, errors, device
// UUIDs, command names, the socket it announced) reaches the terminal escaped and cut:
// no control character, escape sequence or invalid UTF-8, no line longer than the
// table's width plus what a cut socket path adds; a negative count says it is invalid.
func TestTableEscapesWhatOthersSend(t *testing.T) {
	hostile := []string{
		"forged\nLIVE: root (pid 1)", "\x1b[2J\x1b[31mred", "\x1b]0;title\x07", "\x1b]8;;http://x\x1b\\link",
		"bad\xff\xfeutf8", "\u202eevil", "tab\there", "\x9b31m", "\u009b32m", "del\x7f", strings.Repeat("\x1b[A", 70000),
	}
	now := time.Now()
	var exporters []Exporter
	for i, s := range hostile {
		st := &export.State{Name: s, PID: 100 + i, Socket: s, Started: now, Devices: []export.DeviceState{{Ordinal: -3, UUID: s}}}
		st.Pools = []export.PoolState{{ID: 1, Error: s, Stats: pool.Stats{Name: s, Device: -1, LiveBuffers: -2,
			SharedBuffers: -3, ActiveLeases: -4, DeferredFrees: -5, FailedFrees: -6}}}
		st.Published = []export.NameState{{Name: s, Pool: 1, Size: 1}}
		st.Peers = []export.PeerState{{PID: 200 + i, Device: s, Leases: -7, ConnectedSince: now, AwaitingExit: true}}
		exporters = append(exporters,
			Exporter{Socket: s, Status: Live, State: st, Processes: map[int]string{200 + i: s}},
			Exporter{PID: 300 + i, Name: s, Socket: s, Status: Dead, Error: s})
	}
	var b bytes.Buffer
	render(&b, &Report{Dir: "/run/user/1000/cudapool", Exporters: exporters}, now)
	out := b.String()
	require.True(t, utf8.ValidString(out), "the table is not valid UTF-8")
	for _, line := range strings.Split(out, "\n") {
		for _, r := range line {
			require.True(t, unicode.IsPrint(r), "the table printed %U in %q", r, line)
		}
		assert.LessOrEqual(t, len([]rune(line)), Width+maxText, "%q", line)
		assert.False(t, strings.HasPrefix(line, "LIVE: root"), "a forged line: %q", line)
	}
	for _, want := range []string{`forged\nLIVE`, `\x1b[2J`, `\x1b]0;title\x07`, `bad\xff\xfeutf8`, `\u202eevil`, `tab\there`,
		`\x9b31m`, `\u009b32m`, `del\x7f`, "invalid (-2)", "invalid (-7)", "…"} {
		assert.Contains(t, out, want, "the table does not show %q", want)
	}
	assert.NotContains(t, out, "-2 buffers", "a negative count shown as a count")
}
