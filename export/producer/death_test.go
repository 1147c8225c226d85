package producer_test

import (
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/intercept"
	"github.com/cudapool/cudapool/internal/proctest"
)

// The exporter opens a consumer's release event on its first grant; a consumer whose
// process has exited by then (its socket kept open by another process) must not have
// its event opened: the exporter asks the process handle it holds first.
func TestReleaseEventOfExitedConsumerIsNotOpened(t *testing.T) {
	var counter *intercept.Runtime // counts the IPC events the exporter opens
	pr := exporttest.NewProducerOn(t, func(rt cudart.Runtime) cudart.Runtime {
		counter = intercept.Wrap(rt)
		return counter
	}, nil, nil)
	pr.Publish(t, "a", 1<<20, 1)
	k := proctest.Start(t, "lingering-consumer", pr.Path)
	f := strings.Fields(k.Next())
	require.Len(t, f, 2)
	require.Equal(t, "ready", f[0])
	holder, err := strconv.Atoi(f[1])
	require.NoError(t, err)
	defer func() {
		syscall.Kill(holder, syscall.SIGKILL)
		var ws syscall.WaitStatus
		syscall.Wait4(holder, &ws, 0, nil)
	}()
	k.Kill()
	exporttest.KilledBySIGKILL(t, k)
	err = pr.Ex.Push(exporttest.Ctx(t), "a", k.PID())
	require.Error(t, err)
	assert.ErrorIs(t, err, producer.ErrNoPeer)
	assert.Zero(t, counter.On.IpcOpenEventHandle.Calls(), "the release event of an exited process was opened")
	pr.CheckClean(t)
}
