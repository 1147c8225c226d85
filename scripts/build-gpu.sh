#!/usr/bin/env bash
# build-gpu.sh runs where Go is, and builds what scripts/gpu-check.sh runs on a GPU
# host that has no Go: bin/gpu/<package>.test for every package whose tests can reach
# a GPU, those that import internal/gputest or cudart/choose (or a package under it),
# listed with the package's folder in bin/gpu/tests.txt, as a test binary runs in its
# package's folder (the others run on the software device alone, here and in CI, and
# are not carried: what travels to the host is capped); the commands under cmd/,
# examples/ and bench/ (the benchmark suite's bin/gpu/gosuite) when there are any; and
# libcudapool.so; each compressed with xz.
# It builds every package it can, and exits non-zero if any build failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=bin/gpu
rm -rf "$out"
mkdir -p "$out"
# The GPU host is linux/amd64; cgo is the CUDA binding. Symbols and DWARF are left out
# to keep what travels to the host small.
export CGO_ENABLED=1 GOOS=linux GOARCH=amd64
flags=(-trimpath -ldflags=-s\ -w)
module=$(go list -m)
failed=0

while read -r pkg dir; do
	[ -n "$pkg" ] || continue
	rel=${pkg#"$module"}
	rel=${rel#/}
	name=${rel//\//_}
	name=${name:-root}
	if go test -c "${flags[@]}" -o "$out/$name.test" "$pkg"; then
		echo "$name ${dir#"$PWD"/}" >>"$out/tests.txt"
		echo "built $out/$name.test"
	else
		echo "build-gpu: FAILED to build the tests of $pkg" >&2
		failed=1
	fi
done < <(go list -f '{{if or .TestGoFiles .XTestGoFiles}}{{.ImportPath}} {{.Dir}} {{join .TestImports " "}} {{join .XTestImports " "}}{{end}}' ./... |
	awk -v m="$module" '{ for (i = 3; i <= NF; i++) if ($i == m "/internal/gputest" || index($i, m "/cudart/choose") == 1) { print $1, $2; next } }')

mains=$(go list -f '{{if eq .Name "main"}}{{.ImportPath}}{{end}}' ./cmd/... ./examples/... ./bench/... 2>/dev/null)
if [ -n "$mains" ]; then
	# shellcheck disable=SC2086 # one argument per package
	if go build "${flags[@]}" -o "$out/" $mains; then
		echo "built commands:" $mains
	else
		echo "build-gpu: FAILED to build commands" >&2
		failed=1
	fi
fi
# libcudapool for the Python package and the torch examples (gpu-examples.sh).
if go build -buildmode=c-shared "${flags[@]}" -o "$out/libcudapool.so" ./capi; then
	rm -f "$out/libcudapool.h" # cgo's; the interface is capi/cudapool.h
	echo "built $out/libcudapool.so"
else
	echo "build-gpu: FAILED to build libcudapool.so" >&2
	failed=1
fi
# What travels to the GPU host is capped (64 MiB with the working tree), and Go
# binaries shrink to about 30% in xz (a quarter less than in gzip, which no longer
# fitted): they travel compressed, and the host's scripts unpack them there
# (scripts/unpack.sh).
xz -6 -T0 -f "$out"/*.test $(find "$out" -maxdepth 1 -type f \( -perm -u+x -o -name '*.so' \) ! -name '*.test')
go version >"$out/go-version.txt"
# The commit the binaries were built from (the GPU host's copy of the tree has no
# history of its own to ask): bench-suite.sh records it with the run.
commit=$(git rev-parse --short HEAD 2>/dev/null) && {
	git diff --quiet HEAD 2>/dev/null || commit="$commit+changes"
	echo "$commit" >"$out/commit.txt"
}
du -sh "$out"
exit $failed
