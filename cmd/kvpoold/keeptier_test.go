package main

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
)

// hostTierInode is the inode of the memfd of device 0's host tier that process pid
// holds (a page server serves it on dir/host.sock): the same inode is the same memory.
func hostTierInode(t *testing.T, pid int) uint64 {
	t.Helper()
	dir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	es, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range es {
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && strings.Contains(l, "memfd:cudapool-kv-host-0") {
			info, err := os.Stat(filepath.Join(dir, e.Name()))
			require.NoError(t, err)
			return info.Sys().(*syscall.Stat_t).Ino
		}
	}
	t.Fatalf("pid %d holds no host tier memfd", pid)
	return 0
}

// The keeper holds the host tier's memfd: kvpoold SIGKILLed and started again serves
// the same memory, and says so in its first line; with another -host-bytes it makes
// a new tier, and says why the old one is dropped.
func TestRestartKeepsTheHostTiersMemory(t *testing.T) {
	dir := shortDir(t)
	args := append(restartArgs(dir, 16), "-host-bytes", "8MiB")
	first, line := daemon(t, args...)
	assert.Contains(t, line, "new cache in keeper pid")
	assert.NotContains(t, line, "host pages restored")
	ino := hostTierInode(t, first.Process.Pid)

	sigkill(t, first)
	second, line := daemon(t, args...)
	assert.Contains(t, line, "cache adopted from keeper pid")
	assert.Contains(t, line, "0 host pages restored (the host tier of 1 devices kept)")
	assert.Equal(t, ino, hostTierInode(t, second.Process.Pid), "the restarted kvpoold serves the keeper's memfd")

	sigkill(t, second)
	third, line := daemon(t, append(restartArgs(dir, 16), "-host-bytes", "16MiB")...)
	assert.Contains(t, line, "cache adopted from keeper pid")
	assert.NotContains(t, line, "host pages restored")
	assert.Contains(t, line, "device 0's host tier was of ")
	assert.Contains(t, line, "its pages are dropped")
	assert.NotEqual(t, ino, hostTierInode(t, third.Process.Pid), "another size is another memfd")
}

var hostRestored = regexp.MustCompile(`(\d+) host pages restored \(the host tier of 1 devices kept\)`)

// Pages sealed, then evicted from the slab to the host tier, come back after
// kvpoold's SIGKILL and restart: the index names them, the keeper kept their memory,
// and a match from the reattached replica restores them into the slab with every
// byte of every layer's K and V as written.
func TestRestartRestoresTheHostTier(t *testing.T) {
	dir := shortDir(t)
	args := append(restartArgs(dir, 16), "-host-bytes", "16MiB") // 32 host pages
	first, _ := daemon(t, args...)
	dev, r, s := attach(t, dir)
	ctx := bound(t)
	hashes, pages := sealed(t, ctx, dev, r, s, 12, 1)
	sealed(t, ctx, dev, r, s, 8, 2) // 16 more pages, the whole slab: the first 12 go to the host tier
	sealed(t, ctx, dev, r, s, 8, 3)
	sealed(t, ctx, dev, r, s, 8, 4) // what a spill ahead held from eviction goes now
	for deadline := time.Now().Add(testwait.Bound); ; {
		st, err := r.Stats(ctx)
		require.NoError(t, err)
		if h := st.Devices[0].Host; h.Sealed-h.Twins >= 12 {
			break
		}
		require.True(t, time.Now().Before(deadline), "the host tier never held the 12 evicted pages: %+v", st.Devices[0].Host)
		time.Sleep(10 * time.Millisecond)
	}
	done := r.Done()
	sigkill(t, first)
	testwait.Recv(t, done, "the replica's Done after kvpoold's death")

	_, line := daemon(t, args...)
	m := hostRestored.FindStringSubmatch(line)
	require.NotNil(t, m, "the first line says how many host pages were restored: %s", line)
	n, err := strconv.Atoi(m[1])
	require.NoError(t, err)
	assert.GreaterOrEqual(t, n, 12, line)
	require.NoError(t, r.WaitAttached(ctx))

	got, err := r.Match(ctx, hashes)
	require.NoError(t, err)
	require.Len(t, got.Pages(), 12, "every evicted page matches again")
	g := r.Geometry()
	for i, p := range got.Pages() {
		for l := range g.Layers {
			for _, part := range []kv.Part{kv.K, kv.V} {
				b := make([]byte, g.PageBytes())
				require.NoError(t, dev.MemcpyDtoHAsync(0, b, r.Addr(l, part, int(p)), s))
				require.NoError(t, dev.StreamSynchronize(0, s))
				require.True(t, bytes.Equal(pattern(g, pages[i], l, part == kv.V), b), "page %d (was %d) layer %d part %v", p, pages[i], l, part)
			}
		}
	}
	st, err := r.Stats(ctx)
	require.NoError(t, err)
	// A page a spill copy held while the slab evicted may have stayed in the slab.
	assert.NotZero(t, st.Devices[0].Host.Restores, "the pages came from the host tier: %+v", st.Devices[0].Host)
	require.NoError(t, r.Release(ctx, got, s))
}
