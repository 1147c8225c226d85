#!/usr/bin/env bash
# python-tests.sh runs the Python package's tests (python/tests) against
# bin/libcudapool.so (or $CUDAPOOL_LIB): with pytest where it imports, else with the
# standard library's unittest. Extra arguments go to pytest. On a GPU host run it with
# CUDAPOOL_REQUIRE_GPU=1: the tests then run on the GPU and the torch, CuPy and
# cuda.core tests fail instead of skipping where those packages are absent.
set -uo pipefail
cd "$(dirname "$0")/.."
export CUDAPOOL_LIB=${CUDAPOOL_LIB:-$PWD/bin/libcudapool.so}
if [ ! -f "$CUDAPOOL_LIB" ]; then
	echo "python-tests: no $CUDAPOOL_LIB: go build -buildmode=c-shared -o bin/libcudapool.so ./capi (add -tags cudapool_softdevice to run on the software device)" >&2
	exit 2
fi
py=${PYTHON:-python3}
if "$py" -c 'import pytest' 2>/dev/null; then
	"$py" -m pytest -q python/tests "$@"
	rc=$?
	# pytest's 5 is "no tests collected": here that can only mean the tests were lost.
	if [ $rc -eq 5 ]; then echo "python-tests: pytest collected no tests" >&2; fi
	exit $rc
fi
echo "python-tests: no pytest for $py; running the tests with unittest"
"$py" -m unittest discover -s python/tests -t python/tests -v
