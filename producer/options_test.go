package producer

import (
	"reflect"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/cudapool/cudapool/consumer"
	"github.com/cudapool/cudapool/discover"
)

// Each option satisfies exactly the option type of the side it configures, so that a
// misplaced one (consumer.WithPushes given to Listen) does not compile.
func TestOptionsBelongToTheirSides(t *testing.T) {
	listen, dial, query := reflect.TypeFor[ListenOption](), reflect.TypeFor[consumer.DialOption](), reflect.TypeFor[discover.QueryOption]()
	for _, c := range []struct {
		name                string
		opt                 any
		listen, dial, query bool
	}{
		{"WithPolicy", WithPolicy(Policy{}), true, false, false},
		{"WithAnnounce", WithAnnounce("/x"), true, false, false},
		{"WithoutAnnounce", WithoutAnnounce(), true, false, false},
		{"WithName", WithName("x"), true, false, false},
		{"WithPushes", consumer.WithPushes(0, nil), false, true, false},
		{"WithLogger", WithLogger(nil), true, false, false},
		{"consumer.WithLogger", consumer.WithLogger(nil), false, true, false},
		{"discover.WithLogger", discover.WithLogger(nil), false, false, true},
		{"WithHandshakeTimeout", WithHandshakeTimeout(0), true, false, false},
		{"consumer.WithHandshakeTimeout", consumer.WithHandshakeTimeout(0), false, true, false},
		{"discover.WithHandshakeTimeout", discover.WithHandshakeTimeout(0), false, false, true},
	} {
		typ := reflect.TypeOf(c.opt)
		assert.Equal(t, c.listen, typ.Implements(listen), "%s is a ListenOption", c.name)
		assert.Equal(t, c.dial, typ.Implements(dial), "%s is a DialOption", c.name)
		assert.Equal(t, c.query, typ.Implements(query), "%s is a QueryOption", c.name)
	}
}

// Compile-time: each side has its own logger and handshake bound.
var (
	_ ListenOption         = WithLogger(nil)
	_ consumer.DialOption  = consumer.WithLogger(nil)
	_ discover.QueryOption = discover.WithHandshakeTimeout(0)
)
