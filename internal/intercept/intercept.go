// Package intercept owns the one way tests steer a cudart.Runtime's calls: Wrap a
// runtime, then fail, count, stall or watch its calls by method name, before or after
// the wrapped runtime runs them. It replaces the hand-written decorators (one struct
// per test that embedded cudart.Runtime and overrode a method or two).
//
// A call that no hook watches goes straight to the wrapped runtime: no Call is made
// and nothing is allocated; Calls counts it all the same.
package intercept

import (
	"sync"
	"sync/atomic"

	"github.com/cudapool/cudapool/cudart"
)

// Any matches every method in Before and After.
const Any = "*"

// Call is one call of a Runtime method, as the hooks see it.
type Call struct {
	// Method is the cudart.Runtime method's name ("FreeAsync").
	Method string
	// Args are the call's arguments, in order (a Runtime's dev first where it has one).
	// A Before hook may replace them (with values of the same types): the runtime is
	// called with what they are after the Before hooks.
	Args []any
	// Results are the wrapped runtime's results but the error, in order; nil when a
	// Before hook's Err kept the call from running. An After hook may replace them
	// (with values of the same types).
	Results []any
	// Err is the call's error: a Before hook that sets it fails the call without
	// running it; an After hook sees the runtime's and may replace it. Name, which
	// returns no error, ignores it.
	Err error

	ran      bool // the wrapped runtime was called
	answered bool // a Before hook answered for the runtime (Answer)
}

// Answer, from a Before hook, answers the call instead of the runtime: it is not run,
// and returns results (of the method's types, in order; fewer leave zero values) with
// c.Err.
func (c *Call) Answer(results ...any) {
	c.answered = true
	c.Results = results
}

// Dev is the call's first argument as a device ordinal, -1 if it has none.
func (c *Call) Dev() int {
	if len(c.Args) > 0 {
		if d, ok := c.Args[0].(int); ok {
			return d
		}
	}
	return -1
}

// Hook is run for a call; see Call for what it may change (Err, Results, Answer).
type Hook func(c *Call)

// Runtime is a cudart.Runtime whose calls go through hooks. Its zero value is not
// usable: Wrap makes one. Hooks may be added while calls run, from any goroutine.
type Runtime struct {
	// Runtime is the wrapped runtime; a method this package does not intercept yet
	// reaches it directly (TestEveryMethodIsIntercepted fails while there is one).
	cudart.Runtime

	mu   sync.Mutex
	pre  map[string][]Hook // Before's, guarded by mu
	post map[string][]Hook // After's, guarded by mu
	// watched is the set of methods with a hook (Any for all): replaced, never
	// changed, so a call reads it without the lock.
	watched atomic.Pointer[map[string]bool]
	counts  map[string]*atomic.Int64 // every method, made by Wrap
}

// Wrap returns rt with its calls intercepted; with no hook yet, every call goes
// straight to rt.
func Wrap(rt cudart.Runtime) *Runtime {
	r := &Runtime{Runtime: rt, pre: map[string][]Hook{}, post: map[string][]Hook{}, counts: map[string]*atomic.Int64{}}
	for _, m := range methods {
		r.counts[m] = new(atomic.Int64)
	}
	r.watched.Store(&map[string]bool{})
	return r
}

// Unwrap is the wrapped runtime.
func (r *Runtime) Unwrap() cudart.Runtime { return r.Runtime }

// Before runs h before each call of method (Any: of every method), in the order the
// hooks were added. A hook that sets c.Err fails the call without running it. It
// panics on a name that is no cudart.Runtime method: a misspelt hook would never run.
func (r *Runtime) Before(method string, h Hook) { r.add(r.pre, method, h) }

// After runs h after each call of method (Any: of every method) that a Before hook did
// not fail, seeing the runtime's results and error.
func (r *Runtime) After(method string, h Hook) { r.add(r.post, method, h) }

func (r *Runtime) add(set map[string][]Hook, method string, h Hook) {
	if _, ok := r.counts[method]; !ok && method != Any {
		panic("intercept: no cudart.Runtime method " + method + " is intercepted")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	set[method] = append(set[method], h)
	w := map[string]bool{}
	for m := range *r.watched.Load() {
		w[m] = true
	}
	w[method] = true
	r.watched.Store(&w)
}

// Fail makes the next n calls of method fail with err, without running them (n < 0:
// every call from now on). It returns how many of those calls are still to come.
func (r *Runtime) Fail(method string, n int, err error) (left func() int) {
	var mu sync.Mutex
	r.Before(method, func(c *Call) {
		mu.Lock()
		defer mu.Unlock()
		if n != 0 && c.Err == nil {
			if n > 0 {
				n--
			}
			c.Err = err
		}
	})
	return func() int {
		mu.Lock()
		defer mu.Unlock()
		return n
	}
}

// Calls is how many calls of method the runtime has seen, failed ones included.
func (r *Runtime) Calls(method string) int64 {
	c, ok := r.counts[method]
	if !ok {
		panic("intercept: no cudart.Runtime method " + method + " is intercepted")
	}
	return c.Load()
}

// watches counts a call of m and reports whether a hook watches it.
func (r *Runtime) watches(m string) bool {
	r.counts[m].Add(1)
	w := *r.watched.Load()
	return w[m] || w[Any]
}

func (r *Runtime) hooks(set map[string][]Hook, m string) []Hook {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append(append([]Hook(nil), set[Any]...), set[m]...)
}

// call is the Call of m with args, after the Before hooks.
func (r *Runtime) call(m string, args ...any) *Call {
	c := &Call{Method: m, Args: args}
	for _, h := range r.hooks(r.pre, m) {
		h(c)
	}
	return c
}

// done runs the After hooks on c, if the call ran.
func (r *Runtime) done(c *Call) {
	if !c.ran {
		return // failed by a Before hook
	}
	for _, h := range r.hooks(r.post, c.Method) {
		h(c)
	}
}

// arg is c's i-th argument as a T (a Before hook may have replaced it).
func arg[T any](c *Call, i int) T {
	v, _ := c.Args[i].(T)
	return v
}

// result is c's i-th result as a T: the zero T when the call did not run.
func result[T any](c *Call, i int) T {
	var zero T
	if i >= len(c.Results) {
		return zero
	}
	v, _ := c.Results[i].(T)
	return v
}

var _ cudart.Runtime = (*Runtime)(nil)

// Once is a hook that runs f at the first call it sees, and does nothing after.
func Once(f func()) Hook {
	var once sync.Once
	return func(*Call) { once.Do(f) }
}

// Live is the set of handles (streams, events, pools) a runtime made and has not
// destroyed, as TrackLive follows them.
type Live[H comparable] struct {
	mu  sync.Mutex
	set map[H]bool
}

// TrackLive follows the handles that rt's create method returns (its first result, on
// success) until its destroy method is called with one (as its second argument, after
// the device); destroy "" keeps every handle made.
func TrackLive[H comparable](rt *Runtime, create, destroy string) *Live[H] {
	l := &Live[H]{set: map[H]bool{}}
	rt.After(create, func(c *Call) {
		if h, ok := c.Results[0].(H); ok && c.Err == nil {
			l.mu.Lock()
			l.set[h] = true
			l.mu.Unlock()
		}
	})
	if destroy != "" {
		rt.Before(destroy, func(c *Call) {
			if h, ok := c.Args[1].(H); ok {
				l.mu.Lock()
				delete(l.set, h)
				l.mu.Unlock()
			}
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
