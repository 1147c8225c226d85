package intercept_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/intercept"
	"github.com/cudapool/cudapool/internal/intercept/internal/gen"
)

var errInjected = errors.New("injected")

// The generated file is what the generator writes from cudart.Runtime now: a method
// added to (or changed in) the interface fails here until `go generate
// ./internal/intercept` is run.
func TestGeneratedIsCurrent(t *testing.T) {
	want, err := gen.Source(gen.CudartDir)
	require.NoError(t, err)
	got, err := os.ReadFile(gen.File)
	require.NoError(t, err)
	require.True(t, bytes.Equal(want, got), "%s is stale: run go generate ./internal/intercept", gen.File)
}

// argsFor is distinct arguments for a call of a function of type ft: each int the
// position plus one, each slice that many zero elements, the rest zero.
func argsFor(ft reflect.Type) []reflect.Value {
	args := make([]reflect.Value, ft.NumIn())
	for i := range args {
		v := reflect.New(ft.In(i)).Elem()
		switch v.Kind() {
		case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
			v.SetInt(int64(i + 1))
		case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
			v.SetUint(uint64(i + 1))
		case reflect.Slice:
			v.Set(reflect.MakeSlice(v.Type(), i+1, i+1))
		}
		args[i] = v
	}
	return args
}

func interfaces(vs []reflect.Value) []any {
	out := make([]any, len(vs))
	for i, v := range vs {
		out[i] = v.Interface()
	}
	return out
}

// Every method of cudart.Runtime has its hooks in r.On, named as the method: a Before
// hook sees the call's arguments, in order, and its error fails the call with zero
// results; the call is counted. (A method the generated file lacks does not compile:
// Runtime embeds no cudart.Runtime to fall back on.)
func TestEveryMethodIsIntercepted(t *testing.T) {
	d := cudarttest.ForTest(t)
	rt := intercept.Wrap(d)
	iface := reflect.TypeFor[cudart.Runtime]()
	var names []string
	for _, m := range rt.Methods() {
		names = append(names, m.Name())
	}
	require.Len(t, names, iface.NumMethod())
	errType := reflect.TypeFor[error]()
	for i := range iface.NumMethod() {
		m := iface.Method(i)
		hooks := reflect.ValueOf(&rt.On).Elem().FieldByName(m.Name)
		require.True(t, hooks.IsValid(), "%s has no hooks in Runtime.On", m.Name)
		args := argsFor(m.Type)
		var seen []reflect.Value
		hasErr := m.Type.NumOut() > 0 && m.Type.Out(m.Type.NumOut()-1) == errType
		before := hooks.Addr().MethodByName("Before")
		before.Call([]reflect.Value{reflect.MakeFunc(before.Type().In(0), func(in []reflect.Value) []reflect.Value {
			seen = in
			if hasErr {
				return []reflect.Value{reflect.ValueOf(&errInjected).Elem()}
			}
			return nil
		})})
		out := reflect.ValueOf(rt).MethodByName(m.Name).Call(args)
		assert.Equal(t, interfaces(args), interfaces(seen), "%s: the Before hook's arguments", m.Name)
		assert.EqualValues(t, 1, hooks.Addr().Interface().(intercept.Method).Calls(), "%s: calls counted", m.Name)
		assert.Contains(t, names, m.Name, "Methods() lists %s", m.Name)
		if !hasErr {
			assert.Equal(t, d.Name(), out[0].Interface(), "%s cannot fail, and goes through", m.Name)
			continue
		}
		assert.ErrorIs(t, out[len(out)-1].Interface().(error), errInjected, "%s: the Before hook's error is not returned", m.Name)
		for _, v := range out[:len(out)-1] {
			assert.True(t, v.IsZero(), "%s: a failed call returned a non-zero result", m.Name)
		}
	}
	assert.EqualValues(t, iface.NumMethod(), rt.Calls(), "every call counted once in the total")
}

