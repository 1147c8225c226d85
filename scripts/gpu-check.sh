#!/usr/bin/env bash
# gpu-check.sh runs on a GPU host, from the repository root, with what
# scripts/build-gpu.sh built elsewhere in bin/gpu (the host needs no Go). It prints
# the host's GPUs, runs every test binary with CUDAPOOL_REQUIRE_GPU=1 (so a test
# that cannot reach a GPU fails rather than skips), then every benchmark, then the C
# reference bench/cref (built here with nvcc) just before the benchmarks, and prints
# LAST a table: each test
# binary PASS or FAIL, and each benchmark's Go ns/op beside C's and their ratio.
# It exits non-zero if anything failed. It changes no GPU setting.
#
# On a host with one GPU the tests that need two are skipped and listed as "not run
# (needs 2 GPUs)" beside their binary's PASS; CUDAPOOL_REQUIRE_GPUS=2 in the
# environment demands two GPUs and fails them instead (internal/gputest).
#
# After the tests, the step kvpoold-keeper (keeper_check below) starts bin/gpu/kvpoold
# on a small slab and asks nvidia-smi whether its keeper holds GPU memory (it must not:
# issue 30), then SIGKILLs kvpoold and checks that the next one adopts the keeper's
# slab. CHECK_ONLY=kvpoold-keeper runs that step alone, with KVPOOLD (default
# bin/gpu/kvpoold) on KVPOOLD_RUNTIME (default gpu): scripts/gpu-check-test.sh runs it
# on the software device against a fake nvidia-smi.
#
# Environment: BENCH=0 runs the tests alone (scripts/gpu-run.sh runs the benchmark
# suite after them instead); BENCHTIME (default 1s) and BENCHCOUNT (default 3) for the Go
# benchmarks, whose ns/op is the median of the counts; TEST_TIMEOUT (default 90s) per
# test binary; TESTS_BUDGET (default 200) seconds after which no further test binary
# starts (it is reported NOT-RUN), and BENCH_BUDGET (default 330) the same for
# benchmark binaries, so that the table still comes within a run of about 6 minutes. Logs go to $OUT/gpu-check when OUT is set, else
# /tmp/gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bin=$root/bin/gpu
benchtime=${BENCHTIME:-1s}
benchcount=${BENCHCOUNT:-3}
run_benches=${BENCH:-1}
test_timeout=${TEST_TIMEOUT:-90s}
tests_budget=${TESTS_BUDGET:-180}
bench_budget=${BENCH_BUDGET:-300}
logs=/tmp/gpu-check
rm -rf "$logs"
mkdir -p "$logs"
export CUDAPOOL_REQUIRE_GPU=1
# cmd/kvpoold's kill soak (TestKillSoak: kvpoold, its keeper and replica processes
# SIGKILLed on a seeded schedule, every byte read checked) runs its processes on the GPU
# here; scripts/kv-soak.sh runs it for longer.
export CUDAPOOL_KV_SOAK_RUNTIME=gpu
failed=0
results=()

# await_line FILE PATTERN PID SECONDS waits until a line of FILE matches PATTERN (grep
# -E), while process PID lives, for at most SECONDS; it says why it stopped waiting.
await_line() {
	local i
	for ((i = 0; i < $4 * 10; i++)); do
		grep -qE "$2" "$1" 2>/dev/null && return 0
		kill -0 "$3" 2>/dev/null || { grep -qE "$2" "$1" 2>/dev/null && return 0; echo "it exited before saying /$2/"; return 1; }
		sleep 0.1
	done
	echo "it did not say /$2/ within $4 s"
	return 1
}

