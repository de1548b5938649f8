#include "layer/linear.h"

#include "flexep/core/checks.h"
#include "layer/linear_ref.h"

namespace flexep::ref {

namespace {

template <class T>
Tensor forward_impl(const TensorView& x, const TensorView& w, const TensorView& b) {
  const std::int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  Tensor y = Tensor::zeros({rows, out}, dtype_of_v<T>);
  T* py = y.data<T>();
  if (b.defined())
    for (std::int64_t r = 0; r < rows; ++r) axpy(out, T(1), b.ptr<T>(), py + r * out);
  gemm_nt_acc(rows, in, out, x.ptr<T>(), w.ptr<T>(), py);
  return y;
}

template <class T>
Tensor backward_impl(const TensorView& x, const TensorView& w, const TensorView& gy, const Tensor& gw,
                     const Tensor& gb) {
  const std::int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  Tensor gx = Tensor::zeros({rows, in}, dtype_of_v<T>);
  gemm_nn_acc(rows, out, in, gy.ptr<T>(), w.ptr<T>(), gx.data<T>());
  if (gw.defined()) gemm_tn_acc(rows, out, in, gy.ptr<T>(), x.ptr<T>(), gw.data<T>());
  if (gb.defined()) sum_rows_acc(rows, out, gy.ptr<T>(), gb.data<T>());
  return gx;
}

void check_operands(const TensorView& x, const TensorView& w, const TensorView& b) {
  FLEXEP_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear: x ", x.shape.str(), " and weight ",
               w.shape.str(), " do not match");
  FLEXEP_CHECK(x.dtype == w.dtype && (!b.defined() || b.dtype == w.dtype), "linear: operands of mixed dtypes");
  FLEXEP_CHECK(x.dtype == DType::f32 || x.dtype == DType::f64, "linear: computes in f32 or f64, got ",
               dtype_name(x.dtype));
}

}  // namespace

Tensor linear_forward(const TensorView& x, const TensorView& weight, const TensorView& bias) {
  check_operands(x, weight, bias);
  return x.dtype == DType::f64 ? forward_impl<double>(x, weight, bias) : forward_impl<float>(x, weight, bias);
}

Tensor linear_backward(const TensorView& x, const TensorView& weight, const TensorView& grad_y,
                       const Tensor& grad_weight, const Tensor& grad_bias) {
  check_operands(x, weight, TensorView());
  FLEXEP_CHECK(grad_y.dtype == x.dtype && grad_y.size(0) == x.size(0) && grad_y.size(1) == weight.size(0),
               "linear: grad_y ", grad_y.shape.str(), " does not match");
  return x.dtype == DType::f64 ? backward_impl<double>(x, weight, grad_y, grad_weight, grad_bias)
                               : backward_impl<float>(x, weight, grad_y, grad_weight, grad_bias);
}

}  // namespace flexep::ref
