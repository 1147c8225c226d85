// Command producer builds a KV cache on one device, fills it with a pattern consumers can
// check, publishes it with cudapool and serves consumers until Ctrl-C, when it ends every
// lease and frees the cache. See examples/kvshare for the whole job in one command.
package main

import "github.com/cudapool/cudapool/examples/internal/kv"

func main() {
	kv.Main(kv.ProducerCommand)
}
