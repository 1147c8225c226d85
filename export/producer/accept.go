package producer

// Default caps on connections still in their handshake (WithHandshakeLimit). Each
// costs a descriptor and a goroutine until its Hello arrives or the handshake times
// out; a user who opens more is refused, not others.
const (
	defaultHandshakesTotal  = 1024
	defaultHandshakesPerUID = 128
)

// remoteUID stands for the uid of a peer on a byte stream, in the handshake caps.
const remoteUID = ^uint32(0)