# alive PID says whether process PID lives: exists and is no zombie (a keeper whose
# kvpoold was SIGKILLed is reaped by whoever adopted it, if at all).
alive() {
	local stat
	stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
	stat=${stat##*) }
	[ "${stat%% *}" != Z ]
}

# smi_check WHO KEEPER KVPOOLD says whether nvidia-smi lists the keeper among the
# compute apps (it must not: it holds the chunks' descriptors and no CUDA context) and
# kvpoold (it must, when WHO is "while kvpoold runs", or the keeper's absence proves nothing):
# "pass WHY", "fail WHY" or "none WHY" (nvidia-smi sees no process of ours, as in a
# pid namespace of its own). Where no pid matches, the processes named like kvpoold's
# executable are counted instead (the keeper runs the same one): one is kvpoold.
smi_check() {
	local who=$1 keeper=$2 kvpoold=$3 apps line mine=0 named=0 name
	if ! apps=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>&1); then
		echo "fail nvidia-smi --query-compute-apps failed: $apps"
		return
	fi
	echo "$apps" >>"$logs/kvpoold-keeper.log"
	name=$(basename "$kvpoold_bin")
	while IFS=, read -r pid pname used; do
		pid=${pid// /}
		case $pid in
		"$keeper") echo "fail nvidia-smi lists the keeper (pid $keeper) with$used of GPU memory $who"; return ;;
		"$kvpoold") mine=1 ;;
		esac
		[ "$(basename "${pname# }")" = "$name" ] && named=$((named + 1))
	done <<<"$apps"
	if [ "$who" != "while kvpoold runs" ]; then
		echo "pass nvidia-smi does not list the keeper (pid $keeper) $who"
	elif [ $mine = 1 ]; then
		echo "pass nvidia-smi lists kvpoold (pid $kvpoold) and not its keeper (pid $keeper)"
	elif [ $named = 1 ]; then
		echo "pass nvidia-smi lists no pid of ours (another pid namespace) but one $name process: kvpoold's, none for its keeper"
	elif [ $named -gt 1 ]; then
		echo "fail nvidia-smi lists no pid of ours (another pid namespace) but $named $name processes: the keeper has a CUDA context"
	else
		echo "none nvidia-smi lists neither kvpoold (pid $kvpoold) nor any $name process, so the keeper's absence proves nothing"
	fi
}

# keeper_check is the step kvpoold-keeper (issue 30): kvpoold on a small slab, its
# keeper (its first line names it) not among nvidia-smi's compute apps while kvpoold is,
# nor once kvpoold is SIGKILLed; the next kvpoold adopts the keeper's slab; a clean stop
# then stops both. Its log is $logs/kvpoold-keeper.log.
keeper_check() {
	local step=kvpoold-keeper dir out pid pid2 keeper= verdict why why2
	if ! command -v nvidia-smi >/dev/null; then
		results+=("$step not run (no nvidia-smi)")
		return
	fi
	kvpoold_bin=${KVPOOLD:-$bin/kvpoold}
	if [ ! -x "$kvpoold_bin" ]; then
		results+=("$step FAIL(no $kvpoold_bin: run scripts/build-gpu.sh first)")
		failed=1
		return
	fi
	echo "== $step: $kvpoold_bin -runtime $kvpoold_runtime"
	dir=$(mktemp -d)
	out=$logs/$step.log
	: >"$out"
	local args=(-runtime "$kvpoold_runtime" -dir "$dir" -layout llama-0.85b -bytes 1GiB -reattach-grace 1s)
	"$kvpoold_bin" "${args[@]}" >"$dir/first.txt" 2>>"$out" &
	pid=$!
	verdict=fail
	if ! why=$(await_line "$dir/first.txt" '^kvpoold: serving' $pid 60); then
		why="kvpoold: $why"
	elif ! keeper=$(sed -nE 's/.*new cache in keeper pid ([0-9]+).*/\1/p' "$dir/first.txt") || [ -z "$keeper" ]; then
		why="kvpoold's first line names no new keeper: $(head -c 300 "$dir/first.txt")"
	elif ! alive "$keeper"; then
		why="the keeper (pid $keeper) is not alive"
	else
		why=$(smi_check "while kvpoold runs" "$keeper" $pid)
		verdict=${why%% *}
		why=${why#* }
	fi
	cat "$dir/first.txt" >>"$out"
	kill -KILL $pid 2>/dev/null
	wait $pid 2>/dev/null
	if [ "$verdict" != fail ]; then
		# kvpoold is gone: the keeper's descriptors alone keep the slab; still no context.
		local after
		after=$(smi_check "with kvpoold SIGKILLed" "$keeper" $pid)
		if [ "${after%% *}" = fail ]; then verdict=fail why=${after#* }; fi
	fi
	if [ "$verdict" != fail ]; then
		"$kvpoold_bin" "${args[@]}" >"$dir/second.txt" 2>>"$out" &
		pid2=$!
		if ! why2=$(await_line "$dir/second.txt" '^kvpoold: serving' $pid2 60); then
			verdict=fail why="kvpoold started again after the SIGKILL: $why2"
		elif ! grep -q "cache adopted from keeper pid $keeper" "$dir/second.txt"; then
			verdict=fail why="kvpoold started again did not adopt the keeper (pid $keeper)'s slab: $(head -c 300 "$dir/second.txt")"
		else
			why="$why; kvpoold SIGKILLed, the next adopted its slab"
		fi
		cat "$dir/second.txt" >>"$out"
		kill -TERM $pid2 2>/dev/null
		if ! await_line "$dir/second.txt" '^kvpoold: stopped' $pid2 30 >/dev/null; then
			verdict=fail why="$why; kvpoold did not stop cleanly on SIGTERM"
			kill -KILL $pid2 2>/dev/null
		fi
		wait $pid2 2>/dev/null
	fi
	# What is left of ours: a keeper that a clean stop did not stop.
	if [ -n "$keeper" ] && alive "$keeper"; then
		sleep 1
		if alive "$keeper"; then
			[ "$verdict" != fail ] && verdict=fail why="$why; the keeper (pid $keeper) outlived kvpoold's clean stop"
			kill -KILL "$keeper" 2>/dev/null
		fi
	fi
	rm -rf "$dir"
	echo "$step: $verdict: $why"
	case $verdict in
	pass) results+=("$step PASS: $why") ;;
	none) results+=("$step not run ($why)") ;;
	*)
		results+=("$step FAIL($why)")
		failed=1
		;;
	esac
}

