"""Device tests (2 GPUs, a CUDA build): the alltoall and hybridep backends through PyTorch across 2
processes, against the pure-PyTorch reference; micro-batch accumulation; state_dict round trip
with the reference module; the correction bias update over the group.
Each test launches `torchrun --nproc-per-node 2 worker.py CASE BACKEND`; CI does not collect this folder.

Run: PYTHONPATH=build/python python -m pytest -q python/tests/gpu
"""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import flexep  # noqa: E402
from flexep import _flexep  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not flexep.HAS_CUDA or torch.cuda.device_count() < 2,
                       reason="needs a CUDA build of flexep and 2 GPUs"),
]

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(case, backend):
    if backend == "hybridep" and "hybridep" not in _flexep.gpu_dispatcher_names():
        pytest.skip("this build has no hybridep backend (a CPU-only build)")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(29500 + (hash((case, backend)) % 500)), os.path.join(HERE, "worker.py"), case, backend]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}"
    assert r.stdout.count("PASS") == 2, r.stdout[-3000:]


@pytest.mark.parametrize("backend", ["torch", "hybridep"])
def test_dispatch_combine_functions_match_reference(backend):
    launch("functions", backend)


@pytest.mark.parametrize("backend", ["torch", "hybridep"])
def test_moe_layer_matches_reference(backend):
    launch("layer", backend)


def test_micro_batches_accumulate_fresh_gradients():
    launch("micro_batches", "torch")


def test_state_dict_round_trip_with_reference_module():
    launch("state_dict", "torch")


def test_correction_bias_is_the_library_buffer():
    launch("correction_bias", "torch")
