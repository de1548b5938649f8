#include "layer/cuda_linear.h"

#include "flexep/cuda/dense.h"
#include "flexep/cuda/expert_bias.h"

namespace flexep::cuda {

Tensor linear_forward(const TensorView& x, const TensorView& weight, const TensorView& bias, cudaStream_t stream) {
  const std::int64_t out = weight.size(0);
  Tensor y = Tensor::empty({x.size(0), out}, DType::bf16, x.device);
  gemm(x, false, weight, true, y, stream);
  if (bias.defined()) down_bias_forward(y, bias.reshape({1, out}), TensorView(), TensorView(), stream);
  return y;
}

Tensor linear_backward(const TensorView& x, const TensorView& weight, const TensorView& grad_y,
                       const TensorView& grad_weight, const TensorView& grad_bias, cudaStream_t stream) {
  Tensor grad_x = Tensor::empty({x.size(0), weight.size(1)}, DType::bf16, x.device);
  gemm(grad_y, false, weight, false, grad_x, stream);
  if (grad_weight.defined()) gemm(grad_y, true, x, false, grad_weight, 1.f, 1.f, stream);
  if (grad_bias.defined())
    expert_column_sum(grad_y, TensorView(), TensorView(), grad_bias.reshape({1, weight.size(0)}), stream);
  return grad_x;
}

}  // namespace flexep::cuda
