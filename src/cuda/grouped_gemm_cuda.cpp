// Grouped GEMMs on cuBLAS. Row-major <-> column-major: a row-major X [r, c] is the column-major
// matrix X^T (c x r, leading dimension c). So a row-major product C = op(A) op(B) is computed as the
// column-major C^T = op(B)^T op(A)^T: cuBLAS gets B first and A second, the same op flags, m and n
// swapped, and each leading dimension is the column count of the stored row-major matrix.
#include "flexep/cuda/grouped_gemm.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <map>

#include "flexep/core/checks.h"
#include "flexep/cuda/cublas.h"
#include "flexep/cuda/runtime.h"

namespace flexep::cuda {
namespace {

static_assert(sizeof(void*) == sizeof(std::int64_t), "device pointer arrays are stored in int64 tensors");

// Pinned host memory for small uploads, a ring of slots per (thread, device). Each slot remembers the
// event recorded right after the copy that read it, and is rewritten only once that event has
// completed, so an in-flight copy never sees its source change.
class StagingRing {
 public:
  StagingRing() = default;
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;
  ~StagingRing() {
    // Errors ignored: this may run at thread exit, after the CUDA runtime has shut down.
    for (Slot& s : slots_) {
      if (s.event) cudaEventDestroy(s.event);
      if (s.host) cudaFreeHost(s.host);
    }
  }

  // Copies `bytes` from `src` (any host memory) to device memory `dst`, asynchronously on `stream`.
  void upload(const void* src, std::size_t bytes, void* dst, cudaStream_t stream) {
    if (bytes == 0) return;
    Slot& s = slots_[next_];
    next_ = (next_ + 1) % kSlots;
    if (!s.event) FLEXEP_CUDA_CHECK(cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming));
    // Wait for the previous copy out of this slot (an event never recorded counts as complete).
    FLEXEP_CUDA_CHECK(cudaEventSynchronize(s.event));
    if (s.capacity < bytes) {
      // Rare (the first calls, or more experts): cudaFreeHost may synchronise the device.
      if (s.host) FLEXEP_CUDA_CHECK(cudaFreeHost(s.host));
      s.host = nullptr;
      s.capacity = 0;
      const std::size_t capacity = std::max<std::size_t>(bytes, 4096);
      FLEXEP_CUDA_CHECK(cudaMallocHost(&s.host, capacity));
      s.capacity = capacity;
    }
    std::memcpy(s.host, src, bytes);
    FLEXEP_CUDA_CHECK(cudaMemcpyAsync(dst, s.host, bytes, cudaMemcpyHostToDevice, stream));
    FLEXEP_CUDA_CHECK(cudaEventRecord(s.event, stream));
  }

