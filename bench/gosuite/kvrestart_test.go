package main

import (
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/cudapool/cudapool/cudart"
)

// The restart row on the software device: the page server is killed and started
// again each round, every replica reattaches and matches the prompt, its bytes
// check, and nothing fails.
func TestKVRestartRowOnSoftwareDevice(t *testing.T) {
	sh := quickShape
	_, got, out := softwareRows(t, func(r *reporter, _ cudart.Runtime, onGPU bool, sh shape) {
		kvRestartRow(r, onGPU, sh)
	}, sh)
	assert.Equal(t, map[string]string{"kv/restart": strconv.Itoa(min(sh.rounds, 3))}, got, "%s", out)
}
