// Package intercept owns the one way tests steer a cudart.Runtime's calls: [Wrap] a
// runtime, then fail, count, stall, answer or watch the calls of one method through
// that method's own hooks, r.On.<Method>, typed as the method is:
//
//	rt := intercept.Wrap(dev)
//	rt.On.FreeAsync.Fail(1, errInjected)
//	rt.On.StreamWaitEvent.Before(func(dev int, s cudart.Stream, e cudart.Event) error { ... })
//	rt.On.EventQuery.Around(func(next intercept.EventQueryFunc, dev int, e cudart.Event) (bool, error) {
//		return false, nil // answers for the runtime, which is not called
//	})
//	n := rt.On.MemPoolImportPointer.Calls()
//
// # Why this shape
//
// A hook is a field per method rather than a name: the compiler checks the method's
// name and the hook's argument and result types, and a method renamed or retyped in
// cudart breaks the tests that hook it where they are built, not when they run (the
// hooks were keyed by name over []any before). Every hook is one middleware, Around
// (net/http's handler wrapping): it gets next, the rest of the chain, and may call it
// with other arguments, change what it returns, or answer without calling it. Before
// and After are Around's two common cases, written out for each method; Fail, Once,
// Calls and Name need no argument types and are [Method]'s, so a test may hold any
// method's hooks as a Method (a list of calls to count, a method to block).
//
// The per-method code is mechanical and generated (methods_gen.go) from the
// cudart.Runtime interface by internal/gen (`go generate ./internal/intercept`).
// [Runtime] does not embed the runtime it wraps, so a Runtime method the generated file
// lacks is a compile error here, and TestGeneratedIsCurrent fails while the file
// differs from what the generator writes now.
//
// Hooks nest in the order they were added: the first added sees a call first and
// its results last. A call of a method with no hook goes straight to the wrapped
// runtime (one atomic add and one atomic load, nothing allocated); Calls counts every
// call, failed ones included. Hooks may be added while calls run, from any goroutine.
package intercept

//go:generate go run ./internal/gen/cmd

import (
	"sync"
	"sync/atomic"

	"github.com/cudapool/cudapool/cudart"
)

// Runtime is a cudart.Runtime whose calls go through hooks. Its zero value is not
// usable: [Wrap] makes one.
type Runtime struct {
	// On holds each method's hooks: r.On.FreeAsync hooks r.FreeAsync.
	On Hooks

	rt cudart.Runtime
}

var _ cudart.Runtime = (*Runtime)(nil)

// Wrap returns rt with its calls intercepted; with no hook yet, every call goes
// straight to rt.
func Wrap(rt cudart.Runtime) *Runtime {
	r := &Runtime{rt: rt}
	r.On.init(rt)
	return r
}

// Unwrap is the wrapped runtime.
func (r *Runtime) Unwrap() cudart.Runtime { return r.rt }

// Methods is every method's hooks, in cudart.Runtime's order.
func (r *Runtime) Methods() []Method { return r.On.methods() }

// Calls is how many calls of every method the runtime has seen, failed ones included.
func (r *Runtime) Calls() int64 {
	var n int64
	for _, m := range r.Methods() {
		n += m.Calls()
	}
	return n
}

// Method is what the hooks of every method have, whatever its types.
type Method interface {
	// Name is the cudart.Runtime method's name ("FreeAsync").
	Name() string
	// Calls is how many calls of the method the runtime has seen, failed ones
	// included.
	Calls() int64
	// Fail makes the next n calls of the method that reach this hook fail with err,
	// without running the rest of the chain (n < 0: every call from now on). It
	// returns how many of those calls are still to come. A method that returns no
	// error (Name) cannot fail: its calls run.
	Fail(n int, err error) (left func() int)
	// Once runs f before the first call of the method that reaches this hook, and
	// nothing after; calls made while f runs wait for it.
	Once(f func())
}

// hooks is the chain of one method, of type F: its hooks wrapped around the wrapped
// runtime's method.
type hooks[F any] struct {
	name  string
	pre   func(func() error) // adds a Before hook that does not look at the arguments
	calls atomic.Int64
	cur   atomic.Pointer[F] // the hooks' composition, or the runtime's method

	mu    sync.Mutex
	base  F                // the wrapped runtime's method
	wraps []func(next F) F // in the order added, guarded by mu
}

// init makes the chain base alone; pre adds a hook that runs before the arguments'.
func (h *hooks[F]) init(name string, base F, pre func(func() error)) {
	h.name, h.base, h.pre = name, base, pre
	h.cur.Store(&base)
}

// add puts w innermost, between the hooks added so far and the runtime.
func (h *hooks[F]) add(w func(next F) F) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.wraps = append(h.wraps, w)
	c := h.base
	for i := len(h.wraps) - 1; i >= 0; i-- {
		c = h.wraps[i](c)
	}
	h.cur.Store(&c)
}

// chain counts a call and returns what runs it.
func (h *hooks[F]) chain() F {
	h.calls.Add(1)
	return *h.cur.Load()
}

func (h *hooks[F]) Name() string { return h.name }

func (h *hooks[F]) Calls() int64 { return h.calls.Load() }

func (h *hooks[F]) Fail(n int, err error) (left func() int) {
	var mu sync.Mutex
	h.pre(func() error {
		mu.Lock()
		defer mu.Unlock()
		if n == 0 {
			return nil
		}
		if n > 0 {
			n--
		}
		return err
	})
	return func() int {
		mu.Lock()
		defer mu.Unlock()
		return n
	}
}

func (h *hooks[F]) Once(f func()) {
	var once sync.Once
	h.pre(func() error {
		once.Do(f)
		return nil
	})
}

// zero is T's zero value, what a failed call returns beside its error.
func zero[T any]() (v T) { return v }

// Live is the set of handles (streams, events, pools) a runtime made and has not
// destroyed, as [TrackLive] follows them.
type Live[H comparable] struct {
	mu  sync.Mutex
	set map[H]bool
}

// TrackLive follows the handles that create's calls return (on success) until
// destroy's are called with one (as their second argument, after the device); a nil
// destroy keeps every handle made. create and destroy are a Runtime's hooks:
//
//	streams := intercept.TrackLive(&rt.On.StreamCreate, &rt.On.StreamDestroy)
func TrackLive[H comparable](create interface {
	After(func(H, error) (H, error))
}, destroy interface {
	Before(func(int, H) error)
}) *Live[H] {
	l := &Live[H]{set: map[H]bool{}}
	create.After(func(h H, err error) (H, error) {
		if err == nil {
			l.mu.Lock()
			l.set[h] = true
			l.mu.Unlock()
		}
		return h, err
	})
	if destroy != nil {
		destroy.Before(func(_ int, h H) error {
			l.mu.Lock()
			delete(l.set, h)
			l.mu.Unlock()
			return nil
		})
	}
	return l
}

// Len is how many handles are live.
func (l *Live[H]) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.set)
}

// Has reports whether h is live.
func (l *Live[H]) Has(h H) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.set[h]
}
