// Package exporttest owns what the tests of packages producer, consumer, discover and
// export/e2e share: simulated processes on the software device (Side, Producer,
// Consumer), a raw peer that speaks frames directly (RawPeer), in-memory listeners,
// the child processes the tests start (Roles, for proctest.Main), and the runtimes
// that count or steer CUDA calls. Only tests import it; it uses the packages' public
// API alone, so that each side's tests keep to their own folder (an export_test.go
// there shows them what they need of its insides).
package exporttest
