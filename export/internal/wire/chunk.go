package wire

import (
	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
)

// ChunkHandleMsg is one chunk of a VMM allocation the importer is about to receive a
// lease in: chunk Index of Count, in the order they map into one range, Size bytes.
// The exporter sends an allocation's chunks, all Count of them, once per connection,
// before the first Lease (flag LeaseVMM) that names the allocation; for a POSIX-fd
// chunk the descriptor rides on the frame, for a FABRIC one the handle is inline.
type ChunkHandleMsg struct {
	AllocID    uint64
	Size       uint64
	Index      uint32
	Count      uint32
	HandleType cudart.HandleType
	Device     cudart.UUID
	Fabric     cudart.FabricHandle // zero unless HandleType is FABRIC
}

const chunkHandleLen = 8 + 8 + 4 + 4 + 4 + 16 + 64

// DropChunksMsg tells the importer that the allocation is unpublished: it closes the
// chunks it imported of it (a mapping of them keeps the memory until released).
type DropChunksMsg struct{ AllocID uint64 }

const dropChunksLen = 8

func (*ChunkHandleMsg) Kind() MsgType { return MsgChunkHandle }

func (*DropChunksMsg) Kind() MsgType { return MsgDropChunks }

func (m *ChunkHandleMsg) AppendPayload(b []byte) []byte {
	b = Le.AppendUint64(b, m.AllocID)
	b = Le.AppendUint64(b, m.Size)
	b = Le.AppendUint32(b, m.Index)
	b = Le.AppendUint32(b, m.Count)
	b = Le.AppendUint32(b, uint32(m.HandleType))
	b = append(b, m.Device[:]...)
	return append(b, m.Fabric[:]...)
}

func (m *DropChunksMsg) AppendPayload(b []byte) []byte { return Le.AppendUint64(b, m.AllocID) }

func decodeChunkHandle(r *reader) (Message, error) {
	m := &ChunkHandleMsg{AllocID: r.u64(), Size: r.u64(), Index: r.u32(), Count: r.u32(),
		HandleType: cudart.HandleType(r.u32())}
	r.bytes(m.Device[:])
	r.bytes(m.Fabric[:])
	switch {
	case m.Count == 0 || m.Count > export.MaxChunks:
		return nil, ProtocolErr("ChunkHandle of an allocation of %d chunks, want 1 to %d", m.Count, export.MaxChunks)
	case m.Index >= m.Count:
		return nil, ProtocolErr("ChunkHandle is chunk %d of %d", m.Index, m.Count)
	case m.Size == 0:
		return nil, ProtocolErr("ChunkHandle of a chunk of 0 bytes")
	case m.AllocID == 0:
		return nil, ProtocolErr("ChunkHandle of allocation 0")
	}
	if err := checkHandle(MsgChunkHandle, m.HandleType, m.Fabric); err != nil {
		return nil, err
	}
	return m, nil
}

func decodeDropChunks(r *reader) (Message, error) {
	m := &DropChunksMsg{AllocID: r.u64()}
	if m.AllocID == 0 {
		return nil, ProtocolErr("DropChunks of allocation 0")
	}
	return m, nil
}

// checkHandle refuses a handle type other than POSIX fd and FABRIC, and fabric bytes
// on a POSIX fd handle, in a frame of type t.
func checkHandle(t MsgType, ht cudart.HandleType, fab cudart.FabricHandle) error {
	switch ht {
	case cudart.HandleTypePosixFD:
		if fab != (cudart.FabricHandle{}) {
			return ProtocolErr("POSIX fd %s carries fabric bytes", t)
		}
	case cudart.HandleTypeFabric:
	default:
		return ProtocolErr("%s has handle type %v, want posix-fd or fabric", t, ht)
	}
	return nil
}
