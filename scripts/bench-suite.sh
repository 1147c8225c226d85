#!/usr/bin/env bash
# bench-suite.sh runs cudapool's benchmark suite (issues 6, 10, 11, 13, 18) on a GPU host,
# from the repository root, with what scripts/build-gpu.sh built elsewhere in bin/gpu
# (the host needs no Go; it needs nvcc and python3 with cuda.core, and torch for the
# torch rows). In one run on one host it takes every operation from:
#
#	cudapool   bin/gpu/gosuite: pool and export (Go), and cudart, the bare binding
#	C          bench/cref, built here with nvcc: the same runtime calls, the same
#	           ordered protocol as cudapool's consumers
#	legacy IPC bench/cref: cudaMalloc and cudaIpc{Get,Open,Close}MemHandle
#	cuda.core  bench/cudacore.py (orders nothing between processes)
#	torch      bench/torchbench.py (issue 10's rows)
#	KV pool    bin/gpu/gosuite kv and kv-restart (Go) and bench/kvbench.py (Python, over
#	           bin/gpu/libcudapool.so and a bin/gpu/kvpoold of its own): issue 18's
#	           match and page-rate rows; bin/gpu/gosuite kvtier: issue 24's host tier
#
# First, with nothing else of the suite running, the allocation ring: C, Go and
# cuda.core in one process each, pinned to the same CPU (ALLOC_CPU), taking turns one
# batch each, ALLOC_ROUNDS times with fresh processes and the order rotated, every
# column allocating the same bytes from the same kind of pool (bench/gosuite/alloc.go
# says why). Then the sharing operations, one implementation after another, a short
# validating run of the Go suite (its consumers check every byte), the torch rows and
# the KV page pool's rows. It prints LAST the tables bench/table.py makes. Every sample
# goes to the raw file it names, and the tables as Markdown to RESULTS.md beside it
# (bench/RESULTS.md in the repository; examples/replicas/run.py's raw file, from
# scripts/gpu-examples.sh, joins it there: bench/table.py takes both). A part
# that fails or runs out of time shows as FAIL in the tables and makes the script
# exit non-zero; the rest still runs. On a host with one GPU the other-GPU rows are
# "not run (needs 2 GPUs)", which fails nothing; CUDAPOOL_REQUIRE_GPUS=2 demands two
# GPUs and fails them instead. It changes no GPU setting.
#
# Environment: SUITE_BUDGET (default 330) seconds after which no part starts and
# running ones are stopped; OUT (when set) is where the raw file, RESULTS.md and the
# logs go, else /tmp/bench-suite; ALLOC_CPU (default 3) and ALLOC_ROUNDS (default 3);
# KV_SLAB the Go KV rows' slab (default 100GiB on a GPU); SUITE_PARTS (when set) the
# names of the parts to run, space-separated (alloc, cref, gosuite, cudacore, validate,
# torch, gosuite-kv, gosuite-kv-restart, gosuite-kvtier, kvbench): the others are
# reported "skipped", which fails nothing, for a call with less device time than the
# whole suite takes.
# CUDAPOOL_LIB and CUDAPOOL_KVPOOLD (when set) are the libcudapool.so and kvpoold the
# Python parts use, else bin/gpu's. For a dry run of the script itself where there is
# no GPU: GOSUITE_RUNTIME=test (the software device) and SUITE_QUICK=1 (few samples),
# with a libcudapool and a kvpoold built with -tags cudapool_softdevice in those two.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bin=$root/bin/gpu
budget=${SUITE_BUDGET:-330}
dest=${OUT:-/tmp/bench-suite}
logs=/tmp/bench-suite-logs
raw=$dest/bench-raw.txt
mkdir -p "$dest"
rm -rf "$logs"
mkdir -p "$logs"
: >"$raw"
start=$SECONDS
parts=()
suite_failed=0
rt=${GOSUITE_RUNTIME:-gpu}
alloc_cpu=${ALLOC_CPU:-3}
alloc_rounds=${ALLOC_ROUNDS:-3}
quick=()
pyquick=()
alloc_shape=(15 10000) # measured batches per plan entry and slot, pairs per batch
if [ "${SUITE_QUICK:-0}" = 1 ]; then
	quick=(-quick)
	pyquick=(--quick)
	alloc_shape=(3 100)
fi

# meta records a fact about the run for the table's heading.
meta() { echo "meta $*" >>"$raw"; }

