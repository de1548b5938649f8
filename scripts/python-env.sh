#!/usr/bin/env bash
# Makes (once) and fills the project's virtual environment, $FLEXEP_VENV or <repo>/.venv, with what
# python/requirements-test.txt lists plus nemo-automodel==0.7.0 (without its dependencies, see that
# file), and prints the environment's python. A fresh Debian or Ubuntu refuses pip installs into the
# system Python, so nothing is installed outside the environment. Cheap when everything is there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FLEXEP_VENV:-$root/.venv}"
base="${PYTHON:-python3}"
automodel="nemo-automodel==0.7.0"

if [ ! -x "$venv/bin/python" ]; then
  echo "python-env: creating $venv with $("$base" --version 2>&1)" >&2
  "$base" -m venv "$venv" >&2
fi
py="$venv/bin/python"
# The environment is current when it was filled from this very requirements file (a stamp of its
# hash) and everything imports.
want="$(sha256sum "$root/python/requirements-test.txt" | cut -d' ' -f1) $automodel"
probe='import numpy, pytest, hypothesis, nanobind, scikit_build_core, torch, transformers
from importlib.metadata import version
assert version("nemo-automodel") == "0.7.0"'
if [ "$(cat "$venv/.flexep-stamp" 2>/dev/null)" != "$want" ] || ! "$py" -c "$probe" >/dev/null 2>&1; then
  # torch's Linux wheel brings its CUDA libraries: about 5 GB and a few minutes.
  echo "python-env: pip install -r python/requirements-test.txt and $automodel (--no-deps)" >&2
  "$py" -m pip install --quiet --disable-pip-version-check -r "$root/python/requirements-test.txt" >&2
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps "$automodel" >&2
  echo "$want" > "$venv/.flexep-stamp"
fi
echo "$py"
