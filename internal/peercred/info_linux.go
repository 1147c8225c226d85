package peercred

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"time"
)

// userHZ is the unit of the start times in /proc: fixed at 100 per second on every
// architecture Linux exposes to user space through /proc/<pid>/stat.
const userHZ = 100

// Lookup returns what /proc shows of process pid. It fails with ErrGone when no
// process has that pid, with the reason when /proc cannot be read. The pid is this
// process's view: a pid from another pid namespace names another process or none.
func Lookup(pid int) (Info, error) {
	if pid <= 0 {
		return Info{}, fmt.Errorf("peercred: pid %d names no process this one can see", pid)
	}
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if errors.Is(err, fs.ErrNotExist) {
		return Info{}, fmt.Errorf("%w: pid %d", ErrGone, pid)
	}
	if err != nil {
		return Info{}, fmt.Errorf("peercred: %w", err)
	}
	command, ticks, err := parseStat(stat)
	if err != nil {
		return Info{}, fmt.Errorf("peercred: /proc/%d/stat: %w", pid, err)
	}
	boot, err := bootTime()
	if err != nil {
		return Info{}, err
	}
	return Info{Command: command, Started: boot.Add(time.Duration(ticks) * time.Second / userHZ)}, nil
}

// parseStat takes the command name and the start time (in ticks after boot) from the
// contents of /proc/<pid>/stat: "pid (comm) state ppid ... starttime ...", starttime
// being field 22. The name may hold spaces and parentheses, so it ends at the last ')'.
func parseStat(stat []byte) (command string, ticks uint64, err error) {
	open, end := bytes.IndexByte(stat, '('), bytes.LastIndexByte(stat, ')')
	if open < 0 || end < open {
		return "", 0, errors.New("no command name in parentheses")
	}
	fields := bytes.Fields(stat[end+1:]) // field 3 (state) onwards
	const startField = 22 - 3
	if len(fields) <= startField {
		return "", 0, fmt.Errorf("%d fields after the command name, want more than %d", len(fields), startField)
	}
	ticks, err = strconv.ParseUint(string(fields[startField]), 10, 64)
	if err != nil {
		return "", 0, fmt.Errorf("start time: %w", err)
	}
	return string(stat[open+1 : end]), ticks, nil
}

// bootTime is when the host booted, from the btime line of /proc/stat.
func bootTime() (time.Time, error) {
	stat, err := os.ReadFile("/proc/stat")
	if err != nil {
		return time.Time{}, fmt.Errorf("peercred: %w", err)
	}
	for line := range bytes.Lines(stat) {
		if v, ok := bytes.CutPrefix(line, []byte("btime ")); ok {
			sec, err := strconv.ParseInt(string(bytes.TrimSpace(v)), 10, 64)
			if err != nil {
				return time.Time{}, fmt.Errorf("peercred: /proc/stat btime: %w", err)
			}
			return time.Unix(sec, 0), nil
		}
	}
	return time.Time{}, errors.New("peercred: /proc/stat has no btime line")
}
