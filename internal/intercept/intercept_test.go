package intercept_test

import (
	"bytes"
	"errors"
	"reflect"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/intercept"
)

var errInjected = errors.New("injected")

// call calls method m of rt with zero arguments and returns its results.
func call(rt cudart.Runtime, m reflect.Method) []reflect.Value {
	f := reflect.ValueOf(rt).MethodByName(m.Name)
	args := make([]reflect.Value, f.Type().NumIn())
	for i := range args {
		args[i] = reflect.Zero(f.Type().In(i))
	}
	return f.Call(args)
}

// Every method of cudart.Runtime goes through the hooks, with its arguments: a method
// added to the interface and not to intercept's fails here by name (it still compiles,
// and reaches the wrapped runtime unseen, through the embedded interface).
func TestEveryMethodIsIntercepted(t *testing.T) {
	d := cudarttest.ForTest(t)
	rt := intercept.Wrap(d)
	iface := reflect.TypeFor[cudart.Runtime]()
	seen := map[string]int{}
	rt.Before(intercept.Any, func(c *intercept.Call) {
		seen[c.Method] = len(c.Args)
		if c.Method != "Name" {
			c.Err = errInjected
		}
	})
	for i := range iface.NumMethod() {
		m := iface.Method(i)
		out := call(rt, m)
		require.Contains(t, seen, m.Name, "%s is not intercepted", m.Name)
		assert.Equal(t, m.Type.NumIn(), seen[m.Name], "%s: the hook saw %d arguments", m.Name, seen[m.Name])
		if m.Name == "Name" {
			assert.Equal(t, d.Name(), out[0].Interface(), "Name goes through")
			continue
		}
		last := out[len(out)-1].Interface()
		assert.ErrorIs(t, last.(error), errInjected, "%s: the Before hook's error is not returned", m.Name)
		for _, v := range out[:len(out)-1] {
			assert.True(t, v.IsZero(), "%s: a failed call returned a non-zero result", m.Name)
		}
		assert.EqualValues(t, 1, rt.Calls(m.Name), "%s: calls counted", m.Name)
	}
	assert.Len(t, seen, iface.NumMethod())
}

// Fail fails the next n calls of one method only, then lets them through; After sees
// and may change what the runtime returned; unwatched calls are counted too.
func TestFailAfterAndCalls(t *testing.T) {
	d := cudarttest.ForTest(t)
	rt := intercept.Wrap(d)
	left := rt.Fail("StreamCreate", 2, errInjected)
	for range 2 {
		_, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
		require.ErrorIs(t, err, errInjected)
	}
	assert.Zero(t, left())
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err, "the third StreamCreate goes through")
	assert.EqualValues(t, 3, rt.Calls("StreamCreate"))

	n, err := rt.DeviceCount()
	require.NoError(t, err)
	rt.After("DeviceCount", func(c *intercept.Call) { c.Results[0] = c.Results[0].(int) + 1 })
	m, err := rt.DeviceCount()
	require.NoError(t, err)
	assert.Equal(t, n+1, m, "After changed the result")
	assert.EqualValues(t, 2, rt.Calls("DeviceCount"), "the unwatched call is counted too")

	var runtimeErr error
	rt.After("StreamDestroy", func(c *intercept.Call) { runtimeErr = c.Err })
	require.NoError(t, rt.StreamDestroy(0, s))
	require.Error(t, rt.StreamDestroy(0, s+1), "destroying a stream never created fails in the runtime")
	assert.Error(t, runtimeErr, "After sees the runtime's own error")
	require.NoError(t, d.Err())
}

// A hook on a method cudart.Runtime does not have would never run: it panics at once.
func TestUnknownMethodPanics(t *testing.T) {
	rt := intercept.Wrap(cudarttest.ForTest(t))
	assert.Panics(t, func() { rt.Before("FreeAsnyc", func(*intercept.Call) {}) })
	assert.Panics(t, func() { rt.Calls("FreeAsnyc") })
}

// A Before hook may answer for the runtime: the call is not run, and returns what the
// hook said.
func TestBeforeMayAnswer(t *testing.T) {
	d := cudarttest.ForTest(t)
	rt := intercept.Wrap(d)
	ev, err := d.EventCreate(0, cudart.EventDisableTiming)
	require.NoError(t, err)
	rt.Before("EventQuery", func(c *intercept.Call) { c.Answer(false) })
	ran := false
	rt.After("EventQuery", func(*intercept.Call) { ran = true })
	done, err := rt.EventQuery(0, ev)
	require.NoError(t, err)
	assert.False(t, done, "the answer, not the device's (an event never recorded is done)")
	assert.False(t, ran, "After runs only for calls that ran")
	require.NoError(t, d.EventDestroy(0, ev))
}

// A Before hook may change the arguments the runtime is called with.
func TestBeforeMayChangeArguments(t *testing.T) {
	d := cudarttest.ForTest(t)
	rt := intercept.Wrap(d)
	s, err := d.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	rt.Before("MemsetAsync", func(c *intercept.Call) { c.Args[2] = byte(0x5a) })
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

// TrackLive follows what a create method made until its destroy method takes it.
func TestTrackLive(t *testing.T) {
	d := cudarttest.ForTest(t)
	rt := intercept.Wrap(d)
	streams := intercept.TrackLive[cudart.Stream](rt, "StreamCreate", "StreamDestroy")
	made := intercept.TrackLive[cudart.Stream](rt, "StreamCreate", "")
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
	rt.Fail("StreamCreate", 1, errInjected)
	_, err = rt.StreamCreate(0, cudart.StreamNonBlocking)
	require.ErrorIs(t, err, errInjected)
	assert.Equal(t, 1, streams.Len(), "a failed create adds nothing")
	require.NoError(t, rt.StreamDestroy(0, b))
	assert.Zero(t, streams.Len())
}
