// Command kvshare is cudapool's main job: one producer computes a KV cache once and N
// consumers map it instead of computing it again, each checking every byte from its own
// device and timing the read. It starts the producer and the consumers as separate
// processes (this same binary, re-executed as "kvshare producer" and "kvshare consumer"),
// then prints a summary table.
//
//	go run ./examples/kvshare [-consumers N] [-runtime auto|gpu|test] [-tokens T ...]
//
// Without a GPU it runs on the cudarttest software device, with a 64 MiB cache, and says
// so in its first line; on a GPU the cache is 4 GiB. Consumers take the visible devices
// in turn, so with two GPUs one of them reads the producer's memory over NVLink.
package main

import (
	"github.com/cudapool/cudapool/examples/internal/kv"
)

func main() {
	kv.Main(kv.LaunchCommand)
}
