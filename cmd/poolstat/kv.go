package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/replica"
)

// kvLook asks the KV page pool's owner serving dir for its Stats, within timeout.
func kvLook(ctx context.Context, dir string, timeout time.Duration) (kv.Stats, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return replica.QueryStats(ctx, dir)
}

// kvOnce shows the KV page pool at dir once: a table, or its Stats as JSON. It
// returns the exit status: 1 when the owner could not be asked.
func kvOnce(ctx context.Context, dir string, timeout time.Duration, asJSON, indent bool, stdout, stderr io.Writer) int {
	st, err := kvLook(ctx, dir, timeout)
	if err != nil {
		fmt.Fprintf(stderr, "poolstat: -kv %s: %v\n", dir, err)
		return 1
	}
	if asJSON {
		enc := json.NewEncoder(stdout)
		if indent {
			enc.SetIndent("", "  ")
		}
		if err := enc.Encode(st); err != nil {
			fmt.Fprintf(stderr, "poolstat: %v\n", err)
			return 1
		}
		return 0
	}
	renderKV(stdout, dir, st)
	return 0
}

// kvWatch shows the KV page pool at dir every interval until ctx ends.
func kvWatch(ctx context.Context, dir string, timeout, every time.Duration, asJSON bool, stdout, stderr io.Writer) int {
	tick := time.NewTicker(every)
	defer tick.Stop()
	code := 1
	clear := isTerminal(stdout) && !asJSON
	for {
		if clear {
			fmt.Fprint(stdout, "\x1b[H\x1b[2J")
		}
		if c := kvOnce(ctx, dir, timeout, asJSON, false, stdout, stderr); ctx.Err() == nil {
			code = c
		}
		select {
		case <-ctx.Done():
			return code
		case <-tick.C:
		}
	}
}

// renderKV writes the owner's Stats as the operator's table.
func renderKV(w io.Writer, dir string, st kv.Stats) {
	g := st.Geometry
	fmt.Fprintf(w, "KV page pool at %s, owner pid %d: %d layers x %d kv heads x %d head dim, %s, %d tokens/page, at most %d pages of %s per slab (%s reserved, in chunks of %s)\n",
		dir, st.PID, g.Layers, g.KVHeads, g.HeadDim, g.DType, g.TokensPerPage, g.Pages, humanize.IBytes(pageAll(g)), humanize.IBytes(g.ReservedBytes), humanize.IBytes(g.ChunkBytes))
	if r := st.Restart; r != nil {
		how := "new slabs"
		if r.Adopted {
			how = "slabs adopted"
		}
		fmt.Fprintf(w, "start %d over keeper pid %d: %s, %d visible pages restored, %d replicas to reattach (%d not yet)", r.Epoch, r.Keeper, how, r.Restored, r.Replicas, r.Awaiting)
		if r.Kept > 0 {
			fmt.Fprintf(w, ", %d pages kept for the writers of before", r.Kept)
		}
		if r.Dropped != "" {
			fmt.Fprintf(w, " (%s)", r.Dropped)
		}
		fmt.Fprintln(w)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	// LEASED and RELEASING are sealed pages that readers hold, or whose release has
	// not settled.
	fmt.Fprintln(tw, "DEVICE\tMAPPED\tPAGES\tFREE\tWRITING\tSEALING\tSEALED\tLEASED\tRELEASING\tSETTLING\tHITS\tMISSES\tCOPIED\tEVICTED\tSEALS\tDUPLICATES\t")
	for _, d := range st.Devices {
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t\n", d.Device, humanize.IBytes(d.MappedBytes), d.Pages, d.Free, d.Writing, d.Sealing, d.Sealed, d.Leased,
			d.Releasing, d.Settling, d.Hits, d.Misses, d.Copied, d.Evictions, d.Seals, d.Duplicates)
	}
	_ = tw.Flush() // output to the terminal: nowhere else to report its failure
	renderHostTiers(w, st.Devices)
	if len(st.Replicas) == 0 {
		fmt.Fprintln(w, "no replica is connected")
		return
	}
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "REPLICA\tCOMMAND\tDEVICE\tLEASES\tPAGES\t")
	for _, r := range st.Replicas {
		command := "-"
		if info, err := peercred.Lookup(r.PID); err == nil {
			command = info.Command
		}
		state := ""
		if r.AwaitingExit {
			state = "hung up, awaiting its exit"
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%d\t%s\n", r.PID, text(command, maxCommand), r.Device, r.Leases, r.Pages, state)
	}
	_ = tw.Flush() // output to the terminal: nowhere else to report its failure
	if st.ReplicasOmitted > 0 {
		fmt.Fprintf(w, "%d more replicas not listed (%d connected)\n", st.ReplicasOmitted, st.ReplicaCount)
	}
}

// pageAll is one page's bytes in every layer's K and V.
func pageAll(g kv.StatsGeometry) uint64 { return g.PageBytes * 2 * uint64(g.Layers) }

// renderHostTiers writes the devices' host tiers, if any, as a table: pages by state,
// the pages copied each way with their rates, and the pages evicted from the host
// tier (gone) or lost by the slab with no copy there.
func renderHostTiers(w io.Writer, devices []kv.DeviceStats) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	any := false
	for _, d := range devices {
		h := d.Host
		if h == nil {
			continue
		}
		if !any {
			fmt.Fprintln(tw, "HOST TIER\tSIZE\tFREE\tFILLING\tSEALED\tTWINS\tSPILLS\tSPILL GB/s\tRESTORES\tRESTORE GB/s\tSPILLED\tLOST\tEVICTED\tCOPIES BY\t")
			any = true
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%d\t%d\t%d\t%s\t%d\t%s\t%d\t%d\t%d\t%s\t\n", d.Device, humanize.IBytes(h.Bytes), h.Free, h.Filling, h.Sealed, h.Twins,
			h.Spills, rate(h.SpillBytes, h.SpillNanos), h.Restores, rate(h.RestoreBytes, h.RestoreNanos), h.Spilled, h.Lost, h.Evictions, h.CopyPath)
	}
	_ = tw.Flush() // output to the terminal: nowhere else to report its failure
}

// rate is bytes over nanos in GB/s, "-" for none.
func rate(bytes, nanos uint64) string {
	if nanos == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f", float64(bytes)/float64(nanos))
}
