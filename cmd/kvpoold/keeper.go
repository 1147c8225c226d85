package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/cudapool/cudapool/kv/owner"
)

// The keeper is kvpoold's other process: `kvpoold keeper` holds what must outlive
// kvpoold (owner.Keep, owner.KeepFiles), in a session of its own, so that kvpoold's
// death (SIGKILL, a crash, an upgrade) leaves that memory and every replica's mapping
// of it alone, and the next kvpoold on the directory adopts it. It holds file
// descriptors by name on dir/keep.sock (the slabs' chunks and the host tiers' memfds,
// given by kvpoold) and nothing else: it loads no CUDA runtime at all (an fd keeps its
// memory alive by itself). kvpoold starts it where none is alive and, on a clean stop,
// stops it (unless -leave-keeper). It stops on SIGTERM or SIGINT, or once nobody at all
// has been connected to it for -keeper-idle: no kvpoold, and no replica (a replica
// holds a connection to dir/keep.sock while it maps the slab, and stops once the
// keeper hangs up), so that a kvpoold dead for longer leaves the replicas' cache to
// the next one.

// keeperStopMargin is how much longer than -stop-wait kvpoold waits for the keeper it
// stops: the keeper's own close waits -stop-wait for the replicas to unmap its slabs.
const keeperStopMargin = 5 * time.Second

// keeperCommand makes the command that runs `kvpoold keeper ARGS`: this executable.
// The tests replace it.
var keeperCommand = func(args []string) (*exec.Cmd, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return exec.Command(exe, args...), nil
}

// keeperArgs is the keeper's command line: it holds descriptors of any slab, and
// needs no slab flag.
func keeperArgs(f flags) []string {
	return []string{"keeper", "-dir", f.dir, "-keeper-idle", f.keeperIdle.String(), "-stop-wait", f.stopWait.String()}
}

// keeperChild is the keeper this kvpoold started: its exit status is known here once
// it has exited.
type keeperChild struct {
	pid    int
	exited chan struct{}
	err    error // cmd.Wait's, once exited is closed
}

// status is the keeper's exit status once it has exited (-1 for a signal).
func (k *keeperChild) status() int {
	var ee *exec.ExitError
	if errors.As(k.err, &ee) {
		return ee.ExitCode()
	}
	if k.err != nil {
		return -1
	}
	return 0
}

// startKeeper starts the keeper in a session of its own and waits, until ctx ends, for
// it to say it keeps the slabs (a line on its fd 3); started is the last it started.
func startKeeper(stderr io.Writer, args []string, started **keeperChild) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		cmd, err := keeperCommand(args)
		if err != nil {
			return err
		}
		rd, wr, err := os.Pipe()
		if err != nil {
			return err
		}
		defer func() { _ = rd.Close() }() // cleanup: the line was read, or will not be
		cmd.ExtraFiles = []*os.File{wr}
		cmd.Stderr = stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		err = cmd.Start()
		_ = wr.Close() // the keeper holds its end; this one must not keep the pipe open
		if err != nil {
			return err
		}
		kc := &keeperChild{pid: cmd.Process.Pid, exited: make(chan struct{})}
		*started = kc
		go func() { // reaps it if it ends before this process
			kc.err = cmd.Wait()
			close(kc.exited)
		}()
		line := make(chan string, 1)
		go func() {
			s, _ := bufio.NewReader(rd).ReadString('\n') // an early end is told by the exit below
			line <- strings.TrimSpace(s)
		}()
		select {
		case l := <-line:
			if l == "ready" {
				return nil
			}
			<-kc.exited
			return fmt.Errorf("the keeper (pid %d) exited before keeping the slabs: %v", cmd.Process.Pid, kc.err)
		case <-ctx.Done():
			_ = cmd.Process.Kill() // cleanup: the wait's end is the error returned
			return fmt.Errorf("the keeper (pid %d) did not start: %w", cmd.Process.Pid, ctx.Err())
		}
	}
}

// keeping is what the keeper's idle wait asks of an owner.Keeper.
type keeping interface {
	Clients() int
}

// idleFor waits until ctx ends or, true, nobody has been connected to k for idle: no
// kvpoold and no replica that maps the slab. A keeper whose kvpoold died for good,
// its replicas gone too, frees what it holds. It looks once a second (a tenth of idle
// if shorter).
func idleFor(ctx context.Context, k keeping, idle time.Duration) bool {
	tick := time.NewTicker(min(time.Second, max(idle/10, time.Millisecond)))
	defer tick.Stop()
	var since time.Time
	for {
		select {
		case <-ctx.Done():
			return false
		case now := <-tick.C:
			switch {
			case k.Clients() > 0:
				since = time.Time{}
			case since.IsZero():
				since = now
			case now.Sub(since) >= idle:
				return true
			}
		}
	}
}

// runKeeper is `kvpoold keeper`: the descriptors kvpoold gives it (the slabs' chunks,
// the host tiers' memfds), until ctx ends. It loads no CUDA runtime at all: the slab
// flags, where given, have no effect.
func runKeeper(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	f, code, ok := parse(args, stdout, stderr)
	if !ok {
		return code
	}
	k, err := owner.KeepFiles(f.dir, owner.WithLogger(slog.New(slog.NewTextHandler(stderr, nil))))
	if err != nil {
		fmt.Fprintf(stderr, "kvpoold keeper: %v\n", err)
		return exitFailed
	}
	if ready := os.NewFile(3, "ready"); ready != nil {
		_, _ = ready.WriteString("ready\n") // kvpoold reads it; without it (run by hand) nobody does
		_ = ready.Close()                   // cleanup: it was written
	}
	if idleFor(ctx, k, f.keeperIdle) {
		fmt.Fprintf(stderr, "kvpoold keeper: no kvpoold and no replica has been connected to %s for %v: what it kept is freed\n", f.dir, f.keeperIdle)
	}
	cctx, cancel := context.WithTimeout(context.Background(), f.stopWait)
	defer cancel()
	if err := k.Close(cctx); err != nil {
		fmt.Fprintf(stderr, "kvpoold keeper: stopping: %v\n", err)
		return exitFailed
	}
	return exitOK
}
