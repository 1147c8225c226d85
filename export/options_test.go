package export

import (
	"reflect"
	"testing"

	"github.com/stretchr/testify/assert"
)

// Each option satisfies exactly the option types of the sides it configures, so that a
// misplaced one (WithPushes given to Listen) does not compile.
func TestOptionsBelongToTheirSides(t *testing.T) {
	listen, dial, query := reflect.TypeFor[ListenOption](), reflect.TypeFor[DialOption](), reflect.TypeFor[QueryOption]()
	for _, c := range []struct {
		name                string
		opt                 any
		listen, dial, query bool
	}{
		{"WithPolicy", WithPolicy(Policy{}), true, false, false},
		{"WithAnnounce", WithAnnounce("/x"), true, false, false},
		{"WithoutAnnounce", WithoutAnnounce(), true, false, false},
		{"WithName", WithName("x"), true, false, false},
		{"WithPushes", WithPushes(0, nil), false, true, false},
		{"WithLogger", WithLogger(nil), true, true, true},
		{"WithHandshakeTimeout", WithHandshakeTimeout(0), true, true, true},
	} {
		typ := reflect.TypeOf(c.opt)
		assert.Equal(t, c.listen, typ.Implements(listen), "%s is a ListenOption", c.name)
		assert.Equal(t, c.dial, typ.Implements(dial), "%s is a DialOption", c.name)
		assert.Equal(t, c.query, typ.Implements(query), "%s is a QueryOption", c.name)
	}
}

// Compile-time: the shared options go to every side.
var (
	_ ListenOption = WithLogger(nil)
	_ DialOption   = WithLogger(nil)
	_ QueryOption  = WithHandshakeTimeout(0)
)
