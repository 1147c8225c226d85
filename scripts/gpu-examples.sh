#!/usr/bin/env bash
# gpu-examples.sh runs on a GPU host, from the repository root, with the commands
# scripts/build-gpu.sh built into bin/gpu. It runs the README's main job (kvshare: one
# producer, consumers on every GPU) and the VMM route's (vmmshare: a producer's
# allocation of several chunks mapped as one range by a consumer process), and then the operator's view: a producer and two
# holding consumers (GPU 0 and GPU 1) watched with poolstat (and scraped once through
# poolstat -serve) while one consumer is SIGKILLed and the other releases; then, with libcudapool, the Python package's tests
# (CUDAPOOL_REQUIRE_GPU=1: torch, CuPy and cuda.core must be there; the KV page pool's tests
# get kvpoold), the mixed pairs (examples/torch/pairs.py), the torch KV cache
# (examples/torch/kvcache.py), the KV page pool under a model (examples/replicas/run.py:
# kvpoold and replica processes) and stock transformers models over it
# (examples/hf/check.py), whose figures go as the benchmark suite's lines to
# $OUT/replicas-raw.txt and $OUT/hf-raw.txt (OUT unset: /tmp) for bench/table.py to join
# with the suite's bench-raw.txt. (The KV page pool's costs from Python, bench/kvbench.py, are a part of
# scripts/bench-suite.sh.) It prints a short table last and exits non-zero if a step
# failed. It changes no GPU setting.
#
# On a host with one GPU the second consumer runs on GPU 0 too and the steps that need
# two GPUs are reported "not run (needs 2 GPUs)"; CUDAPOOL_REQUIRE_GPUS=2 demands two
# and fails such a host instead. EXAMPLES_STEPS (when set) runs only the groups it names
# (kvshare poolstat python torch replicas hf), the others listed "skipped", so that the
# whole can be split over device calls of at most 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=/tmp/cudapool-bin
mkdir -p "$bin"
src=${GPU_BIN:-bin/gpu}
# build-gpu.sh compresses the commands; gpu-check.sh may have unpacked them already.
. scripts/unpack.sh
unpack "$src" || exit 2
for c in kvshare vmmshare poolstat kvpoold; do
	if [ ! -f "$src/$c" ]; then
		echo "no $src/$c: run scripts/build-gpu.sh" >&2
		exit 2
	fi
	cp "$src/$c" "$bin/$c"
	chmod +x "$bin/$c"
done
# RUNTIME=test CUDAPOOL_REQUIRE_GPU=0 dry-runs it here on the software device.
runtime=${RUNTIME:-gpu}
export CUDAPOOL_REQUIRE_GPU=${CUDAPOOL_REQUIRE_GPU:-1} CUDAPOOL_DIR=/tmp/cudapool-demo
rm -rf "$CUDAPOOL_DIR"
work=$(mktemp -d)
results=()
step() { # step NAME RC
	if [ "$2" -eq 0 ]; then results+=("$1 PASS"); else results+=("$1 FAIL(rc=$2)"); fi
}
# wanted GROUP says whether EXAMPLES_STEPS (when set: a list of kvshare, poolstat,
# python, torch, replicas, hf) names GROUP; a group left out is listed "skipped", so
# that one device call can run some groups and the next call the rest.
wanted() {
	if [ -z "${EXAMPLES_STEPS:-}" ] || [[ " $EXAMPLES_STEPS " == *" $1 "* ]]; then return 0; fi
	results+=("$1 skipped (EXAMPLES_STEPS)")
	return 1
}
# The GPUs there are (the software device has two), and whether two are demanded.
if [ "$runtime" = test ]; then
	gpus=2
else
	gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
fi
other=1
if [ "$gpus" -lt 2 ]; then
	other=0
	if [ "${CUDAPOOL_REQUIRE_GPUS:-1}" != 1 ]; then
		results+=("two-gpus FAIL(CUDAPOOL_REQUIRE_GPUS=$CUDAPOOL_REQUIRE_GPUS, $gpus GPU(s) here)")
	else
		results+=("other-gpu-consumer not run (needs 2 GPUs)")
	fi
	echo "== $gpus GPU(s): the second consumer runs on GPU 0; what needs two GPUs is not run"
