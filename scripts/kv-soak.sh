#!/usr/bin/env bash
# kv-soak.sh runs the KV page pool's kill soak (cmd/kvpoold's TestKillSoak) for as long
# as asked: kvpoold with its keeper, its index and a host tier, three writer processes
# and a reader, a seeded schedule of SIGKILLs of kvpoold and of replicas, and every byte
# read under a lease that ended well checked against what its writer sealed. The slab
# starts with one step and grows under the writers; on the software device its free
# memory falls and rises on a seeded schedule, so that kvpoold gives chunks back
# (-min-free) under the kills too (not on a GPU: nothing makes its free memory fall).
# Seeds run one after another until DURATION (default 10m) has passed; a failing seed
# is named, and CUDAPOOL_KV_SOAK_SEED=N replays its schedule.
#
#	scripts/kv-soak.sh [DURATION]                 # here, on the software device (needs Go)
#	RUNTIME=gpu scripts/kv-soak.sh [DURATION]     # a GPU host: bin/gpu's cmd_kvpoold.test (build-gpu.sh)
#
# It prints the soak's summary (seeds, restarts, growths and give-backs, pages and bytes
# checked, wrong pieces) last, also to $OUT/kv-soak.txt when OUT is set, and exits non-zero on any wrong byte.
set -uo pipefail
cd "$(dirname "$0")/.."
duration=${1:-10m}
report=$(mktemp)
trap 'rm -f "$report"' EXIT
export CUDAPOOL_KV_SOAK=$duration CUDAPOOL_KV_SOAK_REPORT=$report
if [ "${RUNTIME:-test}" = gpu ]; then
	. scripts/unpack.sh
	unpack bin/gpu || exit 2
	export CUDAPOOL_KV_SOAK_RUNTIME=gpu CUDAPOOL_REQUIRE_GPU=1
	(cd cmd/kvpoold && ../../bin/gpu/cmd_kvpoold.test -test.run '^TestKillSoak$' -test.v -test.timeout 0) >"${OUT:-/tmp}/kv-soak.log" 2>&1
	rc=$?
else
	go test -count=1 -run '^TestKillSoak$' -v -timeout 0 ./cmd/kvpoold/ >"${OUT:-/tmp}/kv-soak.log" 2>&1
	rc=$?
fi
grep -E 'wrong page|seed [0-9]+:' "${OUT:-/tmp}/kv-soak.log" | tail -n 20
cat "$report"
[ -n "${OUT:-}" ] && cp "$report" "$OUT/kv-soak.txt"
exit $rc
