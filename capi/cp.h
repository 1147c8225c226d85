// cp.h declares what the Go half and the C half of libcudapool share beyond the
// public cudapool.h. Only declarations: the Go files that //export functions include
// it, and cgo forbids definitions there.
#ifndef CP_H
#define CP_H
#include "cudapool.h"

// cp_set_error sets this thread's last error message (copied, cut to fit).
void cp_set_error(const char *msg, size_t n);

// cp_log hands one message to the sink cudapool_set_log chose (its function, else
// stderr).
void cp_log(int level, const char *msg);

// The process's environment as it is now: the Go runtime's copy is the one the
// process started with.
extern char **environ;
#endif
