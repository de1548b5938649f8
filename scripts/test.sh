#!/usr/bin/env bash
# The test command (CI runs it through .ci/run): installs what is missing, builds everything
# (the CUDA code too when nvcc is present) and the Python extension, runs every CPU test (C++, then
# Python through PyTorch), then the C++ ones again under
# AddressSanitizer + UBSan, then the main job as a smoke test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install-deps.sh"
py="$("$root/scripts/python-env.sh")"   # the project's virtual environment (.venv)

echo "== build (release, with the Python extension)"
FLEXEP_BUILD_DIR="$root/build" "$root/scripts/build.sh" -DFLEXEP_BUILD_PYTHON=ON -DPython_EXECUTABLE="$py"
echo "== CPU tests"
ctest --test-dir "$root/build" -LE gpu --output-on-failure -j "$(nproc)"
echo "== Python tests (CPU; python/tests/gpu needs 2 GPUs and is not collected here)"
PYTHONPATH="$root/build/python" "$py" -m pytest -q "$root/python/tests" --ignore="$root/python/tests/gpu"

echo "== build (address + undefined sanitizers, host code)"
FLEXEP_BUILD_DIR="$root/build-sanitize" FLEXEP_BUILD_TYPE=RelWithDebInfo FLEXEP_TARGETS="flexep_tests flexep_cli" \
  "$root/scripts/build.sh" -DFLEXEP_CUDA=OFF -DFLEXEP_SANITIZE=address,undefined
echo "== CPU tests under sanitizers"
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
  ctest --test-dir "$root/build-sanitize" -LE gpu --output-on-failure -j "$(nproc)"

echo "== main job smoke test"
"$root/build/flexep" train --quiet
echo "== all tests passed"
