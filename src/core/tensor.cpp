#include "flexep/core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <mutex>

namespace flexep {

std::string Device::str() const { return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index); }

Shape::Shape(std::initializer_list<std::int64_t> dims) : Shape(std::vector<std::int64_t>(dims)) {}

Shape::Shape(const std::vector<std::int64_t>& dims) {
  FLEXEP_CHECK(dims.size() <= kMaxRank, "tensor rank ", dims.size(), " exceeds the maximum of ", kMaxRank);
  rank_ = static_cast<int>(dims.size());
  for (std::size_t i = 0; i < dims.size(); ++i) {
    FLEXEP_CHECK(dims[i] >= 0, "negative tensor dimension ", dims[i]);
    dims_[i] = dims[i];
  }
}

std::int64_t Shape::numel() const {
  if (rank_ < 0) return 0;
  std::int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[static_cast<std::size_t>(i)];
  return n;
}

std::string Shape::str() const {
  if (rank_ < 0) return "undefined";
  std::string s = "[";
  for (int i = 0; i < rank_; ++i) s += detail::concat(i ? ", " : "", dims_[static_cast<std::size_t>(i)]);
  return s + "]";
}

bool operator==(const Shape& a, const Shape& b) {
  if (a.rank_ != b.rank_) return false;
  for (int i = 0; i < a.rank_; ++i)
    if (a.dims_[static_cast<std::size_t>(i)] != b.dims_[static_cast<std::size_t>(i)]) return false;
  return true;
}

TensorView TensorView::rows(std::int64_t begin, std::int64_t end) const {
  FLEXEP_CHECK(dim() >= 1 && begin >= 0 && begin <= end && end <= size(0), "rows(", begin, ", ", end,
               ") out of range for shape ", shape.str());
  std::vector<std::int64_t> d(static_cast<std::size_t>(dim()));
  for (int i = 0; i < dim(); ++i) d[static_cast<std::size_t>(i)] = shape[i];
  std::size_t row_elems = 1;
  for (int i = 1; i < dim(); ++i) row_elems *= static_cast<std::size_t>(shape[i]);
  d[0] = end - begin;
  const std::size_t stride = row_elems * element_size(dtype);
  void* p = data ? static_cast<char*>(data) + static_cast<std::size_t>(begin) * stride : nullptr;
  return TensorView(p, dtype, Shape(d), device);
}

TensorView TensorView::reshape(Shape s) const {
  FLEXEP_CHECK(s.numel() == numel(), "cannot reshape ", shape.str(), " to ", s.str());
  return TensorView(data, dtype, s, device);
}

namespace {
std::mutex g_alloc_mutex;
Allocator* g_allocators[2] = {nullptr, nullptr};
}  // namespace

void register_allocator(DeviceKind kind, Allocator* allocator) {
  std::lock_guard<std::mutex> lock(g_alloc_mutex);
  g_allocators[static_cast<int>(kind)] = allocator;
}

Allocator* allocator_for(DeviceKind kind) {
  std::lock_guard<std::mutex> lock(g_alloc_mutex);
  return g_allocators[static_cast<int>(kind)];
}

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  FLEXEP_CHECK(shape.defined(), "Tensor::empty needs a defined shape");
  Tensor t;
  const std::size_t bytes = static_cast<std::size_t>(shape.numel()) * element_size(dtype);
  void* p = nullptr;
  if (device.is_cpu()) {
    // 64-byte alignment: vector loads in references and safe for any element type.
    if (bytes) {
      p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
      FLEXEP_CHECK(p != nullptr, "out of host memory allocating ", bytes, " bytes");
    }
    t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  } else {
    Allocator* a = allocator_for(device.kind);
    FLEXEP_CHECK(a != nullptr, "no allocator for device ", device.str(),
                 " (was flexep built with FLEXEP_CUDA=ON and is a GPU visible?)");
    if (bytes) p = a->allocate(bytes, device);
    t.storage_ = std::shared_ptr<void>(p, [a, device](void* q) {
      if (q) a->deallocate(q, device);
    });
  }
  t.view_ = TensorView(p, dtype, shape, device);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_zero();
  return t;
}

Tensor Tensor::wrap(TensorView view, std::shared_ptr<void> owner) {
  Tensor t;
  t.storage_ = std::move(owner);
  t.view_ = view;
  return t;
}

void Tensor::fill_zero() {
  if (!nbytes()) return;
  if (device().is_cpu()) std::memset(raw(), 0, nbytes());
  else allocator_for(device().kind)->memset_zero(raw(), nbytes(), device());
}

Tensor Tensor::clone() const {
  FLEXEP_CHECK(device().is_cpu(), "Tensor::clone is CPU only");
  Tensor t = empty(shape(), dtype());
  if (nbytes()) std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

double read_as_double(const TensorView& t, std::int64_t i) {
  switch (t.dtype) {
    case DType::bf16: return static_cast<const bf16*>(t.data)[i].to_float();
    case DType::f16: return static_cast<const f16*>(t.data)[i].to_float();
    case DType::f32: return static_cast<const float*>(t.data)[i];
    case DType::f64: return static_cast<const double*>(t.data)[i];
    case DType::i32: return static_cast<const std::int32_t*>(t.data)[i];
    case DType::i64: return static_cast<double>(static_cast<const std::int64_t*>(t.data)[i]);
    case DType::b8: return static_cast<const bool*>(t.data)[i] ? 1.0 : 0.0;
    case DType::e4m3: break;
  }
  throw_error("read_as_double: unsupported dtype ", dtype_name(t.dtype));
}

void write_from_double(const TensorView& t, std::int64_t i, double v) {
  switch (t.dtype) {
    case DType::bf16: static_cast<bf16*>(t.data)[i] = bf16::from_float(static_cast<float>(v)); return;
    case DType::f16: static_cast<f16*>(t.data)[i] = f16::from_float(static_cast<float>(v)); return;
    case DType::f32: static_cast<float*>(t.data)[i] = static_cast<float>(v); return;
    case DType::f64: static_cast<double*>(t.data)[i] = v; return;
    case DType::i32: static_cast<std::int32_t*>(t.data)[i] = static_cast<std::int32_t>(v); return;
    case DType::i64: static_cast<std::int64_t*>(t.data)[i] = static_cast<std::int64_t>(v); return;
    case DType::b8: static_cast<bool*>(t.data)[i] = v != 0.0; return;
    case DType::e4m3: break;
  }
  throw_error("write_from_double: unsupported dtype ", dtype_name(t.dtype));
}

Tensor Tensor::to(DType target) const {
  FLEXEP_CHECK(device().is_cpu(), "Tensor::to is CPU only");
  if (target == dtype()) return clone();
  Tensor t = empty(shape(), target);
  const std::int64_t n = numel();
  if (dtype() == DType::f32 && target == DType::bf16) {
    const float* s = data<float>();
    bf16* d = t.data<bf16>();
    for (std::int64_t i = 0; i < n; ++i) d[i] = bf16::from_float(s[i]);
    return t;
  }
  for (std::int64_t i = 0; i < n; ++i) write_from_double(t, i, read_as_double(*this, i));
  return t;
}

}  // namespace flexep
