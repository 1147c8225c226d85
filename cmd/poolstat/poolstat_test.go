package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/rtselect"
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

// report runs poolstat -json and decodes its report; it fails unless the exit status is
// wantCode.
func report(t *testing.T, wantCode int, args ...string) *Report {
	t.Helper()
	code, out, errOut := poolstat(t, append([]string{"-json"}, args...)...)
	if code != wantCode {
		t.Fatalf("poolstat %q exited %d, want %d\n%s%s", args, code, wantCode, out, errOut)
	}
	var r Report
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("poolstat -json printed what is not a report: %v\n%s", err, out)
	}
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
		if time.Now().After(deadline) {
			t.Fatalf("poolstat never showed %s; last report: %+v", what, r.Exporters)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// onGPU reports whether the children run on the real runtime (a GPU host), where the
// golden files, taken on the software device, do not apply.
func onGPU(t *testing.T) bool {
	_, gpu, _, err := rtselect.Open(rtselect.Auto)
	if err != nil {
		t.Fatal(err)
	}
	return gpu
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
	dir := t.TempDir()
	t.Setenv(export.DirEnv, dir) // the children announce here too
	sock := filepath.Join(dir, "test.sock")

	code, out, _ := poolstat(t)
	if code != 0 || !strings.HasPrefix(out, "No cudapool exporter is announced in "+dir) {
		t.Fatalf("with nothing running poolstat exited %d and said:\n%s", code, out)
	}

	ex := proctest.Start(t, "exporter", sock)
	ex.Expect("ready")
	r := report(t, 0)
	if len(r.Exporters) != 1 || r.Exporters[0].PID != ex.PID() || r.Exporters[0].Status != Live || len(r.Exporters[0].State.Peers) != 0 {
		t.Fatalf("with the exporter alone: %+v", r.Exporters)
	}

	a := proctest.Start(t, "consumer", sock, "0", "alpha", "beta")
	a.Expect("holding")
	b := proctest.Start(t, "consumer", sock, "1", "alpha")
	b.Expect("holding")

	r = report(t, 0)
	st := r.Exporters[0].State
	pa, pb := peer(st, a.PID()), peer(st, b.PID())
	if pa == nil || pb == nil || pa.Leases != 2 || pb.Leases != 1 || pa.BytesLeased != 7<<20 || pb.BytesLeased != 4<<20 {
		t.Fatalf("peers with both consumers holding: %+v", st.Peers)
	}
	if st.Pools[0].ActiveLeases != 3 || st.Pools[0].BuffersShared != 2 {
		t.Errorf("pool with both consumers holding: %+v", st.Pools[0])
	}
	if !onGPU(t) {
		golden(t, r, map[int]int{ex.PID(): 100, a.PID(): 101, b.PID(): 102})
	}
	// -socket asks that one exporter, without the announce directory.
	if r := report(t, 0, "-socket", sock); r.Dir != "" || len(r.Exporters) != 1 || r.Exporters[0].PID != ex.PID() {
		t.Errorf("poolstat -socket: %+v", r)
	}

	// beta's free waits for a, which releases it; b is killed holding only alpha, which
	// stays published. (export's own tests cover a free waiting on a killed consumer.)
	ex.Send("free beta")
	ex.Expect("freed beta")
	st = report(t, 0).Exporters[0].State
	if p := st.Pools[0]; p.DeferredFrees != 1 || p.BuffersLive != 2 {
		t.Errorf("after freeing beta while a holds it, the pool shows %+v, want 1 free waiting", p)
	}

	a.Finish()
	r = eventually(t, "the released consumer gone", func(r *Report) bool { return peer(r.Exporters[0].State, a.PID()) == nil })
	if p := r.Exporters[0].State.Pools[0]; p.ActiveLeases != 1 || p.DeferredFrees != 0 || p.BuffersLive != 1 {
		t.Errorf("after a released beta the pool shows %+v, want beta's free done and b's lease left", p)
	}

	b.Kill()
	r = eventually(t, "the killed consumer gone", func(r *Report) bool { return peer(r.Exporters[0].State, b.PID()) == nil })
	if p := r.Exporters[0].State.Pools[0]; p.ActiveLeases != 0 || p.BuffersShared != 0 {
		t.Errorf("after the killed consumer's lease ended the pool shows %+v, want no lease", p)
	}

	ex.Kill()
	ex.Wait()
	code, out, _ = poolstat(t)
	if code != 1 || !strings.Contains(out, "1 dead") || !strings.Contains(out, "poolstat -clean") {
		t.Errorf("with the exporter killed poolstat exited %d and said:\n%s", code, out)
	}
	if r := report(t, 0, "-clean"); len(r.Exporters) != 1 || r.Exporters[0].Status != Removed {
		t.Errorf("poolstat -clean: %+v", r.Exporters)
	}
	if r := report(t, 0); len(r.Exporters) != 0 {
		t.Errorf("after -clean: %+v", r.Exporters)
	}
}

// golden checks r against testdata/lifecycle.{txt,json} with its volatile fields (pids,
// times, paths, ids) replaced by fixed ones: pids maps real pids to fixed ones.
func golden(t *testing.T, r *Report, pids map[int]int) {
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
	}
	var table bytes.Buffer
	render(&table, r, r.Time)
	js, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	compare(t, "testdata/lifecycle.txt", table.Bytes())
	compare(t, "testdata/lifecycle.json", append(js, '\n'))
}

