#!/usr/bin/env bash
# The main job: installs what is missing, builds the flexep program and runs `flexep train` on the
# embedded default (arguments are passed on, e.g. scripts/train.sh --ranks 8 --steps 300).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/install-deps.sh"
FLEXEP_TARGETS=flexep_cli "$root/scripts/build.sh" >/dev/null
exec "${FLEXEP_BUILD_DIR:-$root/build}/flexep" train "$@"
