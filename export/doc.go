// Package export owns what both sides of the sharing protocol have in common: the
// sentinel errors that an exporter (package producer) and an importer (package
// consumer) meet alike, and [RemoteError], the form of an exporter's refusal; the
// protocol's version and limits; [Policy], which says whom an exporter admits; and
// [State], the stable description of a running exporter that package discover reads
// and cmd/poolstat prints.
//
// The sides live below it: export/producer (the exporter), export/consumer (the
// importer), export/discover (announcements and [State] for tools) and
// export/internal/wire (the frames both speak, docs/PROTOCOL.md). Each side's own
// errors stay in its package (producer.ErrNameInUse, consumer.ErrMappingLost, ...);
// every error either side returns about one of the conditions below wraps the sentinel
// here, so one [errors.Is] check serves both sides.
//
// Closing and releasing follow one rule in Go, C and Python: a second Close changes
// nothing (it returns [ErrClosed] here, CUDAPOOL_EHANDLE in C, which a caller may
// ignore; Python returns None); a second Release of what was leased is a bug and fails
// everywhere (consumer.ErrReleased here, CUDAPOOL_EHANDLE in C, InvalidHandle in
// Python).
package export
