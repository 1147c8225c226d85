// Package protospec owns the reading of docs/PROTOCOL.md's tables for the tests that
// hold the code to them (export/producer's, kv/internal/kvwire's and
// kv/internal/keep's protocol tests): the document's part of one protocol, read table
// by table as each table's header row names it, and the check of a message's layout
// table against the code's encoding of a sample.
package protospec

import (
	"bufio"
	"encoding/binary"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Spec is what the tests read of one protocol's part of the document.
type Spec struct {
	Path      string
	Constants [][]string             // constant, value, meaning
	Messages  [][]string             // type, message, from, payload bytes
	Layouts   map[string]*[][]string // by message name: offset, size, field, meaning
	Flags     [][]string             // message, bit, flag, meaning
	Errors    [][]string             // code, error, meaning
	Versions  [][]string             // version, changes
}

var layoutHeading = regexp.MustCompile(`^### (\d+) (\w+)$`)

// Read reads the tables of the part of the document at path under the level-1
// heading "# title", up to the next level-1 heading: each table goes where the header
// row that starts it says.
func Read(t *testing.T, path, title string) *Spec {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer func() { _ = f.Close() }() // read only: nothing to lose
	s := &Spec{Path: path, Layouts: map[string]*[][]string{}}
	var rows *[][]string // the table being read
	heading, in, found := "", bufio.NewScanner(f), false
	for in.Scan() {
		line := strings.TrimSpace(in.Text())
		if strings.HasPrefix(line, "# ") {
			if found {
				break
			}
			found = line == "# "+title
			continue
		}
		if !found {
			continue
		}
		if strings.HasPrefix(line, "#") {
			heading, rows = line, nil
			continue
		}
		if !strings.HasPrefix(line, "|") {
			rows = nil
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		for i := range cells {
			cells[i] = strings.Trim(strings.TrimSpace(cells[i]), "`")
		}
		switch {
		case rows != nil:
			if !strings.HasPrefix(cells[0], "---") {
				*rows = append(*rows, cells)
			}
		case slices.Equal(cells, []string{"constant", "value", "meaning"}):
			rows = &s.Constants
		case slices.Equal(cells, []string{"type", "message", "from", "payload bytes"}):
			rows = &s.Messages
		case slices.Equal(cells, []string{"message", "bit", "flag", "meaning"}):
			rows = &s.Flags
		case slices.Equal(cells, []string{"code", "error", "meaning"}):
			rows = &s.Errors
		case slices.Equal(cells, []string{"version", "changes"}):
			rows = &s.Versions
		case slices.Equal(cells, []string{"offset", "size", "field", "meaning"}):
			m := layoutHeading.FindStringSubmatch(heading)
			require.NotNil(t, m, "%s: a layout table under %q, want a heading \"### TYPE Name\"", path, heading)
			require.NotContains(t, s.Layouts, m[2], "%s: two layout tables of %s", path, m[2])
			rows = new([][]string)
			s.Layouts[m[2]] = rows
		}
	}
	require.NoError(t, in.Err())
	require.True(t, found, "%s has no heading \"# %s\"", path, title)
	return s
}

// Number reads a decimal or 0x-hexadecimal cell of the document at path.
func Number(t *testing.T, path, cell string) uint64 {
	t.Helper()
	n, err := strconv.ParseUint(cell, 0, 64)
	require.NoError(t, err, "%s: %q is not a number", path, cell)
	return n
}

// CheckConstants checks the constants table against want, by the names it gives them:
// every row known and equal, every constant listed.
func (s *Spec) CheckConstants(t *testing.T, want map[string]uint64) {
	t.Helper()
	seen := map[string]bool{}
	for _, row := range s.Constants {
		v, ok := want[row[0]]
		if !assert.True(t, ok, "%s names constant %q, which the test's constants map does not know", s.Path, row[0]) {
			continue
		}
		seen[row[0]] = true
		assert.Equal(t, v, Number(t, s.Path, row[1]), "%s: constant %q differs from the code", s.Path, row[0])
	}
	for name := range want {
		assert.True(t, seen[name], "%s's constants table has no row %q", s.Path, name)
	}
}

// CheckVersions checks that the versions table goes 1, 2, 3..., says what each
// changed, and ends with version, the one the code speaks.
func (s *Spec) CheckVersions(t *testing.T, version int) {
	t.Helper()
	require.NotEmpty(t, s.Versions, "%s has no versions table", s.Path)
	for i, row := range s.Versions {
		assert.Equal(t, uint64(i+1), Number(t, s.Path, row[0]), "%s: the versions table goes 1, 2, 3...", s.Path)
		assert.NotEmpty(t, row[1], "%s: version %s says nothing of what changed", s.Path, row[0])
	}
	assert.Equal(t, strconv.Itoa(version), s.Versions[len(s.Versions)-1][0], "%s: the last version in its versions table is not the code's", s.Path)
}

// FlagMasks checks each row of the flags table against flags (by "message flag"
// name), and returns the mask of the flags the table lists for each message.
func (s *Spec) FlagMasks(t *testing.T, flags map[string]uint64) map[string]uint64 {
	t.Helper()
	masks := map[string]uint64{}
	for _, row := range s.Flags {
		name := row[0] + " " + row[2]
		want, ok := flags[name]
		if !assert.True(t, ok, "%s lists flag %q, which the test's flags map does not know", s.Path, name) {
			continue
		}
		assert.Equal(t, want, Number(t, s.Path, row[1]), "%s: bit of flag %q", s.Path, name)
		masks[row[0]] |= want
	}
	return masks
}

// CheckLayout checks the layout table of message msg (its rows: offset, size, field,
// meaning) against payload, the code's encoding of m: each field at the offset the
// fields before it end at, of its size ("rest": the rest of the payload, last; a
// size named by an earlier length field: that length), holding m's value. A field
// is m's (or its Geometry's) field of the same name without underscores, compared
// little-endian; "reserved" is zeros; "NAME_len" is the u16 length of field NAME;
// "count" the u32 length of m's first slice. A slice of structs is compared element
// by element, field by field, a string as a u16 length and its bytes. The fields must
// cover the payload.
func CheckLayout(t *testing.T, path, msg string, layout [][]string, payload []byte, m any) {
	t.Helper()
	off := 0
	lengths := map[string]int{}
	for i, f := range layout {
		require.Equal(t, strconv.Itoa(off), f[0], "%s: %s field %s: offset, after the fields before it", path, msg, f[2])
		size, isLength := lengths[f[1]]
		switch {
		case f[1] == "rest":
			require.Equal(t, len(layout)-1, i, "%s: %s field %s takes the rest, so it must be last", path, msg, f[2])
			size = len(payload) - off
		case !isLength:
			size = int(Number(t, path, f[1]))
		}
		require.LessOrEqual(t, off+size, len(payload), "%s: %s field %s runs past the encoded payload", path, msg, f[2])
		want := fieldBytes(t, path, m, msg, f[2], size)
		require.Equal(t, want, payload[off:off+size], "%s: %s field %s at offset %d", path, msg, f[2], off)
		if strings.HasSuffix(f[2], "_len") {
			lengths[f[2]] = int(binary.LittleEndian.Uint16(payload[off:]))
		}
		if f[2] == "count" {
			lengths[f[2]] = int(binary.LittleEndian.Uint32(payload[off:]))
		}
		off += size
	}
	require.Equal(t, len(payload), off, "%s: %s's fields cover %d of the %d bytes the code encodes", path, msg, off, len(payload))
}

// fieldBytes is the encoding of the field the document calls name in message m, size
// bytes (see CheckLayout).
func fieldBytes(t *testing.T, path string, m any, msg, name string, size int) []byte {
	t.Helper()
	v := reflect.ValueOf(m)
	find := func(name string) reflect.Value {
		want := strings.ReplaceAll(name, "_", "")
		match := func(n string) bool { return strings.EqualFold(n, want) }
		if f := v.FieldByNameFunc(match); f.IsValid() {
			return f
		}
		if g := v.FieldByName("Geometry"); g.IsValid() {
			return g.FieldByNameFunc(match)
		}
		return reflect.Value{}
	}
	switch {
	case name == "reserved":
		return make([]byte, size)
	case strings.HasSuffix(name, "_len"):
		f := find(strings.TrimSuffix(name, "_len"))
		require.True(t, f.IsValid(), "%s: %s has field %s, whose field %T has not", path, msg, name, m)
		return binary.LittleEndian.AppendUint16(nil, uint16(f.Len()))
	case name == "count":
		for i := range v.NumField() {
			if f := v.Field(i); f.Kind() == reflect.Slice {
				return binary.LittleEndian.AppendUint32(nil, uint32(f.Len()))
			}
		}
	}
	f := find(name)
	require.True(t, f.IsValid(), "%s: %s has field %s, which %T has not", path, msg, name, m)
	switch f.Kind() {
	case reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Int:
		return binary.LittleEndian.AppendUint64(nil, uintOf(f))[:size]
	case reflect.String:
		return []byte(f.String())
	case reflect.Array, reflect.Slice:
		var b []byte
		for i := range f.Len() {
			b = appendValue(t, b, f.Index(i))
		}
		return b
	}
	t.Fatalf("%s field %s: %v, a type the test cannot encode", msg, name, f.Type())
	return nil
}

func uintOf(v reflect.Value) uint64 {
	if v.CanUint() {
		return v.Uint()
	}
	return uint64(v.Int())
}

// appendValue appends the encoding of an element of an array or slice field.
func appendValue(t *testing.T, b []byte, e reflect.Value) []byte {
	switch e.Kind() {
	case reflect.Uint8:
		return append(b, byte(e.Uint()))
	case reflect.Uint16:
		return binary.LittleEndian.AppendUint16(b, uint16(e.Uint()))
	case reflect.Uint32:
		return binary.LittleEndian.AppendUint32(b, uint32(e.Uint()))
	case reflect.Uint64:
		return binary.LittleEndian.AppendUint64(b, e.Uint())
	case reflect.String:
		return append(binary.LittleEndian.AppendUint16(b, uint16(e.Len())), e.String()...)
	case reflect.Array:
		for j := range e.Len() {
			b = appendValue(t, b, e.Index(j))
		}
		return b
	case reflect.Struct:
		for j := range e.NumField() {
			b = appendValue(t, b, e.Field(j))
		}
		return b
	}
	t.Fatalf("an element of kind %v, which the test cannot encode", e.Kind())
	return nil
}

// CheckSeedCorpus checks the checked-in seed corpus in dir (files of `go test fuzz
// v1` holding one []byte each): decode names the frame type of each entry, or fails;
// every one of types has a well-formed entry, and every one of classes (a part of an
// error's text) an entry that fails with it.
func CheckSeedCorpus(t *testing.T, dir string, decode func([]byte) (string, error), types, classes []string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	seen := map[string]bool{}
	var failures []string
	for _, e := range entries {
		b := readCorpusEntry(t, filepath.Join(dir, e.Name()))
		typ, err := decode(b)
		if err == nil {
			seen[typ] = true
		} else {
			failures = append(failures, err.Error())
		}
	}
	for _, typ := range types {
		assert.True(t, seen[typ], "no well-formed %s seed in %s", typ, dir)
	}
	for _, class := range classes {
		found := false
		for _, f := range failures {
			found = found || strings.Contains(f, class)
		}
		assert.True(t, found, "no seed in %s fails with %q", dir, class)
	}
}

// readCorpusEntry reads a `go test fuzz v1` file of one []byte.
func readCorpusEntry(t *testing.T, path string) []byte {
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	lines := strings.SplitN(strings.TrimSpace(string(raw)), "\n", 2)
	require.Len(t, lines, 2, "%s", path)
	require.Equal(t, "go test fuzz v1", lines[0], "%s", path)
	lit := strings.TrimSuffix(strings.TrimPrefix(lines[1], "[]byte("), ")")
	s, err := strconv.Unquote(lit)
	require.NoError(t, err, "%s", path)
	return []byte(s)
}
