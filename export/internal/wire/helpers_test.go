package wire

import (
	"context"
	"testing"
	"time"
)

// hangGuard bounds every blocking call of a test. It only ends a test that hangs; no
// test depends on it passing.
const hangGuard = 60 * time.Second

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	t.Cleanup(cancel)
	return ctx
}