# left is what remains of the suite's budget, in seconds.
left() { echo $((budget - (SECONDS - start))); }

# part NAME SECONDS CMD... runs CMD with its output appended to the raw file (and
# its stderr to a log), stopped after SECONDS or at the suite's budget; a part that
# fails, or runs out of time, is recorded as a fail line that the table shows.
# asked NAME says whether SUITE_PARTS (if set) names part NAME.
asked() { [ -z "${SUITE_PARTS:-}" ] || [[ " $SUITE_PARTS " == *" $1 "* ]]; }

part() {
	local name=$1 limit=$2
	shift 2
	if ! asked "$name"; then
		parts+=("$name skipped (SUITE_PARTS)")
		return
	fi
	if [ "$(left)" -lt 10 ]; then
		echo "fail suite $name not run: the suite's budget of ${budget}s is spent" >>"$raw"
		parts+=("$name NOT-RUN")
		suite_failed=1
		return
	fi
	[ "$limit" -le "$(left)" ] || limit=$(left)
	local t0=$SECONDS
	timeout -k 5 "$limit" "$@" >>"$raw" 2>"$logs/$name.err"
	local rc=$?
	if [ $rc -eq 0 ]; then
		parts+=("$name ok($((SECONDS - t0))s)")
	else
		local why
		[ $rc -eq 124 ] && why="timed out after ${limit}s" || why="exit status $rc"
		echo "fail suite $name $why: $(tail -n 3 "$logs/$name.err" | tr '\n' ' ' | cut -c1-300)" >>"$raw"
		parts+=("$name FAIL($why)")
		suite_failed=1
	fi
}

# build-gpu.sh compresses the binaries for the journey; unpack them once.
. scripts/unpack.sh
unpack "$bin" || exit 2
echo "== bench-suite: host"
meta suite 2 # bench/table.py's SUITE: the version of these lines and of what each column does
meta date "$(date -u '+%Y-%m-%d %H:%M UTC')"
meta gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | sed 's/^ *\([0-9]*\) /\1x /' | paste -sd, -)"
meta driver "$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
meta cpus "$(nproc)"
[ -s "$bin/go-version.txt" ] && meta go "$(cat "$bin/go-version.txt")"
[ -s "$bin/commit.txt" ] && meta commit "$(cat "$bin/commit.txt") (the build's, scripts/build-gpu.sh)"
python3 -c 'import cuda.core as c; print("meta cudacore", getattr(c, "__version__", "unknown"))' >>"$raw" 2>/dev/null ||
	meta cudacore "not importable"
python3 -c 'import torch; print("meta torch", torch.__version__)' >>"$raw" 2>/dev/null || meta torch "not importable"
grep '^meta' "$raw"

# The sharing columns (consumer processes too) run on CPUs 2-9, all of them alike.
wide=()
if command -v taskset >/dev/null && [ "$(nproc)" -ge 12 ]; then
	wide=(taskset -c 2-9)
fi
pin=()
if command -v taskset >/dev/null && [ "$(nproc)" -gt "$alloc_cpu" ]; then
	pin=(taskset -c "$alloc_cpu")
	meta alloc-cpu "$alloc_cpu"
else
	meta alloc-cpu "not pinned (no taskset, or too few CPUs)"
fi

echo "== bench-suite: C reference (build)"
cref=/tmp/cudapool-cref
if ! asked cref && ! asked alloc; then
	echo "not built: SUITE_PARTS names neither cref nor alloc"
	cref=
elif [ -x "$cref" ] && [ "$cref" -nt bench/cref/cref.cu ]; then
	echo "reusing $cref"
elif ! timeout 180 nvcc -O2 -cudart shared -o "$cref" bench/cref/cref.cu; then
	echo "fail c all nvcc could not build bench/cref" >>"$raw"
	echo "fail legacy all nvcc could not build bench/cref" >>"$raw"
	parts+=("cref-build FAIL")
	suite_failed=1
	cref=
fi

echo "== bench-suite: allocation ring (CPU $alloc_cpu, $alloc_rounds rounds)"
# What an exportable pool allocates for a small buffer: cudapool rounds to this, so C
# and cuda.core are asked for it too, and every column allocates the same bytes.
gran=$(timeout 60 "$bin/gosuite" -runtime "$rt" granularity 2>"$logs/granularity.err")
if ! asked alloc; then
	parts+=("alloc skipped (SUITE_PARTS)")