// Fail fails the next n calls of one method only, then lets them through; After sees
// and may change what the runtime returned; calls with no hook are counted too.
func TestFailAfterAndCalls(t *testing.T) {
	d := cudarttest.ForTest(t)
	rt := intercept.Wrap(d)
	left := rt.On.StreamCreate.Fail(2, errInjected)
	assert.Equal(t, 2, left())
	for range 2 {
		_, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
		require.ErrorIs(t, err, errInjected)
	}
	assert.Zero(t, left())
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err, "the third StreamCreate goes through")
	assert.EqualValues(t, 3, rt.On.StreamCreate.Calls())

	n, err := rt.DeviceCount()
	require.NoError(t, err)
	rt.On.DeviceCount.After(func(n int, err error) (int, error) { return n + 1, err })
	m, err := rt.DeviceCount()
	require.NoError(t, err)
	assert.Equal(t, n+1, m, "After changed the result")
	assert.EqualValues(t, 2, rt.On.DeviceCount.Calls(), "the call with no hook is counted too")

	var runtimeErr error
	rt.On.StreamDestroy.After(func(err error) error { runtimeErr = err; return err })
	require.NoError(t, rt.StreamDestroy(0, s))
	require.Error(t, rt.StreamDestroy(0, s+1), "destroying a stream never created fails in the runtime")
	assert.Error(t, runtimeErr, "After sees the runtime's own error")

	forever := rt.On.EventSynchronize.Fail(-1, errInjected)
	for range 3 {
		require.ErrorIs(t, rt.EventSynchronize(0, 0), errInjected)
	}
	assert.Equal(t, -1, forever(), "n < 0 fails every call")
	require.NoError(t, d.Err())
}

// An Around hook may answer for the runtime: the call is not run (nor the hooks added
// after it), and returns what the hook said.
func TestAroundMayAnswer(t *testing.T) {
	d := cudarttest.ForTest(t)
	rt := intercept.Wrap(d)
	ev, err := d.EventCreate(0, cudart.EventDisableTiming)
	require.NoError(t, err)
	rt.On.EventQuery.Around(func(next intercept.EventQueryFunc, dev int, e cudart.Event) (bool, error) {
		return false, nil
	})
	ran := false
	rt.On.EventQuery.After(func(done bool, err error) (bool, error) { ran = true; return done, err })
	done, err := rt.EventQuery(0, ev)
	require.NoError(t, err)
	assert.False(t, done, "the answer, not the device's (an event never recorded is done)")
	assert.False(t, ran, "a hook added after the answer is not reached")
	require.NoError(t, d.EventDestroy(0, ev))
}

// An Around hook may change the arguments the runtime is called with.
func TestAroundMayChangeArguments(t *testing.T) {
	d := cudarttest.ForTest(t)
	rt := intercept.Wrap(d)
	s, err := d.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	rt.On.MemsetAsync.Around(func(next intercept.MemsetAsyncFunc, dev int, dst cudart.DevicePtr, _ byte, n uint64, s cudart.Stream) error {
		return next(dev, dst, 0x5a, n, s)
	})
	p, err := d.DeviceGetDefaultMemPool(0)
	require.NoError(t, err)
	ptr, err := d.MallocFromPoolAsync(0, 64, p, s)
	require.NoError(t, err)
	require.NoError(t, rt.MemsetAsync(0, ptr, 0x11, 64, s))
	got := make([]byte, 64)
	require.NoError(t, d.MemcpyDtoHAsync(0, got, ptr, s))
	require.NoError(t, d.StreamSynchronize(0, s))
	assert.Equal(t, bytes.Repeat([]byte{0x5a}, 64), got, "the hook's value was set")
	require.NoError(t, d.FreeAsync(0, ptr, s))
	require.NoError(t, d.StreamSynchronize(0, s))
	require.NoError(t, d.Err())
}

// Hooks nest in the order they were added: the first added sees the call first and
// its results last; a hook that fails the call keeps the later ones from it.
func TestHooksNestInOrder(t *testing.T) {
	rt := intercept.Wrap(cudarttest.ForTest(t))
	var order []string
	rt.On.DeviceCount.Around(func(next intercept.DeviceCountFunc) (int, error) {
		order = append(order, "outer in")
		n, err := next()
		order = append(order, "outer out")
		return n, err
	})
	rt.On.DeviceCount.Before(func() error { order = append(order, "before"); return nil })
	rt.On.DeviceCount.After(func(n int, err error) (int, error) { order = append(order, "after"); return n, err })
	_, err := rt.DeviceCount()
	require.NoError(t, err)
	assert.Equal(t, []string{"outer in", "before", "after", "outer out"}, order)

	order = nil
	rt.On.DeviceCount.Fail(1, errInjected)
	rt.On.DeviceCount.Before(func() error { order = append(order, "inner"); return nil })
	_, err = rt.DeviceCount()
	require.ErrorIs(t, err, errInjected)
	assert.Equal(t, []string{"outer in", "before", "after", "outer out"}, order, "the failed call reached no hook inside Fail")
}

