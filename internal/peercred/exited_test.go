package peercred

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/proctest"
)

func TestExitedAsksWithoutBlocking(t *testing.T) {
	c := proctest.Start(t, "idle")
	c.Expect("idle")
	p := openProcess(t, c.PID())
	exited, err := p.Exited()
	require.NoError(t, err)
	require.False(t, exited, "a running process")
	c.Kill()
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	require.NoError(t, p.Wait(ctx))
	exited, err = p.Exited()
	require.NoError(t, err)
	require.True(t, exited, "a killed process, not reaped")
	_ = c.Wait() // test cleanup
	require.NoError(t, p.Close())
	_, err = p.Exited()
	require.Error(t, err, "a closed handle cannot tell")
}
