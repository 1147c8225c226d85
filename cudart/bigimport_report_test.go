package cudart_test

import (
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/proctest"
)

func init() {
	childRoles["exit-as"] = exitAsMain
}

// exitAsMain ends the way args[0] says: "ok", "fail" (status 1), "fault" (status 2, as
// the Go runtime exits when a SIGSEGV arrives during a cgo call) or "killed" (SIGKILL,
// a signal as a crash in the driver that nothing catches gives).
func exitAsMain(args []string) int {
	switch args[0] {
	case "fail":
		return 1
	case "fault":
		return 2
	case "killed":
		unix.Kill(os.Getpid(), unix.SIGKILL)
		select {}
	}
	return 0
}

// exitOfChild is cmd.Wait's error for a child that ends as how.
func exitOfChild(t *testing.T, how string) error {
	cmd := proctest.Command(t, "exit-as", how)
	require.NoError(t, cmd.Start())
	return cmd.Wait()
}

// TestBigImportReport checks how TestGPUBigImport reads an importer's lines and exit,
// on real exits of child processes: a crash is a finding with its signal and stage,
// a wrong read stays wrong, and a child that reported nothing is unmeasured.
func TestBigImportReport(t *testing.T) {
	ok, fail, killed := exitOfChild(t, "ok"), exitOfChild(t, "fail"), exitOfChild(t, "killed")
	fault := exitOfChild(t, "fault")
	require.NoError(t, ok)
	for _, c := range []struct {
		name          string
		lines         []string
		werr          error
		outcome, read string
		detail        string
	}{
		{"imported and read", []string{"stage MemPoolImportPointer", "imported at 0x1", "stage read at 0x0", "read ok at 0x0", "stage done"}, ok, "imported", "ok", "imported at 0x1"},
		{"crash in the import", []string{"stage MemPoolImportFromShareableHandle", "stage MemPoolImportPointer"}, killed, "crashed", "not read", `killed (signal 9) during "MemPoolImportPointer"`},
		{"crash in a read", []string{"stage MemPoolImportPointer", "imported at 0x1", "read ok at 0x0", "stage read at 0x100000000"}, killed, "imported", "crashed", `during "read at 0x100000000"`},
		{"wrong, then a crash", []string{"imported at 0x1", "read WRONG at 0x0: byte 0x0 is 0x0, want 0x21", "read ok at 0x1000"}, killed, "imported", "WRONG", "read WRONG at 0x0"},
		{"an error", []string{"stage MemPoolImportPointer", "error MemPoolImportPointer: invalid argument"}, ok, "error", "not read", "MemPoolImportPointer: invalid argument"},
		{"a fault in the driver, caught by the Go runtime", []string{"stage MemPoolImportPointer"}, fault, "crashed", "not read", `status 2; its trace is in the test's output) during "MemPoolImportPointer"`},
		{"set-up failed", nil, fail, "unmeasured", "not read", "exit status 1"},
		{"said nothing", []string{"stage MemPoolImportFromShareableHandle"}, ok, "unmeasured", "not read", "importer exited"},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := bigReport(c.lines, c.werr)
			assert.Equal(t, c.outcome, r.outcome)
			assert.Equal(t, c.read, r.read)
			assert.Contains(t, r.detail, c.detail)
		})
	}
}

// TestBigMarkers checks that every marker lies inside its allocation, that the last
// one ends at its last byte, that 4 GiB boundaries are covered on both sides and that
// no two markers of a size share a seed.
func TestBigMarkers(t *testing.T) {
	for _, size := range bigSizes {
		seeds := map[byte]uint64{}
		ms := bigMarkers(size)
		assert.Equal(t, size, ms[len(ms)-1].off+bigChunk, "%s: the last marker ends at the last byte", sizeString(size))
		for i, m := range ms {
			assert.LessOrEqual(t, m.off+bigChunk, size)
			if i > 0 {
				assert.GreaterOrEqual(t, m.off, ms[i-1].off+bigChunk, "%s: markers overlap", sizeString(size))
			}
			if other, dup := seeds[m.seed]; dup {
				t.Errorf("%s: seed %#x at %#x is also at %#x", sizeString(size), m.seed, m.off, other)
			}
			seeds[m.seed] = m.off
		}
		offs := map[uint64]bool{}
		for _, m := range ms {
			offs[m.off] = true
		}
		for b := uint64(4 * GiB); b < size; b += 4 * GiB {
			assert.True(t, offs[b-bigChunk] && offs[b], "%s: markers on both sides of %d GiB", sizeString(size), b>>30)
		}
	}
}
