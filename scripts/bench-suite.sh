#!/usr/bin/env bash
# bench-suite.sh runs cudapool's benchmark suite (issue 6) on a GPU host, from the
# repository root, with what scripts/build-gpu.sh built elsewhere in bin/gpu (the
# host needs no Go; it needs nvcc and python3 with cuda.core). In one run on one
# host it takes every operation from four implementations:
#
#	cudapool   bin/gpu/gosuite (pool and export) and cudart's Go benchmarks
#	C          bench/cref, built here with nvcc: the same runtime calls from C
#	legacy IPC bench/cref: cudaMalloc and cudaIpc{Get,Open,Close}MemHandle
#	cuda.core  bench/cudacore.py
#
# then the allocation pairs again under other thread and CPU settings (the
# variants), and prints LAST the table bench/table.py makes: each operation's
# median and p90 in every column and cudapool's ratio to each. Every sample goes to
# the raw file it names, and the README's performance section to RESULTS.md beside
# it. A part that fails or runs out of time shows as FAIL in the table; the rest
# still runs. It changes no GPU setting.
#
# Environment: SUITE_BUDGET (default 330) seconds after which no part starts and
# running ones are stopped; OUT (when set) is where the raw file, RESULTS.md and
# the logs go, else /tmp/bench-suite. For a dry run of the script itself where
# there is no GPU: GOSUITE_RUNTIME=test (the software device) and SUITE_QUICK=1
# (few samples).
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
quick=()
pyquick=()
if [ "${SUITE_QUICK:-0}" = 1 ]; then
	quick=(-quick)
	pyquick=(--quick)
fi

# meta records a fact about the run for the table's heading.
meta() { echo "meta $*" >>"$raw"; }

# part NAME SECONDS CMD... runs CMD with its output appended to the raw file (and
# its stderr to a log), stopped after SECONDS or at the suite's budget; a part that
# fails, or runs out of time, is recorded as a fail line that the table shows.
part() {
	local name=$1 limit=$2
	shift 2
	local left=$((budget - (SECONDS - start)))
	if [ "$left" -lt 10 ]; then
		echo "fail suite $name not run: the suite's budget of ${budget}s is spent" >>"$raw"
		parts+=("$name NOT-RUN")
		suite_failed=1
		return
	fi
	[ "$limit" -le "$left" ] || limit=$left
	local t0=$SECONDS
	timeout -k 5 "$limit" "$@" >>"$raw" 2>"$logs/$name.err"
	local rc=$?
	if [ $rc -eq 0 ]; then
		parts+=("$name ok($((SECONDS - t0))s)")
	else
		[ $rc -eq 124 ] && why="timed out after ${limit}s" || why="exit status $rc"
		echo "fail suite $name $why: $(tail -n 3 "$logs/$name.err" | tr '\n' ' ' | cut -c1-300)" >>"$raw"
		parts+=("$name FAIL($why)")
		suite_failed=1
	fi
}

