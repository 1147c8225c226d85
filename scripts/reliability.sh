#!/usr/bin/env bash
# reliability.sh runs the producer package's reliability run on the software device (no GPU needed;
# about 10 s): descriptor exhaustion and recovery, handshakes across connection-id
# spaces, SIGKILL storms of consumer and producer processes, and Close under hostile
# peers. Each part is bounded in time and checks what it reports. It prints the table
# the README's Reliability section quotes, and writes it to $OUT/reliability.md when
# OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
report=$(mktemp)
trap 'rm -f "$report"' EXIT
CUDAPOOL_RELIABILITY=1 CUDAPOOL_RELIABILITY_REPORT=$report \
	go test -count=1 -run '^TestReliability$' -timeout 5m ./export/producer/ >/dev/null
echo "Reliability run, $(date -u '+%Y-%m-%d %H:%M UTC'), $(go version | cut -d' ' -f3), $(nproc) CPUs:"
cat "$report"
if [ -n "${OUT:-}" ]; then
	cp "$report" "$OUT/reliability.md"
fi
