package main

import (
	"fmt"
	"io"
	"os/user"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/discover"
)

// Width is what the table fits in, socket paths aside.
const Width = 100

// Longest names shown whole; longer ones are cut with an ellipsis so that the table
// keeps its width.
const (
	maxPoolName    = 16
	maxUserName    = 12
	maxProcessName = 32
	maxCommand     = 15 // what the kernel keeps of a command name
	maxPublished   = 48
)

// render writes r as the operator's table, with ages counted up to now.
func render(w io.Writer, r *Report, now time.Time) {
	fmt.Fprintln(w, summary(r))
	for _, e := range r.Exporters {
		fmt.Fprintln(w)
		if e.Status == Live {
			renderLive(w, e, now)
			continue
		}
		who := "unknown process"
		if e.PID > 0 {
			who = fmt.Sprintf("%s (pid %d)", cut(orDash(e.Name), maxProcessName), e.PID)
		}
		fmt.Fprintf(w, "%s: %s\n  socket %s\n  %s\n", strings.ToUpper(string(e.Status)), who, e.Socket, e.Error)
		if e.Status == Dead {
			fmt.Fprintln(w, "  poolstat -clean removes its announcement")
		}
	}
}

// summary is the table's first line: where poolstat looked and what it found.
func summary(r *Report) string {
	if r.Dir == "" {
		return fmt.Sprintf("Exporter at %s: %s", r.Exporters[0].Socket, r.Exporters[0].Status)
	}
	if len(r.Exporters) == 0 {
		return fmt.Sprintf("No cudapool exporter is announced in %s: none runs as this user, or it announces elsewhere ($%s, -dir)",
			r.Dir, discover.DirEnv)
	}
	var parts []string
	for _, s := range []Status{Live, Unreachable, Dead, Removed} {
		if n := r.count(s); n > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n, s))
		}
	}
	return fmt.Sprintf("Exporters announced in %s: %s", r.Dir, strings.Join(parts, ", "))
}

func renderLive(w io.Writer, e Exporter, now time.Time) {
	st := e.State
	fmt.Fprintf(w, "%s (pid %d)%s, up %s, %s, %s\n", cut(orDash(st.Name), maxProcessName), st.PID, poolDevices(st.Pools),
		age(st.Started, now), plural(len(st.Pools), "pool"), plural(len(st.Peers), "peer"))
	fmt.Fprintf(w, "  socket %s\n", e.Socket)

	if len(st.Pools) > 0 {
		tw := table(w)
		fmt.Fprintln(tw, "  POOL\tDEV\tTYPE\tMAX\tRESERVED\t(HIGH)\tUSED\t(HIGH)\tROUNDING")
		for _, p := range st.Pools {
			maxSize := "-"
			if p.MaxSize > 0 {
				maxSize = size(p.MaxSize)
			}
			fmt.Fprintf(tw, "  %s\t%d\t%s\t%s\t%s\t(%s)\t%s\t(%s)\t%s\n", cut(p.Name, maxPoolName), p.Device,
				p.HandleType, maxSize, size(p.ReservedCurrent), size(p.ReservedHigh), size(p.UsedCurrent),
				size(p.UsedHigh), size(p.RoundingOverhead()))
		}
		_ = tw.Flush() // output to the terminal: nowhere else to report its failure
		for _, p := range st.Pools {
			fmt.Fprintf(w, "  %s: %s live, %d shared, %s; %s waiting on importers\n", cut(p.Name, maxPoolName),
				plural(p.LiveBuffers, "buffer"), p.SharedBuffers, plural(p.ActiveLeases, "lease"), plural(p.DeferredFrees, "free"))
			if p.FailedFrees > 0 {
				fmt.Fprintf(w, "  %s: %s failed and hold memory until the pool closes\n", cut(p.Name, maxPoolName),
					plural(p.FailedFrees, "deferred free"))
			}
			if p.Error != "" {
				fmt.Fprintf(w, "  %s: %s\n", cut(p.Name, maxPoolName), p.Error)
			}
		}
	}

	if len(st.Published) > 0 {
		names := make(map[uint64]string, len(st.Pools))
		for _, p := range st.Pools {
			names[p.ID] = p.Name
		}
		tw := table(w)
		fmt.Fprintln(tw, "  PUBLISHED\tSIZE\tPOOL")
		for _, n := range st.Published {
			fmt.Fprintf(tw, "  %s\t%s\t%s\n", cut(n.Name, maxPublished), size(n.Size), cut(names[n.Pool], maxPoolName))
		}
		_ = tw.Flush() // output to the terminal: nowhere else to report its failure
	}

	if len(st.Peers) == 0 {
		fmt.Fprintln(w, "  no peer connected")
		return
	}
	tw := table(w)
	fmt.Fprintln(tw, "  PEER\tUSER\tDEVICE\tLEASES\tLEASED\tCONNECTED")
	var awaiting []string
	for _, p := range st.Peers {
		name := peerName(p, e.Processes)
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%d\t%s\t%s (%s ago)\n", name, userName(p.UID), peerDevice(p, st.Devices),
			p.Leases, size(p.BytesLeased), p.ConnectedSince.In(now.Location()).Format(time.TimeOnly), age(p.ConnectedSince, now))
		if p.AwaitingExit {
			awaiting = append(awaiting, name)
		}
	}
	_ = tw.Flush() // output to the terminal: nowhere else to report its failure
	// A peer that hung up while alive keeps its leases until it exits: its imports may
	// still be mapped.
	for _, name := range awaiting {
		fmt.Fprintf(w, "  %s hung up without Bye: its leases are held until it exits\n", name)
	}
}

