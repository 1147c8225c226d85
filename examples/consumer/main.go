// Command consumer maps the KV cache a producer published, checks every byte of it from
// its own device, reports how fast it read it compared with a local copy, releases it and
// exits. See examples/kvshare for the whole job in one command.
package main

import "github.com/cudapool/cudapool/examples/internal/kv"

func main() {
	kv.Main(kv.ConsumerCommand)
}
