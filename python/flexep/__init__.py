"""flexep: Mixture-of-Experts expert parallelism (C++/CUDA), from Python.

`flexep._flexep` is the extension (nanobind, tensors as DLPack, no libtorch link); `flexep.torch`
has the PyTorch modules and autograd Functions with NeMo Automodel's names.
"""

from flexep import _flexep

__version__ = "0.1.0"

Error = _flexep.Error
ArgumentError = _flexep.ArgumentError
TimeoutError = _flexep.TimeoutError  # noqa: A001 (a subclass of the builtin, like the C++ one)
HAS_CUDA = _flexep.HAS_CUDA

__all__ = ["Error", "ArgumentError", "TimeoutError", "HAS_CUDA", "__version__"]
