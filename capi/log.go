package main

/*
#include <stdlib.h>
#include "cp.h"
*/
import "C"

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"unsafe"
)

// The library's log: the events no call returns (a connection refused or cut, cleanup
// that failed), from every package of the library, go to the sink cudapool_set_log
// chose, at the level it set, and nowhere before it is called: a library writes
// nothing on its host's stderr unasked.
var (
	logLevel slog.LevelVar
	logger   = slog.New(logHandler{build: func(w io.Writer) slog.Handler {
		return slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug, ReplaceAttr: dropTime})
	}})
)

// logOff is CUDAPOOL_LOG_OFF: above every level slog has.
const logOff = 127

func init() {
	logLevel.Set(logOff)
	slog.SetDefault(logger) // also what the standard log package prints
}

func dropTime(groups []string, a slog.Attr) slog.Attr {
	if len(groups) == 0 && a.Key == slog.TimeKey {
		return slog.Attr{}
	}
	return a
}

// logHandler formats a record as slog's text handler does, one line, and hands it to
// cp_log with its level.
type logHandler struct {
	build func(io.Writer) slog.Handler // the text handler, with the attrs and groups added so far
}

func (h logHandler) Enabled(_ context.Context, l slog.Level) bool { return l >= logLevel.Level() }

func (h logHandler) Handle(ctx context.Context, r slog.Record) error {
	var b bytes.Buffer
	if err := h.build(&b).Handle(ctx, r); err != nil {
		return err
	}
	msg := C.CString(string(bytes.TrimRight(b.Bytes(), "\n")))
	defer C.free(unsafe.Pointer(msg))
	C.cp_log(C.int(r.Level), msg)
	return nil
}

func (h logHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return logHandler{build: func(w io.Writer) slog.Handler { return h.build(w).WithAttrs(as) }}
}

func (h logHandler) WithGroup(name string) slog.Handler {
	return logHandler{build: func(w io.Writer) slog.Handler { return h.build(w).WithGroup(name) }}
}

// cpgo_set_log_level sets the level; cudapool_set_log checked it.
//
//export cpgo_set_log_level
func cpgo_set_log_level(level C.int) (rc C.int) {
	defer recoverTo(&rc)
	logLevel.Set(slog.Level(level))
	return statusOK
}
