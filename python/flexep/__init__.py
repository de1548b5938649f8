"""flexep: Mixture-of-Experts expert parallelism (C++/CUDA), from Python.

`flexep._flexep` is the extension (nanobind, tensors as DLPack, no libtorch link); `flexep.torch`
has the PyTorch modules and autograd Functions with NeMo Automodel's names.
"""

import importlib.util

# A CUDA build of the extension needs libnccl.so.2, and so does PyTorch, whose NCCL is newer than a
# CUDA toolkit's: whichever loads first owns the soname for the whole process. Let PyTorch load first
# when it is installed (the device build compiles against PyTorch's NCCL for the same reason).
if importlib.util.find_spec("torch") is not None:
    import torch  # noqa: F401

from flexep import _flexep  # noqa: E402

__version__ = "0.1.0"

Error = _flexep.Error
ArgumentError = _flexep.ArgumentError
TimeoutError = _flexep.TimeoutError  # noqa: A001 (a subclass of the builtin, like the C++ one)
HAS_CUDA = _flexep.HAS_CUDA

__all__ = ["Error", "ArgumentError", "TimeoutError", "HAS_CUDA", "__version__"]
