package testlog

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestBufferTakesConcurrentWriters(t *testing.T) {
	var b Buffer
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() { b.Logger().Info("hello") })
	}
	wg.Wait()
	assert.Equal(t, 8, len(splitLines(b.String())))
}

func splitLines(s string) (lines []string) {
	start := 0
	for i := range len(s) {
		if s[i] == '\n' {
			lines = append(lines, s[start:i])
			start = i + 1
		}
	}
	return lines
}
