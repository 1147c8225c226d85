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
	"unicode"
	"unicode/utf8"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/discover"
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
	maxText        = 200 // a socket path, an error
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
			who = fmt.Sprintf("%s (pid %d)", text(orDash(e.Name), maxProcessName), e.PID)
		}
		fmt.Fprintf(w, "%s: %s\n  socket %s\n  %s\n", strings.ToUpper(text(string(e.Status), maxPoolName)), who,
			text(e.Socket, maxText), text(e.Error, maxText))
	}
}

// summary is the table's first line: where poolstat looked and what it found.
func summary(r *Report) string {
	if r.Dir == "" {
		return fmt.Sprintf("Exporter at %s: %s", text(r.Exporters[0].Socket, maxText), text(string(r.Exporters[0].Status), maxPoolName))
	}
	if len(r.Exporters) == 0 {
		return fmt.Sprintf("No cudapool exporter is announced in %s: none runs as this user, or it announces elsewhere ($%s, -dir)",
			text(r.Dir, maxText), discover.DirEnv)
	}
	var parts []string
	for _, s := range []Status{Live, Unreachable, Dead, Removed} {
		if n := r.count(s); n > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n, s))
		}
	}
	return fmt.Sprintf("Exporters announced in %s: %s", text(r.Dir, maxText), strings.Join(parts, ", "))
}

func renderLive(w io.Writer, e Exporter, now time.Time) {
	st := e.State
	fmt.Fprintf(w, "%s (pid %s)%s, up %s, %s, %s\n", text(orDash(st.Name), maxProcessName), count(st.PID), poolDevices(st.Pools),
		age(st.Started, now), plural(len(st.Pools), "pool"), plural(len(st.Peers), "peer"))
	fmt.Fprintf(w, "  socket %s\n", text(e.Socket, maxText))

	if len(st.Pools) > 0 {
		tw := table(w)
		fmt.Fprintln(tw, "  POOL\tDEV\tTYPE\tMAX\tRESERVED\t(HIGH)\tUSED\t(HIGH)\tROUNDING")
		for _, p := range st.Pools {
			maxSize := "-"
			if p.MaxSize > 0 {
				maxSize = size(p.MaxSize)
			}
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t(%s)\t%s\t(%s)\t%s\n", text(p.Name, maxPoolName), count(p.Device),
				p.HandleType, maxSize, size(p.ReservedCurrent), size(p.ReservedHigh), size(p.UsedCurrent),
				size(p.UsedHigh), size(p.RoundingOverhead()))
		}
		_ = tw.Flush() // output to the terminal: nowhere else to report its failure
		for _, p := range st.Pools {
			fmt.Fprintf(w, "  %s: %s live, %s shared, %s; %s waiting on importers\n", text(p.Name, maxPoolName),
				plural(p.LiveBuffers, "buffer"), count(p.SharedBuffers), plural(p.ActiveLeases, "lease"), plural(p.DeferredFrees, "free"))
			if p.FailedFrees > 0 {
				fmt.Fprintf(w, "  %s: %s failed and hold memory until the pool closes\n", text(p.Name, maxPoolName),
					plural(p.FailedFrees, "deferred free"))
			}
			if p.Error != "" {
				fmt.Fprintf(w, "  %s: %s\n", text(p.Name, maxPoolName), text(p.Error, maxText))
			}
		}
	}

	if len(st.Published) > 0 {
		names := make(map[uint64]string, len(st.Pools))
		for _, p := range st.Pools {
			names[p.ID] = p.Name
		}
		tw := table(w)
		fmt.Fprintln(tw, "  PUBLISHED\tSIZE\tROUTE\tFROM")
		for _, n := range st.Published {
			route, from := export.RoutePool, text(names[n.Pool], maxPoolName)
			if n.Route == export.RouteVMM {
				route, from = export.RouteVMM, plural(n.Chunks, "chunk")
			}
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\n", text(n.Name, maxPublished), size(n.Size), route, from)
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
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%s (%s ago)\n", name, userName(p.UID), peerDevice(p, st.Devices),
			count(p.Leases), size(p.BytesLeased), p.ConnectedSince.In(now.Location()).Format(time.TimeOnly), age(p.ConnectedSince, now))
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
func poolDevices(pools []export.PoolState) string {
	var devs []int
	for _, p := range pools {
		devs = append(devs, p.Device)
	}
	slices.Sort(devs)
	devs = slices.Compact(devs)
	strs := make([]string, len(devs))
	for i, d := range devs {
		strs[i] = count(d)
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
func peerName(p export.PeerState, commands map[int]string) string {
	if c, ok := commands[p.PID]; ok && !p.Remote {
		return fmt.Sprintf("%s %s", count(p.PID), text(c, maxCommand))
	}
	return count(p.PID)
}

// peerDevice names the peer's device as the exporter knows it ("GPU 1") when it is one of
// the exporter's, by UUID otherwise; "-" for a connection without a device.
func peerDevice(p export.PeerState, devices []export.DeviceState) string {
	if p.Device == "" {
		if p.Remote {
			return "remote"
		}
		return "-"
	}
	if i := slices.IndexFunc(devices, func(d export.DeviceState) bool { return d.UUID == p.Device }); i >= 0 {
		return "GPU " + count(devices[i].Ordinal)
	}
	return text(p.Device, 16)
}

// userName is the login name of uid, or the number when it has none.
func userName(uid uint32) string {
	id := strconv.FormatUint(uint64(uid), 10)
	if u, err := user.LookupId(id); err == nil {
		return text(u.Username, maxUserName)
	}
	return id
}

// text is s, which another process sent, made safe for a terminal and cut to n
// characters: a character that does not print (C0 and C1 controls, so ESC and OSC
// sequences, DEL, bidirectional overrides, any space but ' ') is escaped as \n, \t,
// \r, \xNN, \uNNNN or \UNNNNNNNN, a byte of invalid UTF-8 as \xNN and a backslash as \\, so
// that nothing it holds can move the cursor, forge a line or look like another string.
// A cut is marked with an ellipsis.
func text(s string, n int) string {
	var b strings.Builder
	shown := 0
	for i := 0; i < len(s); {
		r, width := utf8.DecodeRuneInString(s[i:])
		var esc string
		switch {
		case r == utf8.RuneError && width == 1:
			esc = fmt.Sprintf(`\x%02x`, s[i])
		case r == '\\':
			esc = `\\`
		case r == '\n':
			esc = `\n`
		case r == '\t':
			esc = `\t`
		case r == '\r':
			esc = `\r`
		case unicode.IsPrint(r):
			esc = s[i : i+width]
		case r < 0x80:
			esc = fmt.Sprintf(`\x%02x`, r)
		case r < 0x10000:
			esc = fmt.Sprintf(`\u%04x`, r)
		default:
			esc = fmt.Sprintf(`\U%08x`, r)
		}
		i += width
		chars := utf8.RuneCountInString(esc)
		if shown+chars > n || (shown+chars == n && i < len(s)) {
			b.WriteString("…")
			break
		}
		b.WriteString(esc)
		shown += chars
	}
	return b.String()
}

// count is n, a count or an ordinal another process sent, or "invalid (n)" where it
// is negative.
func count(n int) string {
	if n < 0 {
		return "invalid (" + strconv.Itoa(n) + ")"
	}
	return strconv.Itoa(n)
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func plural(n int, noun string) string {
	if n < 0 {
		return count(n) + " " + noun + "s"
	}
	if n == 1 {
		return "1 " + noun
	}
	return strconv.Itoa(n) + " " + noun + "s"
}
