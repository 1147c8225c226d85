// expect.h holds the checks that abi.c and kv.c count: EXPECT compares a call's status
// with the one wanted and wants a message beside every status but CUDAPOOL_OK; CHECK and
// CHECKF count a condition. Each failed check prints one line; main reports the counts.
#ifndef CUDAPOOL_TESTDATA_EXPECT_H
#define CUDAPOOL_TESTDATA_EXPECT_H

#include <stdio.h>

#include "cudapool.h"

static int checks, failures;

static void expect(const char *what, int line, int got, int want) {
	checks++;
	const char *msg = cudapool_last_error();
	if (got != want) {
		fprintf(stderr, "line %d: %s = %s (%s), want %s\n", line, what, cudapool_status_name(got), msg,
		        cudapool_status_name(want));
		failures++;
	} else if (want != CUDAPOOL_OK && msg[0] == 0) {
		fprintf(stderr, "line %d: %s = %s without a message\n", line, what, cudapool_status_name(got));
		failures++;
	}
}

static inline void check(const char *what, int line, int ok) {
	checks++;
	if (!ok) {
		fprintf(stderr, "line %d: %s is false\n", line, what);
		failures++;
	}
}

#define EXPECT(call, want) expect(#call, __LINE__, (call), (want))

// CHECK counts a check of a condition; a failure prints the condition.
#define CHECK(cond) check(#cond, __LINE__, (cond))

// CHECKF counts a check of a condition; a failure prints the printf message after it.
#define CHECKF(cond, ...) \
	do { \
		checks++; \
		if (!(cond)) { \
			fprintf(stderr, "line %d: ", __LINE__); \
			fprintf(stderr, __VA_ARGS__); \
			fprintf(stderr, "\n"); \
			failures++; \
		} \
	} while (0)

#endif