# print_results prints each step's verdict, a line each.
print_results() {
	printf '%s\n' "${results[@]}" | awk '{ name = $1; sub(/^[^ ]+ /, ""); printf "%-28s %s\n", name, $0 }'
}

kvpoold_runtime=${KVPOOLD_RUNTIME:-gpu}
if [ -n "${CHECK_ONLY:-}" ]; then
	if [ "$CHECK_ONLY" != kvpoold-keeper ]; then
		echo "gpu-check: CHECK_ONLY=$CHECK_ONLY: the one step that runs alone is kvpoold-keeper" >&2
		exit 2
	fi
	if [ -z "${KVPOOLD:-}" ]; then
		. scripts/unpack.sh
		unpack "$bin" || exit 2
	fi
	keeper_check
	echo
	echo "== summary (${SECONDS}s)"
	print_results
	exit $failed
fi

# build-gpu.sh compresses the binaries for the journey; unpack them once.
. scripts/unpack.sh
unpack "$bin" || exit 2
if [ ! -s "$bin/tests.txt" ]; then
	echo "gpu-check: no $bin/tests.txt; run scripts/build-gpu.sh first" >&2
	exit 2
fi

echo "== host"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,pci.bus_id --format=csv
nvidia-smi | sed -n '3p'
nvidia-smi topo -m 2>/dev/null | head -n 4

echo "== C reference: build"
cref=/tmp/cudapool-cref
if ! nvcc -O2 -cudart shared -o "$cref" bench/cref/cref.cu; then
	results+=("cref FAIL(build)")
	failed=1
	cref=
fi

