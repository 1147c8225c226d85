package producer_test

import (
	"fmt"
	rand "math/rand/v2"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/internal/gputest"
	"github.com/cudapool/cudapool/internal/proctest"
)

func TestGPUPeerConsumerSurvivesProducerKill(t *testing.T) {
	gputest.Devices(t, 2)
	peerConsumerSurvivesProducerKill(t, "gpu", 256<<20)
}

// The same with both processes on software devices, which model FACTS 14.
func TestProcessPeerConsumerSurvivesProducerKill(t *testing.T) {
	peerConsumerSurvivesProducerKill(t, "test", 4<<20)
}

func peerConsumerSurvivesProducerKill(t *testing.T, kind string, size int) {
	const fill = 77
	for _, mode := range []string{"replica", "plain", "replica-kill"} {
		t.Run(mode, func(t *testing.T) {
			path := filepath.Join(exporttest.ShortDir(t), "g.sock")
			k := proctest.Start(t, "producer", kind, path, "default", fmt.Sprintf("a=%d:%d", size, fill))
			k.Expect("ready")
			c := proctest.Start(t, "peer-consumer", kind, path, mode, fmt.Sprint(fill))
			c.Expect("opened")
			if mode == "replica-kill" {
				c.Send("loop")
				c.Expect("looping")
				time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond) // somewhere in a copy
			}
			start := time.Now()
			exporttest.KillProducer(t, k)
			t.Logf("producer on GPU 0 SIGKILLed and reaped in %v", time.Since(start).Round(time.Microsecond))
			if mode != "replica-kill" {
				c.Send("check")
			}
			var lines []string
			for l := c.Next(); l != "done"; l = c.Next() {
				t.Log(l)
				lines = append(lines, l)
			}
			report := strings.Join(lines, "\n")
			assert.NotContains(t, report, "FAILED", "the consumer on GPU 1")
			assert.Contains(t, report, "context ok", "the consumer on GPU 1 kept its CUDA context")
			require.NoError(t, c.Wait())
		})
	}
}
