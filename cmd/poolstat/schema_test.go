package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The -json output is checked against report.schema.json, the schema published for
// its readers, by a validator of the part of JSON Schema (2020-12) that file uses. It
// is stricter than the standard in one way: an object member the schema does not
// declare is an error, so that a field added to the output without being written into
// the schema fails here. (Readers of the schema may ignore members they do not know.)

const schemaFile = "report.schema.json"

// checkSchema fails t unless doc is a report that the schema accepts.
func checkSchema(t *testing.T, doc []byte) {
	t.Helper()
	for _, err := range validate(t, doc) {
		t.Errorf("poolstat -json does not match %s: %v\n%s", schemaFile, err, doc)
	}
}

// validate returns what is wrong with doc against the schema file.
func validate(t *testing.T, doc []byte) []error {
	t.Helper()
	raw, err := os.ReadFile(schemaFile)
	require.NoError(t, err)
	var schema map[string]any
	require.NoError(t, json.Unmarshal(raw, &schema), schemaFile)
	dec := json.NewDecoder(bytes.NewReader(doc))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return []error{fmt.Errorf("not JSON: %w", err)}
	}
	c := &checker{root: schema}
	c.check("$", schema, v)
	return c.errs
}

type checker struct {
	root map[string]any
	errs []error
}

func (c *checker) fail(at, format string, args ...any) {
	c.errs = append(c.errs, fmt.Errorf("%s: %s", at, fmt.Sprintf(format, args...)))
}

// keywords are those the checker knows; a schema using another fails, rather than have
// its rule ignored.
var keywords = []string{"$schema", "$id", "$defs", "$ref", "title", "description", "type", "const", "enum", "required",
	"properties", "additionalProperties", "propertyNames", "pattern", "items", "minimum", "format"}

func (c *checker) check(at string, s map[string]any, v any) {
	for k := range s {
		if !slices.Contains(keywords, k) {
			c.fail(at, "the schema uses %q, which this checker does not know", k)
		}
	}
	if ref, ok := s["$ref"].(string); ok {
		name, found := strings.CutPrefix(ref, "#/$defs/")
		def, _ := c.root["$defs"].(map[string]any)[name].(map[string]any)
		if !found || def == nil {
			c.fail(at, "unresolvable $ref %q", ref)
			return
		}
		c.check(at, def, v)
	}
	if want, ok := s["const"]; ok && fmt.Sprint(want) != fmt.Sprint(v) {
		c.fail(at, "%v, want %v", v, want)
	}
	if enum, ok := s["enum"].([]any); ok && !slices.ContainsFunc(enum, func(e any) bool { return e == v }) {
		c.fail(at, "%v is not one of %v", v, enum)
	}
	if typ, ok := s["type"].(string); ok && !hasType(v, typ) {
		c.fail(at, "%T %v is not of type %s", v, v, typ)
		return
	}
	switch v := v.(type) {
	case json.Number:
		if min, ok := s["minimum"].(float64); ok {
			if f, err := v.Float64(); err != nil || f < min {
				c.fail(at, "%v is below the minimum %v", v, min)
			}
		}
	case string:
		if s["format"] == "date-time" {
			if _, err := time.Parse(time.RFC3339Nano, v); err != nil {
				c.fail(at, "not a date-time: %v", err)
			}
		}
		if p, ok := s["pattern"].(string); ok && !regexp.MustCompile(p).MatchString(v) {
			c.fail(at, "%q does not match %s", v, p)
		}
	case []any:
		if items, ok := s["items"].(map[string]any); ok {
			for i, e := range v {
				c.check(fmt.Sprintf("%s[%d]", at, i), items, e)
			}
		}
	case map[string]any:
		c.checkObject(at, s, v)
	}
}

func (c *checker) checkObject(at string, s map[string]any, v map[string]any) {
	if _, ok := s["$ref"]; ok {
		return // checked through the definition
	}
	required, _ := s["required"].([]any)
	for _, r := range required {
		if _, ok := v[r.(string)]; !ok {
			c.fail(at, "no member %q", r)
		}
	}
	props, _ := s["properties"].(map[string]any)
	names, _ := s["propertyNames"].(map[string]any)
	extra, _ := s["additionalProperties"].(map[string]any)
	keys := make([]string, 0, len(v))
	for k := range v {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if names != nil {
			c.check(at+" member name", names, k)
		}
		switch p, ok := props[k].(map[string]any); {
		case ok:
			c.check(at+"."+k, p, v[k])
		case extra != nil:
			c.check(at+"."+k, extra, v[k])
		default:
			c.fail(at, "member %q is not in the schema", k)
		}
	}
}

func hasType(v any, typ string) bool {
	switch typ {
	case "object":
		_, ok := v.(map[string]any)
		return ok
	case "array":
		_, ok := v.([]any)
		return ok
	case "string":
		_, ok := v.(string)
		return ok
	case "boolean":
		_, ok := v.(bool)
		return ok
	case "integer":
		n, ok := v.(json.Number)
		if !ok {
			return false
		}
		_, err := n.Int64()
		return err == nil
	}
	return false
}

// The golden report matches the schema, and each kind of mistake the schema rules out
// is found: the checker can fail.
func TestSchema(t *testing.T) {
	golden, err := os.ReadFile("testdata/lifecycle.json")
	require.NoError(t, err)
	require.Empty(t, validate(t, golden), "the golden report")

	for what, edit := range map[string]func(r map[string]any){
		"member not in the schema": func(r map[string]any) { r["extra"] = 1 },
		"missing required member":  func(r map[string]any) { delete(r, "time") },
		"wrong schema version":     func(r map[string]any) { r["schema"] = 2 },
		"bad date-time":            func(r map[string]any) { r["time"] = "yesterday" },
		"status not in the enum":   func(r map[string]any) { exporter(r)["status"] = "sleeping" },
		"string for an integer":    func(r map[string]any) { exporter(r)["pid"] = "100" },
		"fraction for an integer":  func(r map[string]any) { exporter(r)["pid"] = 1.5 },
		"negative size":            func(r map[string]any) { state(r)["published"].([]any)[0].(map[string]any)["size"] = -1 },
		"pool member missing":      func(r map[string]any) { delete(state(r)["pools"].([]any)[0].(map[string]any), "used_high") },
		"peer member unknown":      func(r map[string]any) { state(r)["peers"].([]any)[0].(map[string]any)["name"] = "x" },
		"process key not a pid":    func(r map[string]any) { exporter(r)["processes"] = map[string]any{"x": "sh"} },
		"process name not string":  func(r map[string]any) { exporter(r)["processes"] = map[string]any{"1": 1} },
	} {
		var r map[string]any
		require.NoError(t, json.Unmarshal(golden, &r))
		edit(r)
		doc, err := json.Marshal(r)
		require.NoError(t, err)
		assert.NotEmpty(t, validate(t, doc), "a report with a %s passed the schema", what)
	}
}

func exporter(r map[string]any) map[string]any { return r["exporters"].([]any)[0].(map[string]any) }
func state(r map[string]any) map[string]any    { return exporter(r)["state"].(map[string]any) }
