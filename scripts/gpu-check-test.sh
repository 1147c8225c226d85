#!/usr/bin/env bash
# gpu-check-test.sh tests scripts/gpu-check.sh's step kvpoold-keeper here, where Go
# is and no GPU: it builds kvpoold with the software device (-tags
# cudapool_softdevice) and runs the step alone (CHECK_ONLY=kvpoold-keeper,
# KVPOOLD_RUNTIME=test) against a fake nvidia-smi that lists our processes as a mode
# says, and against fake kvpoolds that fail at a given point. Each case checks the
# step's verdict in the summary, the script's exit status and that no process of the
# case is left behind. It prints each case and exits non-zero if any failed.
#
#	scripts/gpu-check-test.sh
set -uo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! go build -tags cudapool_softdevice -o "$tmp/kvpoold" ./cmd/kvpoold; then
	echo "gpu-check-test: cannot build kvpoold" >&2
	exit 2
fi
failed=0

# The fake nvidia-smi: the compute apps that FAKE_SMI's mode lists, found with ps among
# the processes of the executable FAKE_KVPOOLD (kvpoold and its keeper, "kvpoold
# keeper ..."). owner: kvpoold alone; both: kvpoold and the keeper; none: nothing;
# foreign: kvpoold under a pid of another namespace; foreign-both: both so; fails:
# nvidia-smi's own failure.
mkdir -p "$tmp/smi"
cat >"$tmp/smi/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
if [ "$FAKE_SMI" = fails ]; then
	echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"
	exit 9
fi
ps -eo pid=,args= | while read -r pid exe rest; do
	[ "$exe" = "$FAKE_KVPOOLD" ] || continue
	case "$FAKE_SMI:$rest" in
	owner:keeper* | none:* | foreign:keeper*) ;;
	owner:* | both:*) echo "$pid, $exe, 130 MiB" ;;
	foreign:* | foreign-both:*) echo "$((pid + 4000000)), $exe, 130 MiB" ;;
	esac
done
EOF
chmod +x "$tmp/smi/nvidia-smi"

# A fake kvpoold that serves, names a keeper (a sleep of its own) and, started again on
# the same -dir, says it made a new cache instead of adopting: the step must fail.
cat >"$tmp/forgetful" <<'EOF'
#!/usr/bin/env bash
while [ $# -gt 0 ]; do [ "$1" = -dir ] && dir=$2; shift; done
trap 'echo "kvpoold: stopped"; exit 0' TERM
if [ -e "$dir/started" ]; then
	echo "kvpoold: serving $dir on device(s) [0]: ...; new cache in keeper pid $(cat "$dir/started")"
else
	setsid sleep 300 </dev/null >/dev/null 2>&1 &
	echo $! >"$dir/started"
	echo "kvpoold: serving $dir on device(s) [0]: ...; new cache in keeper pid $!"
fi
while :; do sleep 0.1; done
EOF
# A fake kvpoold that fails at its start.
printf '#!/usr/bin/env bash\necho "kvpoold: no GPU" >&2\nexit 1\n' >"$tmp/broken"
chmod +x "$tmp/forgetful" "$tmp/broken"

# check NAME WANT-RC WANT-SUMMARY PATH-PREFIX KVPOOLD SMI-MODE runs the step and checks
# its exit status and that its summary line starts with WANT-SUMMARY.
check() {
	local name=$1 want_rc=$2 want=$3 path=$4 kvpoold=$5 mode=$6 out rc line left
	out=$(env PATH="$path$PATH" FAKE_SMI="$mode" FAKE_KVPOOLD="$kvpoold" CHECK_ONLY=kvpoold-keeper \
		KVPOOLD="$kvpoold" KVPOOLD_RUNTIME=test timeout 120 bash scripts/gpu-check.sh 2>&1)
	rc=$?
	line=$(grep -E '^kvpoold-keeper +' <<<"$out" | tail -n 1 | sed -E 's/^kvpoold-keeper +//')
	left=$(ps -eo stat=,args= | awk -v k="$kvpoold" '$1 !~ /^Z/ && ($2 == k || index($0, "sleep " "300")) { print }')
	if [ $rc -eq "$want_rc" ] && [[ $line == "$want"* ]] && [ -z "$left" ]; then
		echo "ok   $name: $line"
	else
		echo "FAIL $name: exit $rc (want $want_rc), summary \"$line\" (want \"$want...\")${left:+, left running: $left}"
		echo "$out" | sed 's/^/	/'
		failed=1
	fi
}

fake=$tmp/smi:
if ! command -v nvidia-smi >/dev/null; then
	check "no nvidia-smi" 0 "not run (no nvidia-smi)" "" "$tmp/kvpoold" owner
fi
check "kvpoold listed, its keeper not" 0 "PASS: nvidia-smi lists kvpoold (pid" "$fake" "$tmp/kvpoold" owner
check "the keeper listed" 1 "FAIL(nvidia-smi lists the keeper (pid" "$fake" "$tmp/kvpoold" both
check "nothing listed" 0 "not run (nvidia-smi lists neither kvpoold" "$fake" "$tmp/kvpoold" none
check "another pid namespace, one kvpoold" 0 "PASS: nvidia-smi lists no pid of ours (another pid namespace) but one kvpoold process" "$fake" "$tmp/kvpoold" foreign
check "another pid namespace, two kvpoolds" 1 "FAIL(nvidia-smi lists no pid of ours (another pid namespace) but 2 kvpoold processes" "$fake" "$tmp/kvpoold" foreign-both
check "nvidia-smi fails" 1 "FAIL(nvidia-smi --query-compute-apps failed: NVIDIA-SMI has failed" "$fake" "$tmp/kvpoold" fails
check "kvpoold fails at its start" 1 "FAIL(kvpoold: it exited before saying" "$fake" "$tmp/broken" owner
check "no kvpoold binary" 1 "FAIL(no $tmp/absent: run scripts/build-gpu.sh first)" "$fake" "$tmp/absent" owner
check "the next kvpoold does not adopt" 1 "FAIL(kvpoold started again did not adopt the keeper (pid" "$fake" "$tmp/forgetful" owner
exit $failed
