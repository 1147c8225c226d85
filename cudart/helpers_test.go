package cudart_test

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// must returns a function that returns a call's value, failing t if the call failed.
func must[T any](t testing.TB, what string) func(T, error) T {
	return func(v T, err error) T {
		t.Helper()
		require.NoError(t, err, what)
		return v
	}
}

// pattern is n bytes that differ from seed to seed and from byte to nearby byte.
func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7)
	}
	return b
}