// poolDevices says which devices the exporter's pools are on: " on device 0", " on
// devices 0,1", or nothing without pools.
func poolDevices(pools []discover.PoolState) string {
	var devs []int
	for _, p := range pools {
		devs = append(devs, p.Device)
	}
	slices.Sort(devs)
	devs = slices.Compact(devs)
	strs := make([]string, len(devs))
	for i, d := range devs {
		strs[i] = strconv.Itoa(d)
	}
	switch len(devs) {
	case 0:
		return ""
	case 1:
		return " on device " + strs[0]
	}
	return " on devices " + strings.Join(strs, ",")
}

func table(w io.Writer) *tabwriter.Writer { return tabwriter.NewWriter(w, 0, 0, 2, ' ', 0) }

// size is a byte count for people: "64 MiB".
func size(n uint64) string { return humanize.IBytes(n) }

// age is how long ago t was, to the second.
func age(t, now time.Time) string {
	if t.IsZero() {
		return "?"
	}
	return max(now.Sub(t), 0).Round(time.Second).String()
}

// peerName is the peer's pid with its command name beside it ("4242 python3") when this
// host shows one; a remote peer's pid is another host's, so it has none.
func peerName(p discover.PeerState, commands map[int]string) string {
	if c, ok := commands[p.PID]; ok && !p.Remote {
		return fmt.Sprintf("%d %s", p.PID, cut(c, maxCommand))
	}
	return strconv.Itoa(p.PID)
}

// peerDevice names the peer's device as the exporter knows it ("GPU 1") when it is one of
// the exporter's, by UUID otherwise; "-" for a connection without a device.
func peerDevice(p discover.PeerState, devices []discover.DeviceState) string {
	if p.Device == "" {
		if p.Remote {
			return "remote"
		}
		return "-"
	}
	if i := slices.IndexFunc(devices, func(d discover.DeviceState) bool { return d.UUID == p.Device }); i >= 0 {
		return "GPU " + strconv.Itoa(devices[i].Ordinal)
	}
	return cut(p.Device, 16)
}

// userName is the login name of uid, or the number when it has none.
func userName(uid uint32) string {
	id := strconv.FormatUint(uint64(uid), 10)
	if u, err := user.LookupId(id); err == nil {
		return cut(u.Username, maxUserName)
	}
	return id
}

// cut shortens s to n characters, marking the cut with an ellipsis.
func cut(s string, n int) string {
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return strconv.Itoa(n) + " " + noun + "s"
}
