package e2e_test

import (
	"reflect"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/producer"
)

// Each option is of exactly the option type of the side it configures, so that a
// misplaced one (consumer.WithPushes given to Listen) does not compile.
func TestOptionsBelongToTheirSides(t *testing.T) {
	listen, dial, query := reflect.TypeFor[producer.ListenOption](), reflect.TypeFor[consumer.DialOption](), reflect.TypeFor[discover.QueryOption]()
	for _, c := range []struct {
		name                string
		opt                 any
		listen, dial, query bool
	}{
		{"WithPolicy", producer.WithPolicy(export.Policy{}), true, false, false},
		{"WithAnnounceDir", producer.WithAnnounceDir("/x"), true, false, false},
		{"WithoutAnnounce", producer.WithoutAnnounce(), true, false, false},
		{"WithName", producer.WithName("x"), true, false, false},
		{"WithPushes", consumer.WithPushes(nil, 0), false, true, false},
		{"WithLogger", producer.WithLogger(nil), true, false, false},
		{"consumer.WithLogger", consumer.WithLogger(nil), false, true, false},
		{"discover.WithLogger", discover.WithLogger(nil), false, false, true},
		{"WithHandshakeTimeout", producer.WithHandshakeTimeout(0), true, false, false},
		{"consumer.WithHandshakeTimeout", consumer.WithHandshakeTimeout(0), false, true, false},
		{"discover.WithHandshakeTimeout", discover.WithHandshakeTimeout(0), false, false, true},
	} {
		typ := reflect.TypeOf(c.opt)
		assert.Equal(t, c.listen, (typ == listen), "%s is a ListenOption", c.name)
		assert.Equal(t, c.dial, (typ == dial), "%s is a DialOption", c.name)
		assert.Equal(t, c.query, (typ == query), "%s is a QueryOption", c.name)
	}
}
