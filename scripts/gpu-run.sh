#!/usr/bin/env bash
# gpu-run.sh is the whole of one call on a GPU host, from the repository root, with
# what scripts/build-gpu.sh built: scripts/gpu-check.sh's tests (BENCH=0, its own
# benchmark loop left to the suite), then scripts/bench-suite.sh, whose table comes
# last. The suite gets what is left of RUN_BUDGET (default 400) seconds, so the call
# ends within about seven minutes. Everything it prints is also in $OUT/gpu-run.txt
# when OUT is set. It exits non-zero if the tests or the suite failed.
set -uo pipefail
cd "$(dirname "$0")/.."
run_budget=${RUN_BUDGET:-400}
log=${OUT:-/tmp}/gpu-run.txt
{
	BENCH=0 TESTS_BUDGET=${TESTS_BUDGET:-100} bash scripts/gpu-check.sh
	check=$?
	echo "== gpu-check exit status $check at ${SECONDS}s"
	# The table and the tarball need some seconds after the suite's budget.
	SUITE_BUDGET=$((run_budget - SECONDS - 20)) bash scripts/bench-suite.sh
	suite=$?
	echo "== bench-suite exit status $suite at ${SECONDS}s"
	[ $check -eq 0 ] && [ $suite -eq 0 ]
} 2>&1 | tee "$log"