// Once runs its function at the first call only, and the calls made meanwhile wait for
// it; Name's hooks take no error, so it cannot be failed.
func TestOnce(t *testing.T) {
	d := cudarttest.ForTest(t)
	rt := intercept.Wrap(d)
	release := make(chan struct{})
	n := 0
	rt.On.DeviceCount.Once(func() {
		n++
		<-release
	})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			_, err := rt.DeviceCount()
			assert.NoError(t, err)
		})
	}
	close(release)
	wg.Wait()
	assert.Equal(t, 1, n)
	assert.EqualValues(t, 4, rt.On.DeviceCount.Calls())

	rt.On.Name.Fail(-1, errInjected)
	assert.Equal(t, d.Name(), rt.Name(), "a method with no error cannot fail")
}

// A hook may be held as a Method whatever its types, and Methods lists them all.
func TestMethod(t *testing.T) {
	rt := intercept.Wrap(cudarttest.ForTest(t))
	var m intercept.Method = &rt.On.FreeAsync
	assert.Equal(t, "FreeAsync", m.Name())
	m.Fail(1, errInjected)
	require.ErrorIs(t, rt.FreeAsync(0, 1, 0), errInjected)
	assert.EqualValues(t, 1, m.Calls())
	assert.Contains(t, rt.Methods(), m)
	assert.EqualValues(t, 1, rt.Calls())
}

// Unwrap is the runtime wrapped (cudart.VMMOf finds the VMM route through it).
func TestUnwrap(t *testing.T) {
	d := cudarttest.ForTest(t)
	rt := intercept.Wrap(d)
	assert.Same(t, d, rt.Unwrap())
}

// TrackLive follows what a create method made until its destroy method takes it.
func TestTrackLive(t *testing.T) {
	d := cudarttest.ForTest(t)
	rt := intercept.Wrap(d)
	streams := intercept.TrackLive(&rt.On.StreamCreate, &rt.On.StreamDestroy)
	made := intercept.TrackLive[cudart.Stream](&rt.On.StreamCreate, nil)
	a, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	b, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	assert.Equal(t, 2, streams.Len())
	require.NoError(t, rt.StreamDestroy(0, a))
	assert.Equal(t, 1, streams.Len())
	assert.False(t, streams.Has(a))
	assert.True(t, streams.Has(b))
	assert.True(t, made.Has(a), "without a destroy method every handle made is kept")
	rt.On.StreamCreate.Fail(1, errInjected)
	_, err = rt.StreamCreate(0, cudart.StreamNonBlocking)
	require.ErrorIs(t, err, errInjected)
	assert.Equal(t, 1, streams.Len(), "a failed create adds nothing")
	require.NoError(t, rt.StreamDestroy(0, b))
	assert.Zero(t, streams.Len())
}

// The generator reads what an interface may hold (variadic parameters, other
// packages' types, unnamed and clashing names) and refuses what it cannot write.
func TestGenerator(t *testing.T) {
	dir := t.TempDir()
	write := func(src string) {
		require.NoError(t, os.WriteFile(filepath.Join(dir, "rt.go"), []byte(src), 0o644))
	}
	write(`package cudart
import "context"
type Runtime interface {
	Name() string
	Wait(ctx context.Context, next int, rest ...Stream) (int, error)
}`)
	src, err := gen.Source(dir)
	require.NoError(t, err)
	assert.Contains(t, string(src), "\t\"context\"\n")
	assert.Contains(t, string(src), "type WaitFunc = func(ctx context.Context, nextArg int, rest ...cudart.Stream) (int, error)")
	assert.Contains(t, string(src), "return r.On.Wait.chain()(ctx, nextArg, rest...)")

	write("package cudart\ntype Runtime interface {\n\tio.Closer\n}\n")
	_, err = gen.Source(dir)
	require.ErrorIs(t, err, gen.ErrNoRuntime)
	assert.ErrorContains(t, err, "embedded io.Closer")

	write("package cudart\ntype Runtime interface {\n\tClose()\n}\n")
	_, err = gen.Source(dir)
	require.ErrorIs(t, err, gen.ErrNoRuntime)
	assert.ErrorContains(t, err, "returns nothing")

	write("package cudart\ntype Other interface{}\n")
	_, err = gen.Source(dir)
	require.ErrorIs(t, err, gen.ErrNoRuntime)
}
