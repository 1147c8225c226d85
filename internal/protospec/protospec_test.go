package protospec

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const doc = `# First

| constant | value | meaning |
|---|---|---|
| a | 1 | one |

### 4 Alloc

| offset | size | field | meaning |
|---|---|---|---|
| 0 | 4 | ` + "`pages`" + ` | n |

# Second

| constant | value | meaning |
|---|---|---|
| b | 0x10 | sixteen |

| message | bit | flag | meaning |
|---|---|---|---|
| Seal | 0x1 | wait | w |

| version | changes |
|---|---|
| 1 | all |
`

// Each protocol's part is read alone, by its heading, its tables by their header rows.
func TestReadTakesOnePart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "P.md")
	require.NoError(t, os.WriteFile(path, []byte(doc), 0o600))
	first := Read(t, path, "First")
	assert.Equal(t, [][]string{{"a", "1", "one"}}, first.Constants)
	require.Contains(t, first.Layouts, "Alloc")
	assert.Equal(t, [][]string{{"0", "4", "pages", "n"}}, *first.Layouts["Alloc"], "backquotes trimmed")
	assert.Empty(t, first.Flags, "the second part's tables are not the first's")

	second := Read(t, path, "Second")
	second.CheckConstants(t, map[string]uint64{"b": 16})
	second.CheckVersions(t, 1)
	assert.Equal(t, map[string]uint64{"Seal": 1}, second.FlagMasks(t, map[string]uint64{"Seal wait": 1}))
	assert.Empty(t, second.Layouts)
}
