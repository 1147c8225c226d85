package exporttest

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/internal/proctest"
)

// RoleDialer: dialer SOCKET N TIMEOUT_MS
// It says "ready"; at each "go" it makes N handshakes (QueryState, each bounded by
// TIMEOUT_MS) one after another and says "admitted A failed F".
func RoleDialer(args []string) int {
	n, _ := strconv.Atoi(args[1])
	ms, _ := strconv.Atoi(args[2])
	fmt.Println("ready")
	for range proctest.Commands() {
		var admitted, failed int
		for range n {
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(ms)*time.Millisecond)
			if _, err := discover.QueryState(ctx, args[0], discover.WithLogger(DiscardLogger)); err == nil {
				admitted++
			} else {
				failed++
			}
			cancel()
		}
		fmt.Printf("admitted %d failed %d\n", admitted, failed)
	}
	return 0
}
