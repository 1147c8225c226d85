package replica_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

func init() {
	roles["owner"] = ownerRole
	roles["replica"] = replicaRole
}

// geometryArg is small, or small with the pages given.
func geometryArg(args []string) kv.Geometry {
	g := small
	if len(args) > 1 {
		g.Pages, _ = strconv.Atoi(args[1])
	}
	return g
}

// ownerRole serves dir (args[0]) until its stdin ends, saying "ready" once it serves.
func ownerRole(args []string) int {
	dev := cudarttest.New()
	defer dev.Close()
	o, err := owner.Listen(args[0], dev, geometryArg(args))
	if err != nil {
		fmt.Fprintln(os.Stderr, "owner:", err)
		return 1
	}
	fmt.Println("ready")
	for range proctest.Commands() {
	}
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	if err := o.Close(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "owner:", err)
		return 1
	}
	return 0
}

// replicaRole is a replica of dir (args[0]) on device args[1], driven by commands:
//
//	write SEED PAGES       alloc, write SEED's pattern, seal and wait: "sealed VISIBLE DUPLICATES"
//	stallwrite SEED PAGES  the same behind a stalled stream, without waiting: "pending N"
//	read SEED PAGES        match SEED's hashes, check the bytes, hold the lease: "read N"
//	release                release the leases held: "released"
//	allocwrite SEED PAGES  alloc and write SEED's pattern behind a stalled stream: "allocated N"
//	hangup                 close the page connection without Bye: "hung up"
//
// A failure is answered "error: ..." and ends the role.
func replicaRole(args []string) int {
	dev := cudarttest.New()
	defer dev.Close()
	device, _ := strconv.Atoi(args[1])
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	r, err := replica.Dial(ctx, args[0], dev, device)
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	s, err := dev.StreamCreate(device, cudart.StreamNonBlocking)
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	var held []*replica.Lease
	fail := func(err error) int {
		fmt.Println("error:", err)
		return 1
	}
	for line := range proctest.Commands() {
		f := strings.Fields(line)
		var seed, pages int
		if len(f) == 3 {
			seed, _ = strconv.Atoi(f[1])
			pages, _ = strconv.Atoi(f[2])
		}
		hashes := r.Hashes(tokens(r.Geometry(), pages, int32(seed)))
		switch f[0] {
		case "write", "stallwrite":
			l, err := allocWrite(dev, r, s, hashes, f[0] == "stallwrite")
			if err != nil {
				return fail(err)
			}
			var opts []replica.SealOption
			if f[0] == "write" {
				opts = append(opts, replica.WaitVisible())
			}
			res, err := r.Seal(ctx, l, hashes, s, opts...)
			if err != nil {
				return fail(err)
			}
			if f[0] == "write" {
				fmt.Println("sealed", res.Visible, res.Duplicates)
			} else {
				fmt.Println("pending", res.Pending)
			}
		case "read":
			l, err := r.Match(ctx, hashes)
			if err != nil {
				return fail(err)
			}
			if err := check(dev, r, s, l.Pages(), hashes); err != nil {
				return fail(err)
			}
			held = append(held, l)
			fmt.Println("read", len(l.Pages()))
		case "allocwrite":
			l, err := allocWrite(dev, r, s, hashes, true)
			if err != nil {
				return fail(err)
			}
			fmt.Println("allocated", len(l.Pages()))
		case "hangup":
			replica.HangUp(r)
			fmt.Println("hung up")
		case "release":
			if err := r.ReleaseAll(ctx, held, s); err != nil {
				return fail(err)
			}
			held = nil
			fmt.Println("released")
		default:
			return fail(fmt.Errorf("unknown command %q", line))
		}
	}
	if err := r.Close(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "replica:", err)
		return 1
	}
	if err := dev.Err(); err != nil {
		fmt.Fprintln(os.Stderr, "replica's device:", err)
		return 1
	}
	return 0
}

// allocWrite allocs a page for each hash and queues their patterns on s, behind a
// stall of s if stall.
func allocWrite(dev *cudarttest.Device, r *replica.Replica, s cudart.Stream, hashes []kv.Hash, stall bool) (*replica.Lease, error) {
	if stall {
		if _, err := dev.Stall(r.Device(), s); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	l, err := r.Alloc(ctx, len(hashes))
	if err != nil {
		return nil, err
	}
	return l, writeErr(dev, r, s, l.Pages(), hashes)
}
