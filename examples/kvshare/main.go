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
//
// The problem it shows: eight inference replicas each compute the same KV cache for one
// long system prompt. Better: one computes it once, the others map it. The producer
// stands for the replica that computes it; each consumer maps it, checks every byte from
// its own device and measures how fast it reads it.
//
//	kvshare producer [-socket PATH ...]   # the producer alone, until Ctrl-C
//	kvshare consumer [-socket PATH ...]   # one consumer alone
package main

// The program: main and the launcher (launch.go), the producer (produce.go) and the
// consumer (consume.go) it starts as processes of this executable ("kvshare producer",
// "kvshare consumer", which also run alone), the cache's shape (shape.go) and the
// pattern both sides fill and check (pattern.go); cmd.go holds what they share.

func main() {
	Main(LaunchCommand)
}
