package printable

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestCheck(t *testing.T) {
	for _, ok := range []string{"kv", "système-prompt", "名前", "a b", strings.Repeat("x", 16)} {
		assert.NoError(t, Check(ok, 16), "%q", ok)
	}
	for s, why := range map[string]string{
		"":                      "empty",
		strings.Repeat("x", 17): "17 bytes, at most 16",
		"bad\xff":               "not UTF-8",
		"two\nlines":            "control character U+000A",
		"\x1b[2J":               "control character U+001B",
		"\u009b31m":             "control character U+009B",
		"kv\u202egnp.exe":       "bidirectional control character U+202E",
		"line\u2028sep":         "line or paragraph separator U+2028",
		"tab\there":             "control character U+0009",
		"del\x7f":               "control character U+007F",
	} {
		err := Check(s, 16)
		if assert.Error(t, err, "%q", s) {
			assert.Contains(t, err.Error(), why, "%q", s)
		}
	}
}

func TestClean(t *testing.T) {
	for in, want := range map[string]string{
		"kv":                    "kv",
		"two\nlines":            "two?lines",
		"bad\xff\xfe":           "bad??",
		"kv\u202egnp":           "kv?gnp",
		"":                      "?",
		strings.Repeat("é", 10): strings.Repeat("é", 8), // 16 bytes, cut on a character
	} {
		got := Clean(in, 16)
		assert.Equal(t, want, got, "Clean(%q)", in)
		assert.NoError(t, Check(got, 16), "Clean(%q) = %q", in, got)
	}
}
