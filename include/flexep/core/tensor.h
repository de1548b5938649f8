// Tensors: a non-owning, contiguous, row-major view (TensorView) and an owning tensor (Tensor)
// whose storage is reference counted. The core is device-agnostic: memory on a GPU is obtained
// through an Allocator that the CUDA layer registers at start-up.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "flexep/core/dtype.h"
#include "flexep/core/error.h"

namespace flexep {

enum class DeviceKind : std::uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  static Device cpu() { return {}; }
  static Device cuda(int i) { return {DeviceKind::cuda, i}; }
  bool is_cpu() const { return kind == DeviceKind::cpu; }
  bool is_cuda() const { return kind == DeviceKind::cuda; }
  std::string str() const;
  friend bool operator==(const Device& a, const Device& b) { return a.kind == b.kind && a.index == b.index; }
  friend bool operator!=(const Device& a, const Device& b) { return !(a == b); }
};

// Up to four dimensions; rank -1 marks an undefined (absent optional) tensor.
class Shape {
 public:
  static constexpr int kMaxRank = 4;
  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims);
  explicit Shape(const std::vector<std::int64_t>& dims);
  int rank() const { return rank_; }
  bool defined() const { return rank_ >= 0; }
  std::int64_t operator[](int i) const { return dims_[static_cast<std::size_t>(i)]; }
  std::int64_t numel() const;
  std::string str() const;  // "[4096, 7168]"
  friend bool operator==(const Shape& a, const Shape& b);
  friend bool operator!=(const Shape& a, const Shape& b) { return !(a == b); }

 private:
  int rank_ = -1;
  std::array<std::int64_t, kMaxRank> dims_{};
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Shape shape;
  Device device;

  TensorView() = default;
  TensorView(void* d, DType t, Shape s, Device dev = Device::cpu()) : data(d), dtype(t), shape(s), device(dev) {}

  bool defined() const { return shape.defined(); }
  int dim() const { return shape.rank(); }
  std::int64_t size(int i) const { return shape[i]; }
  std::int64_t numel() const { return shape.numel(); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * element_size(dtype); }

  // Typed pointer; throws if T does not match dtype (catches dtype confusion early).
  template <class T>
  T* ptr() const {
    FLEXEP_CHECK(dtype_of_v<T> == dtype, "tensor of dtype ", dtype_name(dtype), " accessed as ",
                 dtype_name(dtype_of_v<T>));
    return static_cast<T*>(data);
  }
  // View of rows [begin, end) of the leading dimension.
  TensorView rows(std::int64_t begin, std::int64_t end) const;
  // Same memory, new shape of the same element count.
  TensorView reshape(Shape s) const;
};

// Device memory provider. The CUDA layer registers one for DeviceKind::cuda.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(std::size_t bytes, Device device) = 0;
  virtual void deallocate(void* p, Device device) noexcept = 0;
  virtual void memset_zero(void* p, std::size_t bytes, Device device) = 0;
};
void register_allocator(DeviceKind kind, Allocator* allocator);
Allocator* allocator_for(DeviceKind kind);  // nullptr when none registered

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(Shape shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(Shape shape, DType dtype, Device device = Device::cpu());
  // Wraps foreign memory; `owner` (may be null) is kept alive as long as the tensor.
  static Tensor wrap(TensorView view, std::shared_ptr<void> owner = nullptr);
  template <class T>
  static Tensor from_vector(const std::vector<T>& values, Shape shape) {
    FLEXEP_CHECK(shape.numel() == static_cast<std::int64_t>(values.size()), "from_vector: shape ", shape.str(),
                 " does not hold ", values.size(), " values");
    Tensor t = empty(shape, dtype_of_v<T>);
    for (std::size_t i = 0; i < values.size(); ++i) t.data<T>()[i] = values[i];
    return t;
  }

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: tensors pass where views are taken
  bool defined() const { return view_.defined(); }
  DType dtype() const { return view_.dtype; }
  const Shape& shape() const { return view_.shape; }
  Device device() const { return view_.device; }
  std::int64_t size(int i) const { return view_.size(i); }
  std::int64_t numel() const { return view_.numel(); }
  std::size_t nbytes() const { return view_.nbytes(); }
  template <class T>
  T* data() const {
    return view_.ptr<T>();
  }
  void* raw() const { return view_.data; }

  // CPU only helpers (tests, references).
  Tensor clone() const;
  Tensor to(DType dtype) const;  // converts between floating types (and int32 <-> int64)
  void fill_zero();

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

// Reads element i of any floating or integer CPU tensor as double (tests, references).
double read_as_double(const TensorView& t, std::int64_t i);
// Writes element i of a floating CPU tensor from double (rounding to the tensor's dtype).
void write_from_double(const TensorView& t, std::int64_t i, double v);

// A named learnable tensor and its gradient, named as in NeMo Automodel's state_dict.
struct Parameter {
  std::string name;
  Tensor value;
  Tensor grad;
  bool requires_grad = true;
};

}  // namespace flexep