fi

if wanted kvshare; then
echo "== main job: kvshare (default size, one consumer per GPU, at least two)"
timeout 240 "$bin/kvshare" -runtime "$runtime"
step kvshare $?
echo "== the VMM route: vmmshare (8 chunks of 64 MiB, mapped as one range in a second process)"
timeout 120 "$bin/vmmshare" -runtime "$runtime" -chunks 8 -chunk-granules 32
step vmmshare $?
fi

# leases_of PID prints the leases peer PID holds in the only exporter, or "none".
leases_of() {
	"$bin/poolstat" -json | python3 -c '
import json, sys
r = json.load(sys.stdin)
peers = [p for e in r["exporters"] if e.get("state") for p in e["state"]["peers"] or []]
print(next((p["leases"] for p in peers if p["pid"] == int(sys.argv[1])), "none"))' "$1"
}
export -f leases_of
export bin
# wait_for WHAT CMD...: retries CMD for up to 60 s.
wait_for() {
	local what=$1; shift
	for _ in $(seq 600); do "$@" && return 0; sleep 0.1; done
	echo "timed out waiting for $what" >&2
	return 1
}

if wanted poolstat; then
echo "== poolstat: a producer and two holding consumers (GPU 0 and GPU $other)"
sock=$CUDAPOOL_DIR/kv.sock
"$bin/kvshare" producer -runtime "$runtime" -socket "$sock" -tokens 4096 >"$work/producer.log" 2>&1 &
producer=$!
wait_for "the producer's socket" test -S "$sock"
step producer-up $?
mkfifo "$work/a.in" "$work/b.in"
"$bin/kvshare" consumer -runtime "$runtime" -socket "$sock" -hold -device 0 <"$work/a.in" >"$work/a.log" 2>&1 &
a=$!
exec 7>"$work/a.in"
"$bin/kvshare" consumer -runtime "$runtime" -socket "$sock" -hold -device "$other" <"$work/b.in" >"$work/b.log" 2>&1 &
b=$!
exec 8>"$work/b.in"
wait_for "both consumers' leases" bash -c "[ \"\$(leases_of $a)\" = 1 ] && [ \"\$(leases_of $b)\" = 1 ]"
step two-leases $?
"$bin/poolstat"
step poolstat-table $?

echo "== poolstat -serve: a Prometheus scrape of the same exporter"
"$bin/poolstat" -serve 127.0.0.1:0 >"$work/serve.log" 2>&1 &
serve=$!
wait_for "poolstat -serve's address" grep -q "serving metrics at" "$work/serve.log"
url=$(sed -n 's/.*serving metrics at \([^ ]*\).*/\1/p' "$work/serve.log")
python3 - "$url" "$a" "$b" <<'PY'
import re, sys, urllib.request
url, a, b = sys.argv[1], sys.argv[2], sys.argv[3]
text = urllib.request.urlopen(url, timeout=30).read().decode()
series = {}
for line in text.splitlines():
    if line.startswith("cudapool_"):
        print(line)
        name, value = line.rsplit(" ", 1)
        series[name] = float(value)
def one(prefix, label=""):
    got = [v for k, v in series.items() if k.startswith(prefix + "{") and label in k]
    assert len(got) == 1, f"{prefix} {label}: {len(got)} series"
    return got[0]
assert one("cudapool_exporter_up") == 1, "the exporter is not up"
assert one("cudapool_peer_leases", f'peer="{a}"') == 1, "consumer on GPU 0: no lease"
assert one("cudapool_peer_leases", f'peer="{b}"') == 1, "the second consumer: no lease"
assert one("cudapool_pool_reserved_bytes") > 0, "the driver reports nothing reserved"
assert one("cudapool_pool_leases") == 2, "the pool does not count two leases"
print("scrape checked")
PY
step poolstat-serve $?
kill -INT "$serve"
wait "$serve"
step poolstat-serve-exit $?

