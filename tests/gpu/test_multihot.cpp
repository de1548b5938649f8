// GPU top-k <-> multihot against the CPU topk_to_multihot / multihot_backward (core/routing.h).
// Conversions only copy values, so every comparison is exact (bitwise for the floats).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "flexep/core/error.h"
#include "flexep/core/random.h"
#include "flexep/core/routing.h"
#include "flexep/cuda/multihot.h"
#include "flexep/cuda/runtime.h"
#include "gpu/gpu_test_util.h"

using namespace flexep;
using flexep::testing::host_vector;

namespace {

// 0xFF bytes in a pool block freed just before a call: outputs that reuse it and are never written
// (or zeroed) stay true / NaN, so the exact comparisons catch them.
void poison_pool(std::size_t bytes, cudaStream_t s) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(bytes)}, DType::b8, Device::cuda(0));
  FLEXEP_CUDA_CHECK(cudaMemsetAsync(t.raw(), 0xFF, bytes, s));
}

// Top-k ids: distinct experts per token drawn from a seeded shuffle, slot j of token t set to -1
// when (t + j) % 7 == 3, and the last token all -1 (a padding token).
Tensor random_ids(std::int64_t T, int k, int E, DType dtype, std::uint64_t seed) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(T * k));
  std::vector<int> perm(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) perm[static_cast<std::size_t>(e)] = e;
    for (int j = 0; j < k; ++j) {  // partial Fisher-Yates
      const int r = j + static_cast<int>(uniform01(seed, 77, static_cast<std::uint64_t>(t * k + j)) * (E - j));
      std::swap(perm[static_cast<std::size_t>(j)], perm[static_cast<std::size_t>(std::min(r, E - 1))]);
      const bool pad = t == T - 1 || (t + j) % 7 == 3;
      v[static_cast<std::size_t>(t * k + j)] = pad ? -1 : perm[static_cast<std::size_t>(j)];
    }
  }
  Tensor ids = Tensor::from_vector(v, {T, k});
  return dtype == DType::i64 ? ids : ids.to(DType::i32);
}

Tensor normal(Shape shape, std::uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::f32);
  fill_normal(t, seed, 78, 0.0, 1.0);
  return t;
}

// Bit patterns, so that NaN poison compares unequal to everything and -0.0 != 0.0 would show.
std::vector<std::uint32_t> float_bits(const TensorView& t, cudaStream_t s) {
  if (t.device.is_cuda()) return host_vector<std::uint32_t>(t, s);
  std::vector<std::uint32_t> v(static_cast<std::size_t>(t.numel()));
  if (t.nbytes()) std::memcpy(v.data(), t.data, t.nbytes());
  return v;
}
std::vector<std::uint8_t> map_bytes(const TensorView& t, cudaStream_t s) {
  if (t.device.is_cuda()) return host_vector<std::uint8_t>(t, s);
  std::vector<std::uint8_t> v(static_cast<std::size_t>(t.numel()));
  if (t.nbytes()) std::memcpy(v.data(), t.data, t.nbytes());
  return v;
}

void expect_arg_error(const std::function<void()>& f, const std::string& arg, const std::string& needle = "") {
  try {
    f();
    ADD_FAILURE() << "expected an ArgumentError naming '" << arg << "'";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), arg) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "'" << needle << "' not in: " << e.what();
  }
}

}  // namespace

