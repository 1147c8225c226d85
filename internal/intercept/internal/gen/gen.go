// Package gen owns the generator of internal/intercept's per-method code: it reads the
// cudart.Runtime interface from cudart's source (go/ast, no type checking, so it runs
// while internal/intercept itself does not compile for a method it lacks) and writes
// one hook type and one Runtime method per interface method. `go generate
// ./internal/intercept` runs it (through gen/cmd); intercept's tests run it in memory
// and fail while the file it writes is stale.
package gen

import (
	"bytes"
	"errors"
	"fmt"
	"go/ast"
	"go/format"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"unicode"
)

// File is the name of the file the generator writes, in internal/intercept.
const File = "methods_gen.go"

// CudartDir is the cudart package's folder, from internal/intercept.
const CudartDir = "../../cudart"

// ErrNoRuntime is returned when cudart's source declares no Runtime interface, or one
// the generator cannot read (an embedded interface, a type it does not know).
var ErrNoRuntime = errors.New("gen: no readable cudart.Runtime interface")

// param is one parameter or result of a method.
type param struct {
	Name, Type string
	Variadic   bool // the last parameter, ...T (Type is T's slice, []T)
}

// method is one cudart.Runtime method.
type method struct {
	Name   string
	Params []param
	Values []param // the results but the error
	HasErr bool    // its last result is an error
}

// Sig is the method's parameters, named.
func (m method) Sig() string { return m.paramList(true) }

// NextSig is the parameters of an Around hook: next, then the method's.
func (m method) NextSig() string {
	if len(m.Params) == 0 {
		return "next " + m.Name + "Func"
	}
	return "next " + m.Name + "Func, " + m.Sig()
}

// Types is the method's parameter types, unnamed.
func (m method) Types() string { return m.paramList(false) }

// paramList is the method's parameters as a signature lists them, named or not.
func (m method) paramList(named bool) string {
	var s []string
	for _, p := range m.Params {
		t := p.Type
		if p.Variadic {
			t = "..." + strings.TrimPrefix(t, "[]")
		}
		if named {
			t = p.Name + " " + t
		}
		s = append(s, t)
	}
	return strings.Join(s, ", ")
}

// Args is the method's parameters as a call passes them on.
func (m method) Args() string {
	var s []string
	for _, p := range m.Params {
		if p.Variadic {
			s = append(s, p.Name+"...")
			continue
		}
		s = append(s, p.Name)
	}
	return strings.Join(s, ", ")
}

// NextArgs is Args after next.
func (m method) NextArgs() string {
	if len(m.Params) == 0 {
		return "next"
	}
	return "next, " + m.Args()
}

// Results is the method's result list, unnamed, as a signature ends.
func (m method) Results() string {
	var s []string
	for _, v := range m.Values {
		s = append(s, v.Type)
	}
	if m.HasErr {
		s = append(s, "error")
	}
	if len(s) == 1 {
		return s[0]
	}
	return "(" + strings.Join(s, ", ") + ")"
}

// ResultSig is the method's results, named, as the parameters of an After hook.
func (m method) ResultSig() string {
	var s []string
	for _, v := range m.Values {
		s = append(s, v.Name+" "+v.Type)
	}
	if m.HasErr {
		s = append(s, "err error")
	}
	return strings.Join(s, ", ")
}

// Zeros is the zero values of the results but the error, each followed by ", ".
func (m method) Zeros() string {
	var s string
	for _, v := range m.Values {
		s += "zero[" + v.Type + "](), "
	}
	return s
}

// Source is the generated file for the Runtime interface declared in the Go files of
// dir (cudart's folder): gofmt'ed Go source. On failure the error says what it could
// not read; nothing is written.
func Source(dir string) ([]byte, error) {
	ms, imports, err := readRuntime(dir)
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	if err := tmpl.Execute(&b, struct {
		Methods []method
		Imports []string
	}{ms, imports}); err != nil {
		return nil, fmt.Errorf("gen: template: %w", err)
	}
	out, err := format.Source(b.Bytes())
	if err != nil {
		return nil, fmt.Errorf("gen: the generated source does not parse: %w", err)
	}
	return out, nil
}

// readRuntime is the methods of the Runtime interface in dir, in their order, with
// the import paths their types name beyond cudart's.
func readRuntime(dir string) ([]method, []string, error) {
	fset := token.NewFileSet()
	names, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		return nil, nil, err
	}
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		src, err := os.ReadFile(name)
		if err != nil {
			return nil, nil, err
		}
		f, err := parser.ParseFile(fset, name, src, parser.SkipObjectResolution)
		if err != nil {
			return nil, nil, fmt.Errorf("gen: %w", err)
		}
		it := findInterface(f, "Runtime")
		if it == nil {
			continue
		}
		q := &qualifier{file: f, used: map[string]bool{}}
		ms, err := q.methods(it)
		if err != nil {
			return nil, nil, fmt.Errorf("%w: %s: %w", ErrNoRuntime, name, err)
		}
		imports := make([]string, 0, len(q.used))
		for p := range q.used {
			imports = append(imports, p)
		}
		sort.Strings(imports)
		return ms, imports, nil
	}
	return nil, nil, fmt.Errorf("%w in %s", ErrNoRuntime, dir)
}

