//go:build !cgo || !linux

package cudart_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/cudapool/cudapool/cudart"
)

func TestLoadFailsWithoutCgoBinding(t *testing.T) {
	_, err := cudart.Load()
	var le *cudart.LoadError
	if !errors.As(err, &le) || !errors.Is(err, cudart.ErrNoRuntime) || len(le.Tried) != 1 {
		t.Fatalf("want a *LoadError wrapping ErrNoRuntime with one reason, got %v", err)
	}
	if !strings.Contains(le.Tried[0], "cgo") && !strings.Contains(le.Tried[0], "only Linux") {
		t.Fatalf("the reason %q says neither cgo nor the OS", le.Tried[0])
	}
}