# build-gpu.sh gzips the binaries for the journey; unpack them once.
for z in "$bin"/*.gz; do
	[ -e "$z" ] || continue
	gunzip -f "$z" && chmod +x "${z%.gz}" || { echo "cannot unpack $z" >&2; exit 2; }
done
echo "== bench-suite: host"
meta date "$(date -u '+%Y-%m-%d %H:%M UTC')"
meta gpu "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | sed 's/^ *\([0-9]*\) /\1x /' | paste -sd, -)"
meta driver "$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
meta cpus "$(nproc)"
[ -s "$bin/go-version.txt" ] && meta go "$(cat "$bin/go-version.txt")"
python3 -c 'import cuda.core as c; print("meta cudacore", getattr(c, "__version__", "unknown"))' >>"$raw" 2>/dev/null ||
	meta cudacore "not importable"
grep '^meta' "$raw"

# The first GPU runs pinned Go and C to CPUs 2-9; every main column (consumer
# processes too) keeps that, so that figures compare with theirs and with each
# other, and the variants change it.
wide=()
if command -v taskset >/dev/null && [ "$(nproc)" -ge 12 ]; then
	wide=(taskset -c 2-9)
fi
narrow=()
if command -v taskset >/dev/null && [ "$(nproc)" -ge 4 ]; then
	narrow=(taskset -c 3)
fi

echo "== bench-suite: C reference (build)"
cref=/tmp/cudapool-cref
if [ -x "$cref" ] && [ "$cref" -nt bench/cref/cref.cu ]; then
	echo "reusing $cref"
elif ! timeout 180 nvcc -O2 -cudart shared -o "$cref" bench/cref/cref.cu; then
	echo "fail c all nvcc could not build bench/cref" >>"$raw"
	echo "fail legacy all nvcc could not build bench/cref" >>"$raw"
	parts+=("cref-build FAIL")
	suite_failed=1
	cref=
fi

echo "== bench-suite: main columns"
# cref's cudart lines and cudart's Go benchmark lines are not the suite's; their
# own prefixes keep them out of the table.
[ -n "$cref" ] && part cref 120 "${wide[@]}" "$cref" all
part gosuite 180 "${wide[@]}" "$bin/gosuite" -runtime "$rt" "${quick[@]}" all
part cudacore 180 "${wide[@]}" env PYTHONUNBUFFERED=1 python3 bench/cudacore.py "${pyquick[@]}"
# cudart's import+free pair: the binding's benchmark, the loop cref times; each
# count's ns/op is the median of 15 batches, as cref's. Beside it cudart's pair
# benchmark (its first 15 batches and the later ones: variant (d)) and the pool's
# bookkeeping on a runtime that does nothing.
gotest_import() {
	# shellcheck disable=SC2086 # $wide_cmd is a command prefix, split on purpose
	(cd "$root/cudart" && $wide_cmd "$bin/cudart.test" -test.run '^$' -test.bench 'MallocFreePair|ImportPointer' \
		-test.count 3 -test.benchtime 1s -test.timeout 100s) >"$logs/cudart-bench.txt" 2>&1 || return 1
	# The pool's own cost per pair, on a runtime that does nothing.
	(cd "$root/pool" && $wide_cmd "$bin/pool.test" -test.run '^$' -test.bench 'Bookkeeping/serial' \
		-test.count 3 -test.benchtime 1s -test.timeout 30s) >>"$logs/cudart-bench.txt" 2>&1 || return 1
	awk '
		$1 ~ /^Benchmark/ {
			name = $1; sub(/^Benchmark/, "", name); sub(/-[0-9]+$/, "", name)
			for (i = 3; i < NF; i++) {
				if ($(i + 1) == "ns/op") v[name, "ns", ++n[name, "ns"]] = $i / 1e3
				if ($(i + 1) == "late-ns/op") v[name, "late", ++n[name, "late"]] = $i / 1e3
			}
			if (!(name in seen)) { seen[name] = 1; order[++names] = name }
		}
		function put(impl, op, name, what,    m, i, j, t, s) {
			m = n[name, what]
			if (!m) return
			for (i = 1; i <= m; i++) s[i] = v[name, what, i]
			for (i = 2; i <= m; i++) for (j = i; j > 1 && s[j-1] > s[j]; j--) { t = s[j]; s[j] = s[j-1]; s[j-1] = t }
			printf "result %s %s us %.4f %.4f %d\n", impl, op, s[int((m + 1) / 2)], s[m], m
		}
		END {
			for (k = 1; k <= names; k++) {
				name = order[k]
				if (name == "ImportPointer") put("cudapool", "import/pair", name, "ns")
				else if (name == "Bookkeeping/serial") put("cudapool", "variant/null-runtime/alloc/1MiB", name, "ns")
				else if (name ~ /^MallocFreePair\//) {
					size = name; sub(/^MallocFreePair\//, "", size)
					put("cudart", "variant/gotest-first15/alloc/" size, name, "ns")
					put("cudart", "variant/gotest-late/alloc/" size, name, "late")
				}
			}
		}' "$logs/cudart-bench.txt"
}
wide_cmd=${wide[*]}
export -f gotest_import
export root bin logs wide_cmd
part cudart-bench 120 bash -c gotest_import

echo "== bench-suite: allocation variants"
# Each variant three times, interleaved, so that the spread between runs shows beside
# the differences between variants. cref runs under each pinning it has.
for round in 1 2 3; do
	part "base.$round" 60 "${wide[@]}" "$bin/gosuite" -runtime "$rt" "${quick[@]}" -label "base.$round" alloc
	[ -n "$cref" ] && part "c-wide.$round" 60 "${wide[@]}" "$cref" alloc "base.$round"
	part "lock.$round" 60 "${wide[@]}" "$bin/gosuite" -runtime "$rt" "${quick[@]}" -lock -label "lock.$round" alloc
	part "gomaxprocs1.$round" 60 env GOMAXPROCS=1 "${wide[@]}" "$bin/gosuite" -runtime "$rt" "${quick[@]}" -label "gomaxprocs1.$round" alloc
	part "lock+gomaxprocs1.$round" 60 env GOMAXPROCS=1 "${wide[@]}" "$bin/gosuite" -runtime "$rt" "${quick[@]}" -lock -label "lock+gomaxprocs1.$round" alloc
	if [ ${#narrow[@]} -gt 0 ]; then
		part "cpu3.$round" 60 "${narrow[@]}" "$bin/gosuite" -runtime "$rt" "${quick[@]}" -label "cpu3.$round" alloc
		part "cpu3+lock.$round" 60 "${narrow[@]}" "$bin/gosuite" -runtime "$rt" "${quick[@]}" -lock -label "cpu3+lock.$round" alloc
		[ -n "$cref" ] && part "c-cpu3.$round" 60 "${narrow[@]}" "$cref" alloc "cpu3.$round"
	fi
done
# cref's labelled lines name the variant whose pinning they share: the C figure of
# cpu3+lock is the one of cpu3, and of the wide variants that of base.
awk '$1 == "result" && $2 == "c" && $3 ~ /^variant\/(base|cpu3)\./ {
	split($3, p, "/"); label = p[2]; rest = substr($3, length("variant/" label) + 1)
	split(label, lr, "."); round = lr[2]
	if (lr[1] == "base") n = split("lock gomaxprocs1 lock+gomaxprocs1", also, " ")
	else n = split("cpu3+lock", also, " ")
	for (i = 1; i <= n; i++) { $3 = "variant/" also[i] "." round rest; print }
}' "$raw" >"$logs/aliases.txt"
cat "$logs/aliases.txt" >>"$raw"

echo
echo "== bench-suite: parts ($((SECONDS - start))s)"
printf '%s\n' "${parts[@]}"
grep -h '^fail' "$raw" | cut -c1-240
if [ -n "${OUT:-}" ]; then
	tar czf "$OUT/bench-logs.tgz" -C /tmp bench-suite-logs
fi
echo
echo "== bench-suite: raw samples in $raw; README section in $dest/RESULTS.md"
python3 bench/table.py "$raw" --md "$dest/RESULTS.md" || suite_failed=1
exit $suite_failed
