package exporttest

import (
	"github.com/cudapool/cudapool/export/internal/wire"
)

// Frame builds raw frame bytes with any header, right or wrong.
func Frame(length uint32, t wire.MsgType, payload []byte) []byte {
	b := wire.Le.AppendUint32(nil, length)
	return append(append(b, byte(t)), payload...)
}
