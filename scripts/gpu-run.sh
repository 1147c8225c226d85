#!/usr/bin/env bash
# gpu-run.sh is the whole of one call on a GPU host, from the repository root, with
# what scripts/build-gpu.sh built: scripts/gpu-check.sh's tests (BENCH=0, its own
# benchmark loop left to the suite), then scripts/bench-suite.sh, whose tables come
# last (the targets at the very end). The suite gets what is left of RUN_BUDGET
# (default 420) seconds, so the call ends within about eight minutes. Everything it
# prints is also in $OUT/gpu-run.txt, and the suite's raw samples are in
# $OUT/bench-raw.txt and its tables in $OUT/RESULTS.md, when OUT is set. It
# exits non-zero if the tests or the suite failed.
set -uo pipefail
cd "$(dirname "$0")/.."
run_budget=${RUN_BUDGET:-420}
log=${OUT:-/tmp}/gpu-run.txt
{
	BENCH=0 TESTS_BUDGET=${TESTS_BUDGET:-100} bash scripts/gpu-check.sh
	check=$?
	echo "== gpu-check exit status $check at ${SECONDS}s; the suite gets $((run_budget - SECONDS - 20))s"
	# The tables and the tarball need some seconds after the suite's budget.
	SUITE_BUDGET=$((run_budget - SECONDS - 20)) bash scripts/bench-suite.sh
	suite=$?
	[ $check -eq 0 ] && [ $suite -eq 0 ]
} 2>&1 | tee "$log"