echo "== tests"
while read -r name dir; do
	if [ "$SECONDS" -ge "$tests_budget" ]; then
		results+=("$name NOT-RUN(time)")
		failed=1
		continue
	fi
	log=$logs/$name.test.log
	(cd "$root/$dir" && "$bin/$name.test" -test.v -test.count=1 -test.timeout="$test_timeout") >"$log" 2>&1
	rc=$?
	# The tests skipped for want of GPUs, by name: the last test that the log said ran
	# when the skip's line came (go test -v streams each test's output).
	notrun=$(awk '
		/^=== (RUN|CONT|NAME) / { test = $3 }
		match($0, /not run \(needs [0-9]+ GPUs\)/) { need[substr($0, RSTART, RLENGTH)] = need[substr($0, RSTART, RLENGTH)] " " test }
		END { for (n in need) printf "%s:%s; ", n, need[n] }
	' "$log")
	if [ $rc -eq 0 ]; then
		results+=("$name PASS${notrun:+, ${notrun%; }}")
	else
		results+=("$name FAIL(rc=$rc)")
		failed=1
		echo "--- $name.test failed (rc=$rc); the end of its log:"
		grep -E '^\s*(--- FAIL|FAIL|panic:)|_test\.go:[0-9]+:' "$log" | tail -n 40
	fi
	echo "$name: rc=$rc at ${SECONDS}s, $(grep -c -- '--- PASS' "$log") passed, $(grep -c -- '--- SKIP' "$log") skipped, $(grep -c -- '--- FAIL' "$log") failed"
done <"$bin/tests.txt"

keeper_check

# Pinned to the same few CPUs, C and Go see the same cores and caches.
pin=()
if command -v taskset >/dev/null && [ "$(nproc)" -ge 12 ]; then
	pin=(taskset -c 2-9)
fi
creflog=$logs/cref.txt
: >"$creflog"
# run_cref runs the C reference once, appending its lines to $creflog.
run_cref() {
	echo "== C reference: run $1 ${pin[*]}"
	[ -n "$cref" ] || return
	# "cref bench" prints cudart's benchmark lines: "cref NAME NS".
	if "${pin[@]}" "$cref" bench >"$logs/cref-$1.txt"; then
		grep '^cref ' "$logs/cref-$1.txt" | tee -a "$creflog"
		results+=("cref-$1 PASS")
	else
		results+=("cref-$1 FAIL")
		failed=1
	fi
}

if [ "$run_benches" = 1 ]; then
run_cref 1
echo "== benchmarks (benchtime $benchtime, count $benchcount)"
benchlog=$logs/bench.txt
: >"$benchlog"
while read -r name dir; do
	list=$("$bin/$name.test" -test.list '^Benchmark' 2>/dev/null)
	[[ $list == *Benchmark* ]] || continue
	if [ "$SECONDS" -ge "$bench_budget" ]; then
		results+=("$name-benchmarks NOT-RUN(time)")
		failed=1
		continue
	fi
	log=$logs/$name.bench.log
	(cd "$root/$dir" && "${pin[@]}" "$bin/$name.test" -test.run '^$' -test.bench . -test.benchmem \
		-test.benchtime="$benchtime" -test.count="$benchcount" -test.timeout="$test_timeout") >"$log" 2>&1
	rc=$?
	sed -n "s/^Benchmark/$name /p" "$log" | tee -a "$benchlog"
	if [ $rc -ne 0 ]; then
		results+=("$name-benchmarks FAIL(rc=$rc)")
		failed=1
		tail -n 20 "$log"
	fi
done <"$bin/tests.txt"

run_cref 2
fi

echo
echo "== summary (${SECONDS}s)"
print_results
if [ "$run_benches" = 1 ]; then
echo
# Go lines: "PKG NAME-PROCS N NS ns/op [LATE late-ns/op] ..."; C lines: "cref NAME NS".
# Each Go figure is the median over the counts; C's is the mean of the two runs. A
# benchmark only C has is listed too.
awk '
	function median(key, m,    i, j, t, s) {
		for (i = 1; i <= m; i++) s[i] = vals[key, i]
		for (i = 2; i <= m; i++) for (j = i; j > 1 && s[j-1] + 0 > s[j] + 0; j--) { t = s[j]; s[j] = s[j-1]; s[j-1] = t }
		return (m % 2) ? s[(m + 1) / 2] : (s[m / 2] + s[m / 2 + 1]) / 2
	}
	FILENAME == ARGV[1] {
		if ($1 == "cref" && NF == 3 && $3 ~ /^[0-9.]+$/) { csum[$2] += $3; cn[$2]++; cruns[$2] = cruns[$2] (cn[$2] > 1 ? "/" : "") $3 }
		next
	}
	$5 == "ns/op" {
		name = $2; sub(/-[0-9]+$/, "", name)
		key = $1 " " name
		if (!(key in n)) order[++keys] = key
		vals[key, ++n[key]] = $4
		for (i = 6; i <= NF; i++) if ($i == "late-ns/op") vals[key " late", ++n[key " late"]] = $(i - 1)
	}
	END {
		printf "%-8s %-28s %9s %9s %9s %6s  %s\n", "package", "benchmark", "Go ns/op", "Go late", "C ns/op", "Go/C", "C runs"
		for (k = 1; k <= keys; k++) {
			key = order[k]; split(key, part, " ")
			late = (key " late") in n ? sprintf("%.1f", median(key " late", n[key " late"])) : "-"
			go = median(key, n[key])
			if (part[2] in cn) {
				c = csum[part[2]] / cn[part[2]]; seen[part[2]] = 1
				printf "%-8s %-28s %9.1f %9s %9.1f %6.2f  %s\n", part[1], part[2], go, late, c, go / c, cruns[part[2]]
			} else printf "%-8s %-28s %9.1f %9s %9s %6s\n", part[1], part[2], go, late, "-", "-"
		}
		for (name in cn) if (!(name in seen))
			printf "%-8s %-28s %9s %9s %9.1f %6s  %s\n", "cref", name, "-", "-", csum[name] / cn[name], "-", cruns[name]
	}
' "$creflog" "$benchlog"
fi
if [ -n "${OUT:-}" ]; then
	tar czf "$OUT/gpu-check-logs.tgz" -C /tmp gpu-check
fi
exit $failed
