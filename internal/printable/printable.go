// Package printable owns the rule for the names cudapool shows to people (published
// names, exporter names, pool names): valid UTF-8, not empty, bounded in bytes, and
// without a character that does not show as itself (a control character, so no
// escape sequence; a bidirectional control, which makes "kv\u202egnp.exe" display
// as "kvexe.png"; a line or paragraph separator), so that a name in a log line or a
// poolstat table cannot forge a line, move the cursor or pass for another.
package printable

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Check says why s breaks the rule, with at most max bytes, or nil.
func Check(s string, max int) error {
	switch {
	case s == "":
		return fmt.Errorf("empty")
	case len(s) > max:
		return fmt.Errorf("%d bytes, at most %d", len(s), max)
	case !utf8.ValidString(s):
		return fmt.Errorf("%q is not UTF-8", s)
	}
	for _, c := range s {
		if why := forbidden(c); why != "" {
			return fmt.Errorf("%q: %s %U", s, why, c)
		}
	}
	return nil
}

// Clean is s made to keep the rule: each forbidden character and byte of invalid
// UTF-8 replaced by '?', cut to max bytes on a character boundary; "?" for "".
func Clean(s string, max int) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		c, n := utf8.DecodeRuneInString(s[i:])
		i += n
		part := string(c)
		if (c == utf8.RuneError && n == 1) || forbidden(c) != "" {
			part = "?"
		}
		if b.Len()+len(part) > max {
			break
		}
		b.WriteString(part)
	}
	if b.Len() == 0 {
		return "?"
	}
	return b.String()
}

// forbidden says which kind of character c is if the rule forbids it, or "".
func forbidden(c rune) string {
	if c < utf8.RuneSelf && c >= 0x20 && c != 0x7f {
		return "" // printable ASCII, what names are made of: the tables below are not
	}
	switch {
	case unicode.IsControl(c):
		return "control character"
	case unicode.Is(unicode.Bidi_Control, c):
		return "bidirectional control character"
	case unicode.In(c, unicode.Zl, unicode.Zp):
		return "line or paragraph separator"
	}
	return ""
}