func compare(t *testing.T, path string, got []byte) {
	t.Helper()
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs (go test -update rewrites it):\n--- got\n%s--- want\n%s", path, got, want)
	}
}

// TestRefused shows what an operator sees when an exporter's policy does not admit them,
// e.g. another user's exporter in a shared $CUDAPOOL_DIR.
func TestRefused(t *testing.T) {
	dir := t.TempDir()
	rt, _, _, err := rtselect.Open(rtselect.Test)
	if err != nil {
		t.Fatal(err)
	}
	ex, err := export.Listen(filepath.Join(dir, "other.sock"), rt, export.WithAnnounce(dir),
		export.WithPolicy(export.Policy{AllowUIDs: []uint32{uint32(os.Getuid()) + 1}}))
	if err != nil {
		t.Fatal(err)
	}
	defer ex.Close(context.Background())
	code, out, _ := poolstat(t, "-dir", dir)
	if code != 1 || !strings.Contains(out, "1 unreachable") || !strings.Contains(out, "refused by exporter") {
		t.Errorf("poolstat against an exporter that refuses it exited %d and said:\n%s", code, out)
	}
}

func TestSocketNotThere(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "none.sock")
	code, out, _ := poolstat(t, "-socket", sock)
	if code != 1 || !strings.Contains(out, "Exporter at "+sock+": unreachable") || !strings.Contains(out, "no such file") {
		t.Errorf("poolstat -socket to nothing exited %d and said:\n%s", code, out)
	}
}

func TestExplainPermission(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("giving a socket file to another user needs root")
	}
	sock := filepath.Join(t.TempDir(), "s.sock")
	if err := os.WriteFile(sock, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(sock, 4242, 4242); err != nil {
		t.Fatal(err)
	}
	got := explain(&os.SyscallError{Syscall: "connect", Err: syscall.EACCES}, sock)
	if !strings.Contains(got, "uid 4242, another user's exporter") {
		t.Errorf("explain(EACCES) = %q, want the socket's owner named", got)
	}
}

// TestWatch stops a -watch after three reports: each is one line of JSON.
func TestWatch(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := &lineCounter{after: 3, cancel: cancel}
	code := run(ctx, []string{"-json", "-watch", "1ms", "-dir", t.TempDir()}, w, io.Discard)
	if code != 0 {
		t.Errorf("poolstat -watch exited %d after Ctrl-C, want 0", code)
	}
	lines := strings.Split(strings.TrimSpace(w.buf.String()), "\n")
	if len(lines) < 3 {
		t.Fatalf("poolstat -watch printed %d reports before it was stopped, want 3", len(lines))
	}
	for _, l := range lines {
		var r Report
		if err := json.Unmarshal([]byte(l), &r); err != nil || r.Schema != ReportSchema {
			t.Errorf("line %q: %v", l, err)
		}
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
	for _, args := range [][]string{{"extra"}, {"-clean", "-socket", "x"}, {"-watch", "-1s"}, {"-timeout", "0s"}, {"-nope"}} {
		if code, _, _ := poolstat(t, args...); code != 2 {
			t.Errorf("poolstat %q exited %d, want 2", args, code)
		}
	}
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
		st.Pools = append(st.Pools, export.PoolState{ID: uint64(i), Name: long, Device: 15, HandleType: "posix-fd",
			MaxSize: widest, ReservedCurrent: widest, ReservedHigh: widest, UsedCurrent: widest, UsedHigh: widest,
			RoundingOverhead: widest, BuffersLive: 99999, BuffersShared: 99999, ActiveLeases: 99999, DeferredFrees: 99999,
			FailedFrees: 99999})
		st.Published = append(st.Published, export.NameState{Name: long, Pool: uint64(i), Size: widest})
		st.Peers = append(st.Peers, export.PeerState{PID: 4194304, UID: 4000000000, Device: "GPU-" + long, Leases: 99999,
			BytesLeased: widest, ConnectedSince: now.Add(-999 * time.Hour)})
	}
	r := &Report{Dir: "/run/user/1000/cudapool", Exporters: []Exporter{{Socket: "/s", Status: Live, State: st},
		{PID: 4194304, Name: long, Socket: "/s", Status: Dead, Error: "process 4194304 is gone"}}}
	var b bytes.Buffer
	render(&b, r, now)
	for _, line := range strings.Split(b.String(), "\n") {
		if n := len([]rune(line)); n > Width && !strings.HasPrefix(line, "  socket ") {
			t.Errorf("%d columns: %q", n, line)
		}
	}
}

// -clean leaves an announcement it cannot read, as it cannot tell whether it is stale,
// and names the file for the operator to look at.
func TestCleanLeavesUnreadableAnnouncement(t *testing.T) {
	dir := t.TempDir()
	junk := filepath.Join(dir, "123.json")
	if err := os.WriteFile(junk, []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	r := report(t, 1, "-dir", dir, "-clean")
	if len(r.Exporters) != 1 || r.Exporters[0].Status != Dead || !strings.Contains(r.Exporters[0].Error, "remove "+junk+" by hand") {
		t.Fatalf("poolstat -clean with an unreadable announcement: %+v", r.Exporters)
	}
	if _, err := os.Stat(junk); err != nil {
		t.Fatalf("-clean removed an unreadable announcement: %v", err)
	}
}