elif [ -z "$cref" ]; then
	# Without C there is nothing to compare the Go pairs with, batch by batch.
	echo "fail suite alloc not run: bench/cref did not build" >>"$raw"
	parts+=("alloc NOT-RUN(no cref)")
elif ! [[ $gran =~ ^[0-9]+$ ]] || [ "$gran" -lt 1024 ]; then
	echo "fail suite alloc the granularity is unknown (gosuite granularity said '$gran': $(head -c 200 "$logs/granularity.err"))" >>"$raw"
	parts+=("alloc FAIL(granularity)")
	suite_failed=1
else
	meta granularity "$gran"
	roundup() { echo $((($1 + gran - 1) / gran * gran)); }
	# ipc: exportable pools; local: pools of handle type none, which do not round;
	# hit and miss: cudapool's cache serving every Alloc, or on but never serving
	# (C and cuda.core run their plain pair there: issue 11 compares with it).
	plan=""
	for kind in ipc hit miss; do
		plan+="$kind/1KiB=$(roundup 1024) $kind/1MiB=$(roundup 1048576) $kind/64MiB=$(roundup 67108864) "
	done
	plan+="local/1KiB=1024 local/1MiB=1048576"
	meta alloc-plan "$plan"
	meta alloc-shape "${alloc_shape[0]} batches of ${alloc_shape[1]} pairs"
	# alloc_round R: one round of the ring. Each participant writes to its own file
	# (appended to the raw file after the round), says ready on a FIFO, and the first
	# token goes in only when all three are ready.
	alloc_round() {
		local r=$1 dir
		dir=$(mktemp -d)
		local names=(c go py) order=() n i pids=() rc=0
		for i in 0 1 2; do order+=("${names[$(((i + r) % 3))]}"); done
		for n in "${names[@]}"; do mkfifo "$dir/to-$n"; done
		mkfifo "$dir/ready"
		exec {ready}<>"$dir/ready"
		next_of() { # the participant after $1 in this round's order
			local k
			for k in 0 1 2; do [ "${order[$k]}" = "$1" ] && echo "${order[$(((k + 1) % 3))]}"; done
		}
		"${pin[@]}" "$cref" alloc "$plan" "$dir/to-c" "$dir/to-$(next_of c)" "$dir/ready" "$r" "${alloc_shape[@]}" \
			>"$dir/c.out" 2>"$logs/alloc-c.$r.err" &
		pids+=($!)
		"${pin[@]}" "$bin/gosuite" -runtime "$rt" -plan "$plan" -ring "$dir/to-go,$dir/to-$(next_of go)" \
			-ready "$dir/ready" -round "$r" -batches "${alloc_shape[0]}" -pairs "${alloc_shape[1]}" alloc \
			>"$dir/go.out" 2>"$logs/alloc-go.$r.err" &
		pids+=($!)
		"${pin[@]}" env PYTHONUNBUFFERED=1 python3 bench/cudacore.py alloc --plan "$plan" \
			--ring "$dir/to-py,$dir/to-$(next_of py)" --ready "$dir/ready" --round "$r" \
			--batches "${alloc_shape[0]}" --pairs "${alloc_shape[1]}" >"$dir/py.out" 2>"$logs/alloc-py.$r.err" &
		pids+=($!)
		local want=3 got=0 line p ready_by=$((SECONDS + 90))
		while [ $got -lt $want ] && [ $SECONDS -lt $ready_by ]; do
			if read -r -t 1 line <&"$ready"; then
				got=$((got + 1))
				echo "  round $r: $line"
				continue
			fi
			for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || ready_by=0; done # one died
		done
		if [ $got -lt $want ]; then
			echo "fail suite alloc round $r: $got of $want participants said ready (logs: alloc-*.$r.err)" >>"$raw"
			rc=1
		else
			echo 0 >"$dir/to-${order[0]}" # the first turn
		fi
		# The round ends when every participant has, or when one failed (the others
		# would only wait for a turn that never comes), or after 150 s.
		local deadline=$((SECONDS + 150)) p running
		while [ $rc -eq 0 ]; do
			running=0
			for p in "${pids[@]}"; do
				if kill -0 "$p" 2>/dev/null; then
					running=1
				elif ! wait "$p"; then
					echo "fail suite alloc round $r: a participant failed (logs: alloc-*.$r.err)" >>"$raw"
					rc=1
				fi
			done
			[ $running = 1 ] || break
			if [ $SECONDS -ge $deadline ]; then
				echo "fail suite alloc round $r: a participant ran past 150s" >>"$raw"
				rc=1
			fi
			[ $rc -ne 0 ] || sleep 0.2
		done
		for p in "${pids[@]}"; do
			kill "$p" 2>/dev/null
			wait "$p" 2>/dev/null
		done
		exec {ready}>&-
		cat "$dir"/*.out >>"$raw"
		rm -rf "$dir"
		return $rc
	}
	for r in $(seq 1 "$alloc_rounds"); do
		if [ "$(left)" -lt 60 ]; then
			echo "fail suite alloc round $r not run: the suite's budget of ${budget}s is spent" >>"$raw"
			parts+=("alloc.$r NOT-RUN")
			suite_failed=1
			continue
		fi
		t0=$SECONDS
		if alloc_round "$r"; then
			parts+=("alloc.$r ok($((SECONDS - t0))s)")
		else
			parts+=("alloc.$r FAIL")
			suite_failed=1
			tail -n 3 "$logs"/alloc-*."$r".err
		fi
	done
fi

echo "== bench-suite: sharing"
[ -n "$cref" ] && part cref 120 "${wide[@]}" "$cref" all
part gosuite 150 "${wide[@]}" "$bin/gosuite" -runtime "$rt" "${quick[@]}" all
part cudacore 150 "${wide[@]}" env PYTHONUNBUFFERED=1 python3 bench/cudacore.py "${pyquick[@]}"
# A short run whose consumers check every byte they are given; only its verdict
# (and any failure) goes to the raw file, its timings being the check's.
validate() {
	"$bin/gosuite" -runtime "$rt" -quick -validate all >"$logs/validate.txt" || return 1
	grep -E '^(validated|fail) ' "$logs/validate.txt" | sed 's/^fail cudapool /fail cudapool validate:/'
	grep -q '^validated ' "$logs/validate.txt"
}
export -f validate
export bin rt logs
part validate 60 "${wide[@]}" bash -c validate
part torch 150 "${wide[@]}" env PYTHONUNBUFFERED=1 python3 bench/torchbench.py "${pyquick[@]}" --runtime "$rt"
# The KV page pool: the same rows (kv/match512, kv/match512+hash) from Go and from
# Python, each with an owner of its own, one after the other. Go's slab is KV_SLAB
# (default 100 GiB on a GPU, issue 24's target; 4 GiB on the software device), a region
# of addresses per tensor with every chunk mapped, and its replicas' dials are timed
# (kv/dial).
kv_slab=${KV_SLAB:-100GiB}
[ "$rt" = test ] && kv_slab=${KV_SLAB:-4GiB}
part gosuite-kv 150 "${wide[@]}" "$bin/gosuite" -runtime "$rt" "${quick[@]}" -kv-bytes "$kv_slab" kv
# The page server SIGKILLed and restarted over its keeper while 3 replicas hold the
# 32k prompt (issue 24): a part of its own, so that its processes' starts do not eat
# the kv rows' time.
part gosuite-kv-restart 45 "${wide[@]}" "$bin/gosuite" -runtime "$rt" "${quick[@]}" kv-restart
# The host tier (issue 24): a 32,768-token prompt evicted to it and restored, bytes
# checked (kv/host/restore32k), and the spills' GB/s (kv/host/spill).
part gosuite-kvtier 90 "${wide[@]}" "$bin/gosuite" -runtime "$rt" "${quick[@]}" kvtier
part kvbench 120 "${wide[@]}" env PYTHONUNBUFFERED=1 CUDAPOOL_LIB="${CUDAPOOL_LIB:-$bin/libcudapool.so}" \
	python3 bench/kvbench.py "${pyquick[@]}" --runtime "$rt" --kvpoold "${CUDAPOOL_KVPOOLD:-$bin/kvpoold}"

# Any measurement that could not be taken fails the suite, whichever part said so.
grep -q '^fail ' "$raw" && suite_failed=1
echo
echo "== bench-suite: parts ($((SECONDS - start))s)"
printf '%s\n' "${parts[@]}"
grep -h '^fail' "$raw" | cut -c1-240
if [ -n "${OUT:-}" ]; then
	tar czf "$OUT/bench-logs.tgz" -C /tmp bench-suite-logs
fi
echo
echo "== bench-suite: raw samples in $raw; the tables in $dest/RESULTS.md"
python3 bench/table.py "$raw" --md "$dest/RESULTS.md" --notes bench/NOTES.md || suite_failed=1
exit $suite_failed
