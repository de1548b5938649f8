// Argument checks of the bf16 weight-gradient GEMM (cuda/grouped_gemm.h) in CUDA builds. They run
// before any CUDA call, so they need no GPU: the tensors are views of nothing on cuda:0 (never
// dereferenced). The GEMMs themselves are tested on the device (tests/gpu/test_grouped_gemm.cpp).
#include <gtest/gtest.h>

#ifdef FLEXEP_WITH_CUDA

#include <cstdint>
#include <string>

#include "flexep/core/error.h"
#include "flexep/cuda/grouped_gemm.h"

namespace flexep {
namespace {

TensorView on_gpu(Shape shape, DType dtype, int device = 0) {
  return TensorView(nullptr, dtype, shape, Device::cuda(device));
}

// The call throws an ArgumentError naming `arg` whose message contains `needle`.
template <class F>
void expect_arg_error(F&& f, const std::string& arg, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an ArgumentError naming '" << arg << "'";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), arg) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(GroupedGemmArguments, WgradBf16) {
  // a [N = 10, K = 16], d [10, M = 8], c [G = 2, 16, 8] bf16.
  const TensorView a = on_gpu({10, 16}, DType::bf16), d = on_gpu({10, 8}, DType::bf16);
  const TensorView c = on_gpu({2, 16, 8}, DType::bf16);
  auto call = [&](const TensorView& a_, const TensorView& d_, const TensorView& c_,
                  const std::vector<std::int64_t>& counts = {5, 5}) {
    cuda::grouped_gemm_wgrad_bf16(a_, d_, counts, c_, nullptr);
  };
  expect_arg_error([&] { call(a, d, on_gpu({2, 16, 8}, DType::f32)); }, "c", "f32");
  expect_arg_error([&] { call(a, d, on_gpu({2, 16, 8}, DType::f16)); }, "c", "f16");
  expect_arg_error([&] { call(a, d, on_gpu({2, 8, 16}, DType::bf16)); }, "c", "[2, 8, 16]");
  expect_arg_error([&] { call(a, d, on_gpu({2, 16, 9}, DType::bf16)); }, "c", "shape");
  expect_arg_error([&] { call(a, d, on_gpu({32, 8}, DType::bf16)); }, "c", "3-D");
  expect_arg_error([&] { call(a, d, TensorView(nullptr, DType::bf16, Shape{2, 16, 8})); }, "c", "same device");
  expect_arg_error([&] { call(a, d, on_gpu({2, 16, 8}, DType::bf16, 1)); }, "c", "same device");
  const TensorView misaligned(reinterpret_cast<void*>(std::uintptr_t{2}), DType::bf16, Shape{2, 16, 8},
                              Device::cuda(0));
  expect_arg_error([&] { call(a, d, misaligned); }, "c", "aligned");
  expect_arg_error([&] { call(on_gpu({10, 16}, DType::f32), d, c); }, "a", "f32");
  expect_arg_error([&] { call(a, on_gpu({9, 8}, DType::bf16), c, {5, 4}); }, "d", "rows");
  expect_arg_error([&] { call(a, d, c, {6, 5}); }, "counts", "sum");
  expect_arg_error([&] { call(a, d, c, {5, 5, 0}); }, "counts", "one per expert");
  expect_arg_error([&] { call(a, d, c, {-1, 5}); }, "counts", ">= 0");
}

TEST(GroupedGemmArguments, WgradF32RejectsBf16C) {
  const TensorView a = on_gpu({10, 16}, DType::bf16), d = on_gpu({10, 8}, DType::bf16);
  expect_arg_error([&] { cuda::grouped_gemm_wgrad(a, d, {5, 5}, on_gpu({2, 16, 8}, DType::bf16), nullptr); }, "c",
                   "bf16");
}

}  // namespace
}  // namespace flexep

#endif  // FLEXEP_WITH_CUDA