func findInterface(f *ast.File, name string) *ast.InterfaceType {
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.TYPE {
			continue
		}
		for _, s := range g.Specs {
			ts := s.(*ast.TypeSpec)
			if it, ok := ts.Type.(*ast.InterfaceType); ok && ts.Name.Name == name {
				return it
			}
		}
	}
	return nil
}

// qualifier writes cudart's type expressions as they read from another package.
type qualifier struct {
	file *ast.File
	used map[string]bool // import paths named
}

// reserved are the names the generated code uses beside a method's parameters.
var reserved = map[string]bool{"r": true, "hs": true, "fn": true, "next": true, "err": true, "pre": true, "rt": true}

func (q *qualifier) methods(it *ast.InterfaceType) ([]method, error) {
	var ms []method
	for _, f := range it.Methods.List {
		ft, ok := f.Type.(*ast.FuncType)
		if !ok || len(f.Names) != 1 {
			return nil, fmt.Errorf("an embedded %s: list its methods in Runtime", q.expr(f.Type))
		}
		m := method{Name: f.Names[0].Name}
		params, err := q.fields(ft.Params, "a")
		if err != nil {
			return nil, fmt.Errorf("%s: %w", m.Name, err)
		}
		results, err := q.fields(ft.Results, "v")
		if err != nil {
			return nil, fmt.Errorf("%s: %w", m.Name, err)
		}
		if n := len(results); n > 0 && results[n-1].Type == "error" {
			m.HasErr = true
			results = results[:n-1]
		}
		if len(results) == 0 && !m.HasErr {
			return nil, fmt.Errorf("%s returns nothing: the generator writes no After for it", m.Name)
		}
		seen := map[string]bool{}
		for i := range params {
			for reserved[params[i].Name] || seen[params[i].Name] {
				params[i].Name += "Arg"
			}
			seen[params[i].Name] = true
		}
		for i := range results {
			for reserved[results[i].Name] || seen[results[i].Name] {
				results[i].Name += "Result"
			}
			seen[results[i].Name] = true
		}
		m.Params, m.Values = params, results
		ms = append(ms, m)
	}
	return ms, nil
}

// fields is fl's parameters, each named (prefix and its index where fl has none).
func (q *qualifier) fields(fl *ast.FieldList, prefix string) ([]param, error) {
	var ps []param
	if fl == nil {
		return nil, nil
	}
	for _, f := range fl.List {
		typ, variadic := f.Type, false
		if e, ok := typ.(*ast.Ellipsis); ok {
			typ, variadic = e.Elt, true
		}
		s := q.expr(typ)
		if strings.Contains(s, "?") {
			return nil, fmt.Errorf("a type the generator does not read: %T", typ)
		}
		if variadic {
			s = "[]" + s
		}
		if len(f.Names) == 0 {
			ps = append(ps, param{Name: prefix + strconv.Itoa(len(ps)), Type: s, Variadic: variadic})
		}
		for _, n := range f.Names {
			name := n.Name
			if name == "_" {
				name = prefix + strconv.Itoa(len(ps))
			}
			ps = append(ps, param{Name: name, Type: s, Variadic: variadic})
		}
	}
	return ps, nil
}

// expr is e as written outside cudart: its exported names qualified; "?" stands for
// what it cannot write.
func (q *qualifier) expr(e ast.Expr) string {
	switch e := e.(type) {
	case *ast.Ident:
		if unicode.IsUpper(rune(e.Name[0])) {
			return "cudart." + e.Name
		}
		return e.Name // predeclared
	case *ast.SelectorExpr:
		pkg, ok := e.X.(*ast.Ident)
		if !ok {
			return "?"
		}
		for _, im := range q.file.Imports {
			path, _ := strconv.Unquote(im.Path.Value)
			if (im.Name != nil && im.Name.Name == pkg.Name) || (im.Name == nil && filepath.Base(path) == pkg.Name) {
				q.used[path] = true
			}
		}
		return pkg.Name + "." + e.Sel.Name
	case *ast.StarExpr:
		return "*" + q.expr(e.X)
	case *ast.ArrayType:
		if e.Len == nil {
			return "[]" + q.expr(e.Elt)
		}
		return "[" + q.expr(e.Len) + "]" + q.expr(e.Elt)
	case *ast.BasicLit:
		return e.Value
	case *ast.MapType:
		return "map[" + q.expr(e.Key) + "]" + q.expr(e.Value)
	case *ast.ChanType:
		switch e.Dir {
		case ast.SEND:
			return "chan<- " + q.expr(e.Value)
		case ast.RECV:
			return "<-chan " + q.expr(e.Value)
		}
		return "chan " + q.expr(e.Value)
	case *ast.InterfaceType:
		if len(e.Methods.List) == 0 {
			return "any"
		}
	}
	return "?"
}
