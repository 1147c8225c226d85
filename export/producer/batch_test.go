package producer_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// A ReleaseBatch of no entries is a bad request, answered with an Error; the
// connection serves on.
func TestEmptyReleaseBatchIsABadRequest(t *testing.T) {
	r := admittedToA(t)
	r.Send(&wire.ReleaseBatchMsg{ReqID: 5})
	wantError(t, r.Recv(), 5, export.ErrBadRequest)
	r.ServesOn(6)
}

// A ReleaseBatch of export.MaxBatch forged entries is refused with one Error frame that fits
// the frame limit; the connection serves on.
func TestReleaseBatchOfBadEntriesAnswerFits(t *testing.T) {
	r := admittedToA(t)
	entries := make([]wire.ReleaseMsg, export.MaxBatch)
	for i := range entries {
		entries[i] = wire.ReleaseMsg{LeaseID: 0xdead0000 + uint64(i), Count: 1}
	}
	r.Send(&wire.ReleaseBatchMsg{ReqID: 5, Entries: entries})
	m := r.Recv()
	wantStale(t, m, 5, staleForged)
	assert.Contains(t, m.(*wire.ErrorMsg).Text, fmt.Sprintf("%d of %d entries refused", export.MaxBatch, export.MaxBatch))
	r.ServesOn(6)
}

// No frame larger than the limit is ever written: send refuses it, writing nothing,
// and the connection stays usable.
func TestSendRefusesAnOversizedFrame(t *testing.T) {
	r := admittedToA(t)
	names := make([]string, export.MaxBatch)
	for i := range names {
		names[i] = fmt.Sprintf("%064x", i)
	}
	err := r.C.Send(context.Background(), &wire.OpenBatchMsg{ReqID: 5, Names: names}, -1)
	require.ErrorIs(t, err, export.ErrBadRequest, "an OpenBatch of %d names of 64 bytes", export.MaxBatch)
	assert.Contains(t, err.Error(), "frame limit")
	r.ServesOn(6)
}

// admittedToA is a raw peer admitted by an exporter that publishes "a".
func admittedToA(t *testing.T) *exporttest.RawPeer {
	t.Helper()
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 1)
	return admitted(t, pr.Path)
}
