// Tensors across the Python boundary through DLPack (nanobind's nb::ndarray implements the protocol
// both ways), always zero-copy:
//   - in:  any object with __dlpack__ (torch.Tensor, numpy.ndarray, ...) becomes a TensorView of the
//          same memory; the caller's object must outlive the call (it does: it is an argument);
//   - out: a flexep::Tensor becomes an ndarray that owns a reference to the tensor's storage, so the
//          memory lives as long as the Python side (torch.from_dlpack / numpy.from_dlpack) holds it.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string>

#include "flexep/core/tensor.h"

namespace flexep::py {

namespace nb = nanobind;

// What the binding accepts: any device, any dtype, C-contiguous (nanobind asks the producer for a
// contiguous copy otherwise).
using Array = nb::ndarray<nb::c_contig>;
// What the binding returns: an object with __dlpack__ / __dlpack_device__ (and the buffer protocol
// on the CPU), for torch.from_dlpack or numpy.from_dlpack.
using OutArray = nb::ndarray<nb::array_api>;

// `arg` names the argument in errors (unsupported dtype, rank > 4, unknown device).
TensorView to_view(const Array& a, const std::string& arg);
// Undefined view for None.
TensorView to_view_or_none(const nb::handle& obj, const std::string& arg);
// An owning Tensor over the array's memory: keeps the Python object alive (for values the library
// stores beyond the call, e.g. parameters loaded from Python).
Tensor to_tensor(const nb::handle& obj, const std::string& arg);
// Zero-copy export; an undefined tensor becomes None.
nb::object to_python(const Tensor& t);

}  // namespace flexep::py
