// Package discover owns how tools find cudapool exporters on a host and read their
// state: the announce directory ([DefaultDir]) where each exporter writes <pid>.json while
// it listens, [Discover], which lists and checks those announcements, and [QueryState],
// which asks a live exporter for its State as an observer (a connection that takes no
// leases) admitted by the exporter's policy like any consumer. State is the stable JSON
// schema cmd/poolstat prints and serves.
//
// # Caveats
//
// An announcement says only that an exporter was there: Discover marks it Live only
// when its process exists and its socket answers. The announce directory must be
// private to the user ([ErrBadDir] otherwise); under the temp directory another user can
// create the default one first.
package discover
