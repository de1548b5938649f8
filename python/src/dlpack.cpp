#include "dlpack.h"

#include <memory>
#include <vector>

#include "flexep/core/error.h"

namespace flexep::py {

namespace {

using nb::dlpack::dtype_code;

// DLPack device types (dlpack.h: kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged).
constexpr int kCpu = 1, kCuda = 2, kCudaHost = 3, kCudaManaged = 13;

DType dtype_from_dlpack(nb::dlpack::dtype t, const std::string& arg) {
  const auto code = static_cast<dtype_code>(t.code);
  if (t.lanes == 1) {
    if (code == dtype_code::Float && t.bits == 32) return DType::f32;
    if (code == dtype_code::Float && t.bits == 64) return DType::f64;
    if (code == dtype_code::Float && t.bits == 16) return DType::f16;
    if (code == dtype_code::Bfloat && t.bits == 16) return DType::bf16;
    if (code == dtype_code::Int && t.bits == 32) return DType::i32;
    if (code == dtype_code::Int && t.bits == 64) return DType::i64;
    if (code == dtype_code::Bool && t.bits == 8) return DType::b8;
    if (code == dtype_code::Float8_E4M3FN && t.bits == 8) return DType::e4m3;
  }
  throw_argument_error(arg, "DLPack dtype (code ", int(t.code), ", bits ", int(t.bits), ", lanes ", t.lanes,
                       ") is not supported; allowed: bfloat16, float16, float32, float64, int32, int64, bool, "
                       "float8_e4m3fn");
}

nb::dlpack::dtype dtype_to_dlpack(DType t) {
  auto make = [](dtype_code c, int bits) {
    nb::dlpack::dtype d;
    d.code = static_cast<std::uint8_t>(c);
    d.bits = static_cast<std::uint8_t>(bits);
    d.lanes = 1;
    return d;
  };
  switch (t) {
    case DType::bf16: return make(dtype_code::Bfloat, 16);
    case DType::f16: return make(dtype_code::Float, 16);
    case DType::f32: return make(dtype_code::Float, 32);
    case DType::f64: return make(dtype_code::Float, 64);
    case DType::i32: return make(dtype_code::Int, 32);
    case DType::i64: return make(dtype_code::Int, 64);
    case DType::b8: return make(dtype_code::Bool, 8);
    case DType::e4m3: return make(dtype_code::Float8_E4M3FN, 8);
  }
  throw_error("dtype_to_dlpack: unknown dtype");
}

Device device_from_dlpack(int type, int id, const std::string& arg) {
  // Pinned host memory is host memory for the library's CPU code.
  if (type == kCpu || type == kCudaHost) return Device::cpu();
  if (type == kCuda || type == kCudaManaged) return Device::cuda(id);
  throw_argument_error(arg, "lives on DLPack device type ", type, "; allowed: CPU, CUDA");
}

}  // namespace

TensorView to_view(const Array& a, const std::string& arg) {
  FLEXEP_CHECK_ARG(a.ndim() <= static_cast<std::size_t>(Shape::kMaxRank), arg, "has ", a.ndim(),
                   " dimensions; at most ", Shape::kMaxRank, " are supported");
  std::vector<std::int64_t> dims(a.ndim());
  for (std::size_t i = 0; i < a.ndim(); ++i) dims[i] = static_cast<std::int64_t>(a.shape(i));
  return TensorView(const_cast<void*>(a.data()), dtype_from_dlpack(a.dtype(), arg), Shape(dims),
                    device_from_dlpack(a.device_type(), a.device_id(), arg));
}

namespace {
Array cast_array(const nb::handle& obj, const std::string& arg) {
  Array a;
  if (!nb::try_cast(obj, a))
    throw_argument_error(arg, "expected a C-contiguous tensor or array exporting DLPack (torch.Tensor, "
                              "numpy.ndarray), got ", nb::type_name(obj.type()).c_str());
  return a;
}
}  // namespace

TensorView to_view_or_none(const nb::handle& obj, const std::string& arg) {
  if (obj.is_none()) return TensorView();
  return to_view(cast_array(obj, arg), arg);
}

Tensor to_tensor(const nb::handle& obj, const std::string& arg) {
  Array a = cast_array(obj, arg);
  TensorView v = to_view(a, arg);
  // The ndarray handle keeps the producer's memory alive; its destructor needs the GIL, which the
  // last owner may not hold (library threads), hence the acquire.
  auto owner = std::shared_ptr<void>(new Array(std::move(a)), [](void* p) {
    nb::gil_scoped_acquire gil;
    delete static_cast<Array*>(p);
  });
  return Tensor::wrap(v, std::move(owner));
}

nb::object to_python(const Tensor& t) {
  if (!t.defined()) return nb::none();
  // The capsule owns a Tensor sharing the storage: the memory is freed when Python lets go of it.
  auto* keep = new Tensor(t);
  nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  std::vector<std::size_t> shape(static_cast<std::size_t>(t.shape().rank()));
  for (int i = 0; i < t.shape().rank(); ++i) shape[static_cast<std::size_t>(i)] = static_cast<std::size_t>(t.size(i));
  const int device_type = t.device().is_cpu() ? kCpu : kCuda;
  OutArray out(t.raw(), shape.size(), shape.data(), owner, nullptr, dtype_to_dlpack(t.dtype()), device_type,
               t.device().is_cpu() ? 0 : t.device().index);
  return nb::cast(out, nb::rv_policy::reference);
}

}  // namespace flexep::py
