package export

// Policy says which local processes an exporter admits, by the uid and gid the kernel
// recorded for the connecting process (SO_PEERCRED; the gid is the primary group only,
// supplementary groups are not seen). producer.WithPolicy sets it for an Exporter, and
// kv/owner's Options.Policy for the KV page pool's owner.
//
// The zero Policy admits processes of the exporter's own uid. A Policy with any list
// set admits exactly the processes whose uid is in AllowUIDs or whose gid is in
// AllowGIDs; list your own uid if you also want it.
type Policy struct {
	AllowUIDs []uint32
	AllowGIDs []uint32
	// AllowRemote admits peers on byte-stream connections (TCP between the nodes of
	// one NVLink domain) that carry no credentials at all. Only FABRIC pools are shared
	// with them, and the fabric's IMEX channel authorises each import; without
	// AllowRemote such peers are refused.
	AllowRemote bool
}