TEST(MultihotGpu, MatchesCpuBothWays) {
  if (!flexep::testing::require_gpus(1)) return;
  const cuda::OwnedStream stream;
  const cudaStream_t s = stream.get();
  cuda::StreamGuard ordered(s);
  cuda::DeviceErrors errors(0);
  std::uint64_t seed = 1;
  for (DType id_dtype : {DType::i32, DType::i64})
    for (int E : {1, 8, 64, 256})
      for (int k : {1, 8}) {
        if (k > E) continue;
        const std::int64_t T = 37;
        SCOPED_TRACE("E=" + std::to_string(E) + " k=" + std::to_string(k) + " ids " +
                     std::string(dtype_name(id_dtype)));
        const Tensor ids = random_ids(T, k, E, id_dtype, ++seed);
        const Tensor w = normal({T, k}, seed);
        const Multihot ref = topk_to_multihot(ids, w, E);
        const Tensor ids_d = cuda::to_device(ids, 0, s), w_d = cuda::to_device(w, 0, s);
        poison_pool(static_cast<std::size_t>(T * E * 5 + 4096), s);
        const Multihot got = cuda::topk_to_multihot(ids_d, w_d, E, errors, s);
        ASSERT_EQ(got.routing_map.shape(), Shape({T, E}));
        ASSERT_EQ(got.routing_map.dtype(), DType::b8);
        ASSERT_EQ(got.probs.dtype(), DType::f32);
        EXPECT_EQ(map_bytes(got.routing_map, s), map_bytes(ref.routing_map, s));
        EXPECT_EQ(float_bits(got.probs, s), float_bits(ref.probs, s));
        EXPECT_NO_THROW(errors.check(s, "topk_to_multihot"));

        const Tensor grad = normal({T, E}, seed + 1000);
        const Tensor ref_back = multihot_backward(grad, ids);
        const Tensor grad_d = cuda::to_device(grad, 0, s);
        poison_pool(static_cast<std::size_t>(T * k * 4 + 4096), s);
        const Tensor back = cuda::multihot_backward(grad_d, ids_d, errors, s);
        ASSERT_EQ(back.shape(), Shape({T, k}));
        EXPECT_EQ(float_bits(back, s), float_bits(ref_back, s));
        EXPECT_NO_THROW(errors.check(s, "multihot_backward"));
      }
}

TEST(MultihotGpu, EmptyBatch) {
  if (!flexep::testing::require_gpus(1)) return;
  const cuda::OwnedStream stream;
  const cudaStream_t s = stream.get();
  cuda::StreamGuard ordered(s);
  cuda::DeviceErrors errors(0);
  const Tensor ids = cuda::to_device(Tensor::empty({0, 4}, DType::i64), 0, s);
  const Tensor w = cuda::to_device(Tensor::empty({0, 4}, DType::f32), 0, s);
  const Multihot m = cuda::topk_to_multihot(ids, w, 16, errors, s);
  EXPECT_EQ(m.routing_map.shape(), Shape({0, 16}));
  EXPECT_EQ(m.probs.shape(), Shape({0, 16}));
  const Tensor g = cuda::to_device(Tensor::empty({0, 16}, DType::f32), 0, s);
  EXPECT_EQ(cuda::multihot_backward(g, ids, errors, s).shape(), Shape({0, 4}));
  EXPECT_NO_THROW(errors.check(s, "empty"));
}

