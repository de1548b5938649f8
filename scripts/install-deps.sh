#!/usr/bin/env bash
# Installs what flexep needs from Debian/Ubuntu packages (and, with --python, from PyPI).
# Skips everything that is already installed, so it is cheap to call before every build.
set -euo pipefail

packages=(build-essential cmake ninja-build pkg-config googletest libgtest-dev libbenchmark-dev
          libcli11-dev libfmt-dev libspdlog-dev nlohmann-json3-dev libopenmpi-dev openmpi-bin)

missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done

if ((${#missing[@]})); then
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  echo "install-deps: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --python: what the Python extension and its tests need, from PyPI (torch's Linux wheel brings its
# CUDA libraries: about 5 GB and 1.5 minutes here). Skipped when everything already imports.
if [ "${1:-}" = "--python" ]; then
  py="${PYTHON:-python3}"
  if ! "$py" -c "import numpy, pytest, nanobind, scikit_build_core, torch" >/dev/null 2>&1; then
    echo "install-deps: pip install numpy pytest nanobind scikit-build-core torch"
    "$py" -m pip install --quiet --disable-pip-version-check numpy pytest nanobind scikit-build-core torch
  fi
fi
