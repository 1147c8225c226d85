package producer_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// admitted dials path and completes a handshake as a leasing peer.
func admitted(t testing.TB, path string) *exporttest.RawPeer {
	t.Helper()
	r := exporttest.DialRaw(t, path)
	r.Send(exporttest.LeasingHello())
	m := r.Recv()
	require.EqualValues(t, wire.MsgWelcome, m.Kind(), "handshake answered with %s", m.Kind())
	return r
}

// wantError checks that m is an Error frame for reqID standing for target.
func wantError(t testing.TB, m wire.Message, reqID uint64, target error) {
	t.Helper()
	e, ok := m.(*wire.ErrorMsg)
	require.True(t, ok, "got %s, want an Error wrapping %v", m.Kind(), target)
	require.EqualValues(t, reqID, e.ReqID, "got Error(req %d, %v: %q), want req %d and %v", e.ReqID, wire.CodeErrs[e.Code], e.Text, reqID, target)
	require.ErrorIs(t, wire.ReplyErr(e), target, "got Error(req %d, %v: %q), want req %d and %v", e.ReqID, wire.CodeErrs[e.Code], e.Text, reqID, target)
}

// The cases of export.ErrStaleLease, as its message names them.
const (
	staleReleased = "was released already"
	staleForeign  = "is another connection's"
	staleForged   = "was never issued"
)

// wantStale checks that m is an Error frame for reqID standing for export.ErrStaleLease, its
// text naming the case (staleReleased, staleForeign or staleForged).
func wantStale(t testing.TB, m wire.Message, reqID uint64, why string) {
	t.Helper()
	wantError(t, m, reqID, export.ErrStaleLease)
	require.Contains(t, m.(*wire.ErrorMsg).Text, why, "the stale lease's message names the case")
}