// Bad ids are found in the kernels and reported at errors.check() as argument "indices" with their
// position; the other slots are still converted, and nothing is written out of bounds.
TEST(MultihotGpu, ReportsBadIdsWithPosition) {
  if (!flexep::testing::require_gpus(1)) return;
  const cuda::OwnedStream stream;
  const cudaStream_t s = stream.get();
  cuda::StreamGuard ordered(s);
  cuda::DeviceErrors errors(0);
  const int E = 8;
  const Tensor w = normal({3, 2}, 5);
  const Tensor w_d = cuda::to_device(w, 0, s);
  struct Bad {
    std::vector<std::int64_t> ids;
    std::string needle;
  };
  const Bad cases[] = {{{0, 1, 2, 8, 3, -1}, "[1, 1]"},     // id == E
                       {{0, 1, 2, 3, 900, 4}, "[2, 0]"},    // far out of range
                       {{0, 1, -2, 3, 4, 5}, "[1, 0]"},     // negative other than -1
                       {{0, 1, 5, 5, 4, 6}, "twice"}};      // repeated expert
  for (const Bad& b : cases)
    for (DType dt : {DType::i64, DType::i32}) {
      SCOPED_TRACE(b.needle + " " + std::string(dtype_name(dt)));
      Tensor ids = Tensor::from_vector(b.ids, {3, 2});
      if (dt == DType::i32) ids = ids.to(DType::i32);
      const Tensor ids_d = cuda::to_device(ids, 0, s);
      const Multihot m = cuda::topk_to_multihot(ids_d, w_d, E, errors, s);
      expect_arg_error([&] { errors.check(s, "topk_to_multihot"); }, "indices", b.needle);
      EXPECT_NO_THROW(errors.check(s, "cleared")) << "check() clears the record";
      // Row 0 = {0, 1} is valid in every case and converted all the same.
      const std::vector<std::uint8_t> map = map_bytes(m.routing_map, s);
      EXPECT_EQ(map[0], 1);
      EXPECT_EQ(map[1], 1);
      EXPECT_EQ(map[2], 0);
      const Tensor grad_d = cuda::to_device(normal({3, E}, 6), 0, s);
      if (b.needle != "twice") {  // the backward gathers repeated ids fine; it rejects the others
        (void)cuda::multihot_backward(grad_d, ids_d, errors, s);
        expect_arg_error([&] { errors.check(s, "multihot_backward"); }, "indices", b.needle);
      }
    }
}

TEST(MultihotGpu, RejectsBadArguments) {
  if (!flexep::testing::require_gpus(1)) return;
  const cuda::OwnedStream stream;
  const cudaStream_t s = stream.get();
  cuda::StreamGuard ordered(s);
  cuda::DeviceErrors errors(0);
  const Tensor ids_host = random_ids(4, 2, 8, DType::i64, 3);
  const Tensor ids = cuda::to_device(ids_host, 0, s);
  const Tensor w = cuda::to_device(normal({4, 2}, 3), 0, s);
  const Tensor w_f64 = cuda::to_device(normal({4, 2}, 3).to(DType::f64), 0, s);
  const Tensor w_short = cuda::to_device(normal({3, 2}, 3), 0, s);
  const Tensor ids_f32 = cuda::to_device(normal({4, 2}, 3), 0, s);
  const Tensor ids_1d = cuda::to_device(Tensor::from_vector(std::vector<std::int64_t>{0, 1, 2, 3}, {4}), 0, s);
  expect_arg_error([&] { cuda::topk_to_multihot(ids, w, 0, errors, s); }, "num_experts");
  expect_arg_error([&] { cuda::topk_to_multihot(ids, w_f64, 8, errors, s); }, "weights");
  expect_arg_error([&] { cuda::topk_to_multihot(ids, w_short, 8, errors, s); }, "weights");
  expect_arg_error([&] { cuda::topk_to_multihot(ids, normal({4, 2}, 3), 8, errors, s); }, "weights");  // on the CPU
  expect_arg_error([&] { cuda::topk_to_multihot(ids_host, w, 8, errors, s); }, "indices");  // on the CPU
  expect_arg_error([&] { cuda::topk_to_multihot(ids_f32, w, 8, errors, s); }, "indices");
  expect_arg_error([&] { cuda::topk_to_multihot(ids_1d, w, 8, errors, s); }, "indices");
  const Tensor g = cuda::to_device(normal({4, 8}, 4), 0, s);
  const Tensor g_rows = cuda::to_device(normal({5, 8}, 4), 0, s);
  const Tensor g_f64 = cuda::to_device(normal({4, 8}, 4).to(DType::f64), 0, s);
  expect_arg_error([&] { cuda::multihot_backward(g_rows, ids, errors, s); }, "grad_probs");
  expect_arg_error([&] { cuda::multihot_backward(g_f64, ids, errors, s); }, "grad_probs");
  expect_arg_error([&] { cuda::multihot_backward(normal({4, 8}, 4), ids, errors, s); }, "grad_probs");  // CPU
  EXPECT_NO_THROW(errors.check(s, "nothing launched"));
}