 private:
  static constexpr int kSlots = 8;
  struct Slot {
    void* host = nullptr;
    std::size_t capacity = 0;
    cudaEvent_t event = nullptr;
  };
  Slot slots_[kSlots];
  int next_ = 0;
};

// The calling thread's ring for the current device (events belong to a device).
void staged_upload(const void* src, std::size_t bytes, void* dst, cudaStream_t stream) {
  thread_local std::map<int, StagingRing> rings;
  int device = 0;
  FLEXEP_CUDA_CHECK(cudaGetDevice(&device));
  rings[device].upload(src, bytes, dst, stream);
}

void check_bf16(const TensorView& t, int rank, const char* arg) {
  check::rank(t, rank, arg);
  check::dtype(t, {DType::bf16}, arg);
  FLEXEP_CHECK_ARG(t.device.is_cuda(), arg, "must be a CUDA tensor, got one on ", t.device.str());
}

void check_aligned(const TensorView& t, const char* arg) {
  FLEXEP_CHECK_ARG(reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0, arg,
                   "must start at a 16-byte aligned address (cuBLAS bf16 grouped GEMM)");
}

int as_int(std::int64_t v, const char* arg, const char* what) {
  FLEXEP_CHECK_ARG(v <= INT_MAX, arg, what, " = ", v, " exceeds the int range cuBLAS takes");
  return static_cast<int>(v);
}

// counts: one entry per group, each >= 0, summing to <= rows of `rows_arg`.
void check_counts(const std::vector<std::int64_t>& counts, std::int64_t groups, std::int64_t rows,
                  const char* rows_arg) {
  FLEXEP_CHECK_ARG(static_cast<std::int64_t>(counts.size()) == groups, "counts", "has ", counts.size(),
                   " entries, expected one per expert (", groups, ")");
  std::int64_t sum = 0;
  for (std::size_t g = 0; g < counts.size(); ++g) {
    FLEXEP_CHECK_ARG(counts[g] >= 0, "counts", "entry ", g, " is ", counts[g], "; counts must be >= 0");
    FLEXEP_CHECK_ARG(counts[g] <= rows - sum, "counts", "sums past ", rows, " (at entry ", g, "), but '", rows_arg,
                     "' has only ", rows, " rows; the sum must be <= the number of rows");
    sum += counts[g];
  }
}

// Per-expert work (rows * K * M multiply-adds) from which an expert gets its own cublasGemmEx
// instead of joining the grouped call; see grouped_gemm.h.
std::atomic<std::int64_t> g_own_gemm_min_work{std::int64_t{2500} * 1000 * 1000};

// Column-major problems for grouped_bf16: problem i is C_i (m x n[i], ldc) = op_a(A_i) op_b(B_i) with
// inner dimension k[i]; m, the ops and the leading dimensions are shared. Forward and dgrad vary n
// (the expert's rows), wgrad varies k.
struct Problems {
  std::vector<int> n, k;
  std::vector<const void*> a, b;
  std::vector<void*> c;
  void add(int n_i, int k_i, const void* a_i, const void* b_i, void* c_i) {
    n.push_back(n_i);
    k.push_back(k_i);
    a.push_back(a_i);
    b.push_back(b_i);
    c.push_back(c_i);
  }
};

// The problems, bf16 in and out, fp32 accumulation, alpha = 1, beta = 0 (C is not read) or with
// `add` beta = 1 (C read, the sum rounded once). Large problems run as single GEMMs, the rest in one
// cublasGemmGroupedBatchedEx call with one problem per group (their sizes differ).
void grouped_bf16(cudaStream_t stream, int device, cublasOperation_t op_a, cublasOperation_t op_b, int m, int lda,
                  int ldb, int ldc, const Problems& p, bool add = false) {
  if (p.n.empty()) return;
  cublasHandle_t handle = cublas_handle(stream);
  // alpha/beta live on the host; the grouped API refuses device pointer mode anyway.
  FLEXEP_CUBLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
  const float one = 1.f, beta_c = add ? 1.f : 0.f;
  const std::int64_t min_work = g_own_gemm_min_work.load(std::memory_order_relaxed);
  std::vector<std::size_t> batched;
  for (std::size_t i = 0; i < p.n.size(); ++i) {
    if (static_cast<std::int64_t>(p.n[i]) * m * p.k[i] < min_work) {
      batched.push_back(i);
      continue;
    }
    FLEXEP_CUBLAS_CHECK(cublasGemmEx(handle, op_a, op_b, m, p.n[i], p.k[i], &one, p.a[i], CUDA_R_16BF, lda, p.b[i],
                                     CUDA_R_16BF, ldb, &beta_c, p.c[i], CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
  }
  const auto count = batched.size();
  if (count == 0) return;
  StreamGuard stream_guard(stream);  // the pointer array below is allocated and freed on `stream`
  Tensor ptrs = Tensor::empty({3 * static_cast<std::int64_t>(count)}, DType::i64, Device::cuda(device));
  std::vector<const void*> host(3 * count);
  std::vector<int> ns(count), ks(count);
  for (std::size_t j = 0; j < count; ++j) {
    const std::size_t i = batched[j];
    host[j] = p.a[i];
    host[count + j] = p.b[i];
    host[2 * count + j] = p.c[i];
    ns[j] = p.n[i];
    ks[j] = p.k[i];
  }
  staged_upload(host.data(), host.size() * sizeof(void*), ptrs.raw(), stream);
  void** d = static_cast<void**>(ptrs.raw());
  const std::vector<cublasOperation_t> ta(count, op_a), tb(count, op_b);
  const std::vector<int> ms(count, m), ldas(count, lda), ldbs(count, ldb), ldcs(count, ldc), sizes(count, 1);
  const std::vector<float> alpha(count, 1.f), beta(count, beta_c);
  const int groups = static_cast<int>(count);
  FLEXEP_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(handle, ta.data(), tb.data(), ms.data(), ns.data(), ks.data(),
                                                 alpha.data(), d, CUDA_R_16BF, ldas.data(), d + groups, CUDA_R_16BF,
                                                 ldbs.data(), beta.data(), d + 2 * groups, CUDA_R_16BF, ldcs.data(),
                                                 groups, sizes.data(), CUBLAS_COMPUTE_32F));
}

const char* bytes_at(const TensorView& t, std::int64_t elements) {
  return static_cast<const char*>(t.data) + elements * static_cast<std::int64_t>(element_size(t.dtype));
}
void* mutable_bytes_at(const TensorView& t, std::int64_t elements) { return const_cast<char*>(bytes_at(t, elements)); }

// The problems of forward and dgrad: one per non-empty group g (counts[g] rows, in group order), A
// the weights b[g] (b is [G, K, M]), B the group's rows of `x` (x_cols wide), C its rows of `c`
// (c_cols wide), inner dimension `inner`.
Problems group_problems(const std::vector<std::int64_t>& counts, const TensorView& b, std::int64_t K, std::int64_t M,
                        const TensorView& x, std::int64_t x_cols, const TensorView& c, std::int64_t c_cols,
                        int inner) {
  Problems p;
  std::int64_t row = 0;
  for (std::size_t g = 0; g < counts.size(); ++g) {
    const std::int64_t rows = counts[g];
    if (rows > 0)
      p.add(static_cast<int>(rows), inner, bytes_at(b, static_cast<std::int64_t>(g) * K * M), bytes_at(x, row * x_cols),
            mutable_bytes_at(c, row * c_cols));
    row += rows;
  }
  return p;
}

// The arguments of both wgrad variants: a [N, K] bf16, d [N, M] bf16, c [G, K, M] of `c_dtype`, all
// on one device, counts summing to <= N. Returns K and M, also as the ints cuBLAS takes.
struct WgradDims {
  std::int64_t K, M;
  int k, m;
};
WgradDims check_wgrad(const TensorView& a, const TensorView& d, const std::vector<std::int64_t>& counts,
                      const TensorView& c, DType c_dtype) {
  check_bf16(a, 2, "a");
  check_bf16(d, 2, "d");
  check::rank(c, 3, "c");
  check::dtype(c, {c_dtype}, "c");
  check::same_device(a, "a", d, "d");
  check::same_device(a, "a", c, "c");
  const std::int64_t N = a.size(0), K = a.size(1), M = d.size(1), G = c.size(0);
  FLEXEP_CHECK_ARG(d.size(0) == N, "d", "has ", d.size(0), " rows but 'a' has ", N);
  FLEXEP_CHECK_ARG(K >= 1 && M >= 1, "a", "needs K >= 1 columns in 'a' and M >= 1 in 'd'");
  check::shape(c, {G, K, M}, "c");
  check_counts(counts, G, N, "a");
  const int k = as_int(K, "a", "K"), m = as_int(M, "d", "M");
  as_int(N, "a", "N");
  return {K, M, k, m};
}

// Zeroes the [K, M] blocks of c [G, K, M] whose group has no rows (an overwriting wgrad runs no GEMM
// for them), one memset per run of consecutive empty groups.
void zero_empty_blocks(const TensorView& c, const std::vector<std::int64_t>& counts, cudaStream_t stream) {
  const std::int64_t block = c.size(1) * c.size(2);
  for (std::size_t g = 0; g < counts.size();) {
    if (counts[g] != 0) {
      ++g;
      continue;
    }
    std::size_t end = g;
    while (end < counts.size() && counts[end] == 0) ++end;
    const auto bytes = static_cast<std::size_t>(static_cast<std::int64_t>(end - g) * block) * element_size(c.dtype);
    FLEXEP_CUDA_CHECK(cudaMemsetAsync(mutable_bytes_at(c, static_cast<std::int64_t>(g) * block), 0, bytes, stream));
    g = end;
  }
}

}  // namespace

void grouped_gemm_forward(const TensorView& a, const TensorView& b, const std::vector<std::int64_t>& counts,
                          const TensorView& c, cudaStream_t stream) {
  check_bf16(a, 2, "a");
  check_bf16(b, 3, "b");
  check_bf16(c, 2, "c");
  check::same_device(a, "a", b, "b");
  check::same_device(a, "a", c, "c");
  const std::int64_t N = a.size(0), K = a.size(1), G = b.size(0), M = b.size(2);
  FLEXEP_CHECK_ARG(b.size(1) == K, "b", "has shape ", b.shape.str(), "; expected [G, K = ", K,
                   " (columns of 'a'), M]");
  FLEXEP_CHECK_ARG(K >= 1 && M >= 1, "b", "needs K >= 1 and M >= 1, got shape ", b.shape.str());
  check::shape(c, {N, M}, "c");
  check_counts(counts, G, N, "a");
  check_aligned(a, "a");
  check_aligned(b, "b");
  check_aligned(c, "c");
  const int k = as_int(K, "a", "K"), m = as_int(M, "b", "M");
  as_int(N, "a", "N");
  DeviceGuard guard(a.device.index);
  // Column-major: C_g^T (M x n_g, ld M) = B_g^T (M x K, ld M) * A_g^T (K x n_g, ld K).
  grouped_bf16(stream, a.device.index, CUBLAS_OP_N, CUBLAS_OP_N, m, m, k, m,
               group_problems(counts, b, K, M, a, K, c, M, k));
}

void grouped_gemm_dgrad(const TensorView& d, const TensorView& b, const std::vector<std::int64_t>& counts,
                        const TensorView& c, cudaStream_t stream) {
  check_bf16(d, 2, "d");
  check_bf16(b, 3, "b");
  check_bf16(c, 2, "c");
  check::same_device(d, "d", b, "b");
  check::same_device(d, "d", c, "c");
  const std::int64_t N = d.size(0), M = d.size(1), G = b.size(0), K = b.size(1);
  FLEXEP_CHECK_ARG(b.size(2) == M, "b", "has shape ", b.shape.str(), "; expected [G, K, M = ", M,
                   " (columns of 'd')]");
  FLEXEP_CHECK_ARG(K >= 1 && M >= 1, "b", "needs K >= 1 and M >= 1, got shape ", b.shape.str());
  check::shape(c, {N, K}, "c");
  check_counts(counts, G, N, "d");
  check_aligned(d, "d");
  check_aligned(b, "b");
  check_aligned(c, "c");
  const int k = as_int(K, "b", "K"), m = as_int(M, "d", "M");
  as_int(N, "d", "N");
  DeviceGuard guard(d.device.index);
  // Column-major: C_g^T (K x n_g, ld K) = op_T(B_g^T stored M x K, ld M) * D_g^T (M x n_g, ld M).
  grouped_bf16(stream, d.device.index, CUBLAS_OP_T, CUBLAS_OP_N, k, m, m, k,
               group_problems(counts, b, K, M, d, M, c, K, m));
}

void grouped_gemm_wgrad(const TensorView& a, const TensorView& d, const std::vector<std::int64_t>& counts,
                        const TensorView& c, cudaStream_t stream, bool accumulate) {
  const WgradDims w = check_wgrad(a, d, counts, c, DType::f32);
  DeviceGuard guard(a.device.index);
  if (!accumulate) zero_empty_blocks(c, counts, stream);
  cublasHandle_t handle = nullptr;
  const float one = 1.f, beta = accumulate ? 1.f : 0.f;
  std::int64_t row = 0;
  for (std::size_t g = 0; g < counts.size(); ++g) {
    const std::int64_t rows = counts[g];
    if (rows > 0) {
      if (!handle) {
        handle = cublas_handle(stream);
        FLEXEP_CUBLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
      }
      // Column-major: C_g^T (M x K, ld M) += D_g^T (M x n_g, ld M) * op_T(A_g^T stored K x n_g, ld K).
      FLEXEP_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, w.m, w.k, static_cast<int>(rows), &one,
                                       bytes_at(d, row * w.M), CUDA_R_16BF, w.m, bytes_at(a, row * w.K), CUDA_R_16BF,
                                       w.k, &beta, mutable_bytes_at(c, static_cast<std::int64_t>(g) * w.K * w.M),
                                       CUDA_R_32F, w.m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    row += rows;
  }
}

void grouped_gemm_wgrad_bf16(const TensorView& a, const TensorView& d, const std::vector<std::int64_t>& counts,
                             const TensorView& c, cudaStream_t stream, bool accumulate) {
  const WgradDims w = check_wgrad(a, d, counts, c, DType::bf16);
  check_aligned(a, "a");
  check_aligned(d, "d");
  check_aligned(c, "c");
  DeviceGuard guard(a.device.index);
  if (!accumulate) zero_empty_blocks(c, counts, stream);
  // Column-major, per non-empty group: C_g^T (M x K, ld M) = D_g^T (M x n_g, ld M) * op_T(A_g^T stored
  // K x n_g, ld K); the inner dimension is the group's row count.
  Problems p;
  std::int64_t row = 0;
  for (std::size_t g = 0; g < counts.size(); ++g) {
    const std::int64_t rows = counts[g];
    if (rows > 0)
      p.add(w.k, static_cast<int>(rows), bytes_at(d, row * w.M), bytes_at(a, row * w.K),
            mutable_bytes_at(c, static_cast<std::int64_t>(g) * w.K * w.M));
    row += rows;
  }
  grouped_bf16(stream, a.device.index, CUBLAS_OP_N, CUBLAS_OP_T, w.m, w.m, w.k, w.m, p, accumulate);
}

void set_grouped_gemm_own_gemm_min_work(std::int64_t macs) {
  FLEXEP_CHECK_ARG(macs >= 0, "macs", "must be >= 0, got ", macs);
  g_own_gemm_min_work.store(macs, std::memory_order_relaxed);
}

std::int64_t grouped_gemm_own_gemm_min_work() { return g_own_gemm_min_work.load(std::memory_order_relaxed); }

Tensor expert_offsets(const std::vector<std::int64_t>& counts, int device, cudaStream_t stream) {
  FLEXEP_CHECK_ARG(!counts.empty(), "counts", "needs at least one expert");
  std::vector<std::int64_t> offsets(counts.size() + 1, 0);
  for (std::size_t e = 0; e < counts.size(); ++e) {
    FLEXEP_CHECK_ARG(counts[e] >= 0, "counts", "entry ", e, " is ", counts[e], "; counts must be >= 0");
    offsets[e + 1] = offsets[e] + counts[e];
  }
  init();
  DeviceGuard guard(device);
  StreamGuard stream_guard(stream);
  Tensor t = Tensor::empty({static_cast<std::int64_t>(offsets.size())}, DType::i64, Device::cuda(device));
  staged_upload(offsets.data(), offsets.size() * sizeof(std::int64_t), t.raw(), stream);
  return t;
}

}  // namespace flexep::cuda
