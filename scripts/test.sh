#!/usr/bin/env bash
# The test command (CI runs it through .ci/run): installs what is missing, builds everything
# (the CUDA code too when nvcc is present), runs every CPU test, then again under
# AddressSanitizer + UBSan, then the main job as a smoke test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install-deps.sh"

echo "== build (release)"
FLEXEP_BUILD_DIR="$root/build" "$root/scripts/build.sh"
echo "== CPU tests"
ctest --test-dir "$root/build" -LE gpu --output-on-failure -j "$(nproc)"

echo "== build (address + undefined sanitizers, host code)"
FLEXEP_BUILD_DIR="$root/build-sanitize" FLEXEP_BUILD_TYPE=RelWithDebInfo FLEXEP_TARGETS="flexep_tests flexep_cli" \
  "$root/scripts/build.sh" -DFLEXEP_CUDA=OFF -DFLEXEP_SANITIZE=address,undefined
echo "== CPU tests under sanitizers"
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
  ctest --test-dir "$root/build-sanitize" -LE gpu --output-on-failure -j "$(nproc)"

echo "== main job smoke test"
"$root/build/flexep" train --quiet
echo "== all tests passed"