echo "== SIGKILL the consumer on GPU $other (pid $b)"
kill -KILL "$b"
wait "$b" 2>/dev/null
exec 8>&-
wait_for "the killed consumer's lease to end" bash -c "[ \"\$(leases_of $b)\" = none ]"
step killed-lease-gone $?
"$bin/poolstat"

echo "== the consumer on GPU 0 releases (end of its input)"
exec 7>&-
wait "$a"
step released-consumer-exit $?
wait_for "the released consumer's lease to end" bash -c "[ \"\$(leases_of $a)\" = none ]"
step released-lease-gone $?
"$bin/poolstat"
"$bin/poolstat" -json >"$work/poolstat.json"
step poolstat-json $?

kill -INT "$producer"
wait "$producer"
step producer-clean-exit $?
echo "== consumer logs"
cat "$work/a.log" "$work/b.log"
echo "== producer log"
cat "$work/producer.log"
fi

echo "== Python and PyTorch: the package's tests, the mixed pairs, the torch KV cache"
lib=$bin/libcudapool.so
if [ -f "$src/libcudapool.so" ]; then
	cp "$src/libcudapool.so" "$lib"
fi
if [ "$runtime" = test ] && [ -f "$lib" ]; then
	# build-gpu.sh's libcudapool and kvpoold have no software device (the GPU host's
	# need none): the dry run builds its own, where Go is.
	echo "== RUNTIME=test: libcudapool and kvpoold with the software device, for the Python tests"
	go build -buildmode=c-shared -tags cudapool_softdevice -o "$lib" ./capi &&
		go build -tags cudapool_softdevice -o "$bin/kvpoold" ./cmd/kvpoold
	step softdevice-build $?
fi
if [ -f "$lib" ]; then
	export CUDAPOOL_LIB=$lib CUDAPOOL_KVPOOLD=$bin/kvpoold # the KV page pool's owner, for test_kv*.py
	if wanted python; then
		scripts/python-tests.sh
		step python-tests $?
	fi
	if [ "$runtime" = test ]; then
		echo "(the torch pairs and the torch KV cache need a GPU: not run with RUNTIME=test)"
	else
		if wanted torch; then
			timeout 600 python3 examples/torch/pairs.py --bin "$bin"
			step torch-pairs $?
			timeout 600 python3 examples/torch/kvcache.py
			step torch-kvcache $?
		fi
		# The KV page pool under a model: the owner and replica processes of a 0.85B Llama,
		# over a slab of REPLICAS_SLAB (default 64GiB, every chunk mapped), each replica's dial timed.
		if python3 -c 'import torch, transformers, triton' 2>/dev/null; then
			if wanted replicas; then
				replicas_raw=${OUT:-/tmp}/replicas-raw.txt # run.py appends: a fresh file each run
				rm -f "$replicas_raw"
				timeout 600 python3 examples/replicas/run.py --kvpoold "$bin/kvpoold" --bytes "${REPLICAS_SLAB:-64GiB}" \
					--raw "$replicas_raw"
				step kv-replicas $?
			fi
			# Stock transformers models over the pool (cudapool.hf), two architectures,
			# against transformers' own generate; figures to $OUT/hf-raw.txt.
			if wanted hf; then
				hf_raw=${OUT:-/tmp}/hf-raw.txt
				rm -f "$hf_raw"
				timeout 600 python3 examples/hf/check.py --kvpoold "$bin/kvpoold" --raw "$hf_raw" --compile
				step hf-models $?
				python3 bench/ttft.py "$hf_raw" --out "${OUT:-/tmp}/ttft.png" # bench/ttft.png's chart of this run
			fi
		else
			echo "(the KV replicas need torch, transformers and triton: not run)"
		fi
	fi
else
	echo "no $src/libcudapool.so: run scripts/build-gpu.sh" >&2
	step libcudapool 1
fi

echo
echo "== gpu-examples summary"
for r in "${results[@]}"; do printf '%-24s %s\n' "${r%% *}" "${r#* }"; done
for r in "${results[@]}"; do [[ $r == *PASS || $r == *"not run (needs "* || $r == *"skipped (EXAMPLES_STEPS)" ]] || exit 1; done
