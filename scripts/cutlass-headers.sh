#!/usr/bin/env bash
# Prints the folder of CUTLASS's C++ headers (cute/, cutlass/) that the CUDA kernels build on: the
# `nvidia-cutlass` package from PyPI (it ships them under cutlass_library/source/include), installed
# without its Python dependencies into the project's virtual environment ($FLEXEP_VENV or <repo>/.venv,
# made here if missing; scripts/python-env.sh fills the rest of it). Cheap when the package is there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FLEXEP_VENV:-$root/.venv}"
package="nvidia-cutlass==4.2.0.0"
if [ ! -x "$venv/bin/python" ]; then
  echo "cutlass-headers: creating $venv" >&2
  "${PYTHON:-python3}" -m venv "$venv" >&2
fi
find_include() {
  "$venv/bin/python" - <<'PY' 2>/dev/null
import importlib.util, os
spec = importlib.util.find_spec("cutlass_library")
path = os.path.join(os.path.dirname(spec.origin), "source", "include")
assert os.path.isfile(os.path.join(path, "cute", "tensor.hpp"))
print(path)
PY
}
if ! include="$(find_include)"; then
  echo "cutlass-headers: pip install --no-deps $package" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$package" >&2
  include="$(find_include)"
fi
echo "$include"
