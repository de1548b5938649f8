#!/usr/bin/env bash
# The main job: installs what is missing, builds the flexep program and runs `flexep train` on the
# embedded default (arguments are passed on, e.g. scripts/train.sh --ranks 8 --steps 300).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install-deps.sh"
# The build's output is kept out of the job's, but shown when the build fails.
log="$(mktemp)"
if ! FLEXEP_TARGETS=flexep_cli "$root/scripts/build.sh" >"$log" 2>&1; then
  cat "$log" >&2
  echo "scripts/train.sh: the build failed (output above)" >&2
  rm -f "$log"
  exit 1
fi
rm -f "$log"
exec "${FLEXEP_BUILD_DIR:-$root/build}/flexep" train "$@"
