#!/usr/bin/env bash
# gpu-ab.sh BASE [MODE...] measures a change on a GPU host: it alternates the benchmark
# suite of an earlier build (BASE/gosuite.xz or BASE/gosuite, built by `go build
# ./bench/gosuite` at that commit, commit named in BASE/commit.txt) with this checkout's
# (bin/gpu/gosuite.xz from scripts/build-gpu.sh), round by round, the order swapped each
# round, so that both see the same card, clocks and neighbours. Each MODE is a quick
# gosuite run: "all" (the sharing rows), or "kv:SIZE" (the KV rows on a slab of SIZE,
# e.g. kv:4GiB kv:100GiB); or "replicas:LEN", examples/replicas/run.py without its faults
# on LEN-token prompts (TTFT computed and matched, decode over pool pages), whose base
# is BASE/tree.tar.xz (that commit's examples/replicas, examples/hf, python and bench
# *.py), BASE/libcudapool.so and BASE/kvpoold. The default is all kv:4GiB kv:100GiB. Rounds go on while
# AB_BUDGET (default 240) seconds last, at least AB_ROUNDS_MIN (default 2).
#
# It prints, for every row both builds gave, the median over rounds of each build's
# median and their ratio (this build over BASE), and keeps the raw output in
# $OUT/ab-raw.txt when OUT is set. It exits non-zero if a run failed. AB_RUNTIME=test
# runs it on the software device, to try the script where there is no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/unpack.sh
base=${1:?usage: gpu-ab.sh BASE [MODE...]}
shift
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(all kv:4GiB kv:100GiB)
budget=${AB_BUDGET:-240}
rt=${AB_RUNTIME:-gpu}
min_rounds=${AB_ROUNDS_MIN:-2}
raw=${OUT:-/tmp}/ab-raw.txt
: >"$raw"
unpack "$base" || exit 2
unpack bin/gpu || exit 2
declare -A suite=([base]="$base/gosuite" [new]=bin/gpu/gosuite)
for b in base new; do
	[ -x "${suite[$b]}" ] || { echo "gpu-ab: no ${suite[$b]}" >&2; exit 2; }
done
echo "gpu-ab: base $(cat "$base/commit.txt" 2>/dev/null || echo '?'), new $(cat bin/gpu/commit.txt 2>/dev/null || echo '?'); modes ${modes[*]}"
failed=0
round=0
start=$SECONDS
while [ $round -lt "$min_rounds" ] || [ $((SECONDS - start)) -lt "$budget" ]; do
	round=$((round + 1))
	order=(base new)
	[ $((round % 2)) -eq 0 ] && order=(new base)
	for m in "${modes[@]}"; do
		for b in "${order[@]}"; do
			args=(-runtime "$rt" -quick all)
			case $m in
			all) ;;
			replicas:*)
				t0=$SECONDS
				if [ "$b" = base ]; then
					tree=/tmp/gpu-ab-base-tree
					[ -d "$tree" ] || { mkdir -p "$tree" && tar xf "$(ls "$base"/tree.tar* | head -1)" -C "$tree"; } || exit 2
					lib=$base/libcudapool.so kvpoold=$base/kvpoold
				else
					tree=. lib=bin/gpu/libcudapool.so kvpoold=bin/gpu/kvpoold
				fi
				rm -f /tmp/ab-one.txt
				if ! CUDAPOOL_LIB=$(realpath "$lib") timeout 400 python3 "$tree/examples/replicas/run.py" --kvpoold "$(realpath "$kvpoold")" \
					--lengths "${m#replicas:}" --no-faults --raw /tmp/ab-one.txt >/tmp/ab-log.txt 2>&1; then
					echo "gpu-ab: round $round $b $m FAILED:" >&2
					tail -5 /tmp/ab-log.txt >&2
					failed=1
				fi
				sed -n "s/^result /$round $b $m /p" /tmp/ab-one.txt >>"$raw"
				echo "round $round $b $m: $((SECONDS - t0))s"
				continue
				;;
			kv:*) args=(-runtime "$rt" -quick -kv-bytes "${m#kv:}" kv) ;;
			*) echo "gpu-ab: unknown mode $m" >&2; exit 2 ;;
			esac
			t0=$SECONDS
			if ! "${suite[$b]}" "${args[@]}" >/tmp/ab-one.txt 2>&1; then
				echo "gpu-ab: round $round $b $m FAILED:" >&2
				tail -5 /tmp/ab-one.txt >&2
				failed=1
			fi
			sed -n "s/^result /$round $b $m /p" /tmp/ab-one.txt >>"$raw"
			echo "round $round $b $m: $((SECONDS - t0))s"
		done
	done
done
python3 - "$raw" <<'EOF'
import collections, statistics, sys
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    f = line.split()
    # ROUND BUILD MODE IMPL ROW UNIT MEDIAN ...
    if len(f) < 7:
        continue
    _, build, mode, impl, row, unit, med = f[:7]
    rows[(mode, impl, row, unit)][build].append(float(med))
print("%-10s %-40s %-8s %12s %12s %7s %s" % ("mode", "row", "unit", "base", "new", "new/base", "rounds"))
for (mode, impl, row, unit), by in sorted(rows.items()):
    if not by["base"] or not by["new"]:
        continue
    b, n = statistics.median(by["base"]), statistics.median(by["new"])
    print("%-10s %-40s %-8s %12.4g %12.4g %7.3f %d" % (mode, impl + " " + row, unit, b, n, n / b if b else float("nan"), min(len(by["base"]), len(by["new"]))))
EOF
exit $failed
