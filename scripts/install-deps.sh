#!/usr/bin/env bash
# Installs what flexep needs from Debian/Ubuntu packages (and, with --python, from PyPI).
# Skips everything that is already installed, so it is cheap to call before every build.
set -euo pipefail

packages=(build-essential cmake ninja-build pkg-config googletest libgtest-dev libbenchmark-dev
          libcli11-dev libfmt-dev libspdlog-dev nlohmann-json3-dev libopenmpi-dev openmpi-bin
          python3 python3-venv)

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

# --python: the project's virtual environment with what the Python extension and its tests need
# (scripts/python-env.sh; it prints the environment's python).
if [ "${1:-}" = "--python" ]; then
  "$(dirname "${BASH_SOURCE[0]}")/python-env.sh" >/dev/null
fi
