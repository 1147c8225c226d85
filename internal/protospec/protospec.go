// Package protospec owns the reading of docs/PROTOCOL.md's tables for the tests that
// hold the code to them (export/producer's and kv/internal/kvwire's protocol tests):
// the document's part of one protocol, read table by table as each table's header
// row names it.
package protospec

import (
	"bufio"
	"os"
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
