// The deepep dispatcher's buffers: what options size (the window's layout, the flags, the
// operation state, budget mode's and low-latency mode's buffers), their allocation on every rank
// (collective, after the ranks agreed on the sizes), release, resize, and what they hold.
//
// The window's layout is computed by every rank from the same options, and peers write at its
// offsets: hence the sizes are compared across ranks before any window is registered.
#include <iterator>
#include <utility>
#include <vector>

#include "dispatch/deepep/dispatcher/dispatcher.h"
#include "flexep/core/error.h"
#include "flexep/cuda/runtime.h"

namespace flexep {
namespace deepep {

namespace {

unsigned long long align16(unsigned long long x) { return (x + 15) / 16 * 16; }

std::size_t flag_buffer_bytes(int ranks) {
  return align16(static_cast<unsigned long long>(flag_words(ranks)) * sizeof(unsigned));
}

// The words the ranks compare: what the window's layout and the peers' offsets depend on.
std::vector<long long> size_words(const DeepEpOptions& o, int num_experts, const Dispatcher::Sizes& s) {
  return {num_experts, o.hidden, o.max_tokens_per_rank, s.max_topk, s.capacity_rows, o.low_latency_max_tokens};
}
constexpr const char* kSizeNames[] = {"num_experts",   "hidden",        "max_tokens_per_rank",
                                      "max_topk",      "max_recv_rows", "low_latency_max_tokens"};

}  // namespace

Dispatcher::Sizes Dispatcher::sizes_of(const DeepEpOptions& o, int ranks, int num_experts) {
  Sizes s;
  s.max_topk = o.max_topk > 0 ? o.max_topk : num_experts;
  s.capacity_rows = o.max_recv_rows > 0 ? o.max_recv_rows : ranks * o.max_tokens_per_rank;
  s.ll_slots = s.max_topk < kMaxLowLatencyTopk ? s.max_topk : kMaxLowLatencyTopk;
  return s;
}

WindowLayout Dispatcher::window_layout(const DeepEpOptions& o, int ranks, int num_experts) {
  const Sizes s = sizes_of(o, ranks, num_experts);
  WindowLayout w;
  unsigned long long at = 0;
  auto take = [&](unsigned long long bytes) {
    const unsigned long long here = at;
    at = align16(at + bytes);
    return here;
  };
  const auto C = static_cast<unsigned long long>(s.capacity_rows), H = static_cast<unsigned long long>(o.hidden),
             K = static_cast<unsigned long long>(s.max_topk), R = static_cast<unsigned long long>(ranks),
             T = static_cast<unsigned long long>(o.max_tokens_per_rank);
  w.x = take(C * H * 2);
  w.scales = take(C * (H / kFp8ScaleBlock) * 4);
  w.idx = take(C * K * 4);
  w.w = take(C * K * 4);
  w.src = take(C * 4);
  w.grad = take(C * H * 2);
  w.part = take(R * T * H * 2);
  w.part_w = take(R * T * K * 4);
  w.counts = take(R * static_cast<unsigned long long>(exchange_word::words(num_experts, ranks)) * 8);
  const auto L = static_cast<unsigned long long>(num_experts) / R,
             TL = static_cast<unsigned long long>(o.low_latency_max_tokens);
  w.ll_x = take(L * R * TL * H * 2);
  w.ll_scales = take(L * R * TL * (H / kFp8ScaleBlock) * 4);
  w.ll_info = take(L * R * TL * 4);
  w.ll_counts = take(TL > 0 ? L * R * 4 : 0);
  w.ll_back = take(TL * static_cast<unsigned long long>(s.ll_slots) * H * 2);
  w.bytes = at > 0 ? at : 16;
  return w;
}

std::size_t Dispatcher::state_bytes(int ranks, int num_experts) {
  const std::size_t snapshot_words = static_cast<std::size_t>(ranks) * exchange_word::words(num_experts, ranks);
  return sizeof(OpControl) * kKinds + sizeof(Status) + 8 * snapshot_words;
}

std::array<std::int64_t, static_cast<std::size_t>(Dispatcher::Scratch::kinds)> Dispatcher::budget_buffer_sizes(
    const DeepEpOptions& o, int ranks, int num_experts) {
  const Sizes s = sizes_of(o, ranks, num_experts);
  const int R = ranks, L = num_experts / ranks;
  const std::int64_t T = o.max_tokens_per_rank;
  // The expert-major layout's outputs and the lists of a pad above 128 grow with a call's budget
  // (reserve_budget): none at creation.
  const std::int64_t masks = R * mask_chunks(T);
  return {T * s.max_topk, masks, num_experts + R, layout_word::words(R, L), R * T, s.capacity_rows, L,
          expert_rows_capacity(s.capacity_rows, s.max_topk, L, 128), masks, 0, 0, 0, 0, 0};
}

std::size_t Dispatcher::budget_buffer_bytes(const DeepEpOptions& o, int ranks, int num_experts) {
  const auto sizes = budget_buffer_sizes(o, ranks, num_experts);
  std::size_t bytes = sizeof(std::int64_t);  // dropped_
  for (std::size_t i = 0; i < sizes.size(); ++i)
    bytes += static_cast<std::size_t>(sizes[i]) * element_size(scratch_dtype(static_cast<Scratch>(i)));
  return bytes;
}

void Dispatcher::agree_on_options(const DeepEpOptions& options, const std::string& phase) {
  // Checked on every rank, then compared: a rank that rejects its own, or sizes its buffers
  // differently, makes every rank stop here (rather than leave the others waiting in the set-up,
  // or write at offsets that differ).
  const DeepEpOptions previous = options_;
  const int previous_topk = max_topk_;
  const std::int64_t previous_capacity = capacity_rows_;
  auto restore = [&] {
    options_ = previous;
    max_topk_ = previous_topk;
    capacity_rows_ = previous_capacity;
  };
  std::exception_ptr local;
  try {
    options_ = options;
    check_options(experts_);
    // Buffers that cannot fit are refused here, by every rank, rather than by a failed allocation
    // inside the collective set-up (a resize frees the old ones first).
    const DeepEpMemory need = DeepEpDispatcher::size_hint(options, comm_->size(), experts_);
    cuda::require_device_memory(need.total(), memory().total(), comm_->device(), "options",
                                detail::concat("the deepep buffers (window ", need.window, " bytes, ", need.local,
                                               " bytes of this rank's own)"));
  } catch (...) {
    local = std::current_exception();
  }
  std::vector<long long> mine = size_words(options, experts_, sizes_of(options, comm_->size(), experts_));
  mine.insert(mine.begin(), local ? 1 : 0);
  std::vector<long long> all;
  try {
    all = comm_->all_gather_i64(mine, phase);
  } catch (...) {
    restore();
    throw;
  }
  if (local) {
    restore();
    std::rethrow_exception(local);
  }
  const std::size_t n = mine.size();
  for (int r = 0; r < comm_->size(); ++r) {
    const long long* w = all.data() + static_cast<std::size_t>(r) * n;
    if (w[0] != 0) {
      restore();
      throw ArgumentError("options", detail::concat("rank ", r, " rejected its deepep options, so ", phase,
                                                    " stops on every rank: see the error raised there"));
    }
    for (std::size_t i = 1; i < n; ++i)
      if (w[i] != all[i]) {
        restore();
        const std::string name = kSizeNames[i - 1];
        throw ArgumentError(i == 1 ? name : "options." + name,
                            detail::concat("rank ", r, " has ", name, "=", w[i], " but rank 0 has ", all[i], " (",
                                           phase, "): every rank's deepep buffers must be sized alike"));
      }
  }
}

void Dispatcher::allocate() {
  const int R = comm_->size();
  win_ = window_layout(options_, R, experts_);
  cuda::DeviceGuard guard(comm_->device());
  // Everything this rank's kernels start from is made and zeroed, and the device synchronised,
  // before the window's barrier: the operation state at epoch 0 like the flags, the budget and
  // low-latency buffers. After the barrier a peer may launch a call whose kernels wait for this
  // rank's; on one GPU (simulated ranks) a device-wide wait here would then wait for them, while
  // they wait for a launch this thread has not made: both stall until the device deadline.
  const std::size_t local_bytes = state_bytes(R, experts_);
  void* state = nullptr;
  FLEXEP_CUDA_CHECK(cudaMalloc(&state, local_bytes));
  FLEXEP_CUDA_CHECK(cudaMemset(state, 0, local_bytes));
  SymmetricBufferSpec spec;
  spec.window_bytes = win_.bytes;
  spec.flag_bytes = flag_buffer_bytes(R);
  spec.lsa_barriers = 1;
  try {
    allocate_budget_buffers();
    allocate_low_latency_buffers();
    FLEXEP_CUDA_CHECK(cudaDeviceSynchronize());
    sym_.init(spec);
  } catch (...) {
    budget_buffers_ = {};
    dropped_ = Tensor();
    ll_ = LowLatencyBuffers{};
    cudaFree(state);
    throw;
  }
  local_ = static_cast<char*>(state);
  ops_ = reinterpret_cast<OpControl*>(local_);
  status_ = reinterpret_cast<Status*>(local_ + sizeof(OpControl) * kKinds);
  snapshot_ = reinterpret_cast<long long*>(local_ + sizeof(OpControl) * kKinds + sizeof(Status));
  ++generation_;
}

void Dispatcher::init() {
  if (local_ != nullptr) return;
  require_usable();
  cuda::init();
  allocate();
}

void Dispatcher::release() {
  if (local_ == nullptr) return;
  cuda::DeviceGuard guard(comm_->device());
  sym_.free();  // waits for the device, then for every rank, then tears the window down
  FLEXEP_CUDA_CHECK(cudaFree(local_));
  local_ = nullptr;
  ops_ = nullptr;
  status_ = nullptr;
  snapshot_ = nullptr;
  budget_buffers_ = {};
  dropped_ = Tensor();
  ll_ = LowLatencyBuffers{};
  ++generation_;
}

void Dispatcher::resize(const DeepEpOptions& options) {
  cuda::init();
  require_usable();
  agree_on_options(options, "deepep:resize");
  release();
  allocate();
}

void Dispatcher::set_num_sms(int sms) {
  const int previous = options_.sms;
  options_.sms = sms;
  try {
    FLEXEP_CHECK_ARG(sms >= 0 && sms <= 1024, "sms", sms, " is outside [0, 1024] (0: DeepEP's 20)");
    if (options_.low_latency_max_tokens > 0)
      FLEXEP_CHECK_ARG(low_latency_ctas() <= comm_->sms_per_rank(), "sms", low_latency_ctas(),
                       " CTAs of the low-latency kernels exceed the ", comm_->sms_per_rank(),
                       " SMs this rank may hold at once (they must all be resident)");
  } catch (...) {
    options_.sms = previous;
    throw;
  }
}

DeepEpMemory Dispatcher::memory() const {
  DeepEpMemory m;
  if (local_ == nullptr) return m;
  m.window = sym_.spec().window_bytes;
  m.flags = sym_.spec().flag_bytes;
  m.local = state_bytes(world_size(), experts_) + dropped_.nbytes();
  for (const Tensor& t : budget_buffers_) m.local += t.nbytes();
  for (const Tensor* t : {&ll_.recv_x, &ll_.recv_scales, &ll_.recv_count, &ll_.recv_src_info, &ll_.layout_range,
                          &ll_.route, &ll_.out})
    m.local += t->nbytes();
  return m;
}

void Dispatcher::allocate_budget_buffers() {
  dropped_ = Tensor::zeros({1}, DType::i64, Device::cuda(comm_->device()));
  const auto sizes = budget_buffer_sizes(options_, world_size(), experts_);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const DType dt = scratch_dtype(static_cast<Scratch>(i));
    const Device dev = Device::cuda(comm_->device());
    // The counts start at zero and the notify kernel zeroes them after each call (kernels.h, NotifyCall).
    budget_buffers_[i] = static_cast<Scratch>(i) == Scratch::counts ? Tensor::zeros({sizes[i]}, dt, dev)
                                                                    : Tensor::empty({sizes[i]}, dt, dev);
  }
}

void Dispatcher::reserve_budget(const DispatchOptions& options, int k, std::int64_t hidden, bool fp8) {
  const int L = local_experts();
  const bool expert_major = options.layout == DispatchLayout::expert_major;
  const std::int64_t entries = expert_major ? options.budget_rows
                                            : expert_rows_capacity(options.budget_rows, k, L, options.pad_multiple);
  std::vector<std::pair<Scratch, std::int64_t>> need = {{Scratch::expert_rows, entries}};
  if (expert_major) {
    const std::int64_t row_elements = fp8 ? hidden / 2 : hidden;  // entry_rows counts bf16 elements
    need.insert(need.end(), {{Scratch::token_probs, entries},
                             {Scratch::slot_pos, capacity_rows_ * max_topk_},
                             {Scratch::row_order, capacity_rows_ * max_topk_},
                             {Scratch::entry_rows, entries * row_elements},
                             {Scratch::entry_scales, fp8 ? entries * (hidden / kFp8ScaleBlock) : 0}});
  }
  for (const auto& [which, n] : need) {
    Tensor& buf = budget_buffers_[static_cast<std::size_t>(which)];
    if (buf.numel() >= n) continue;
    FLEXEP_CHECK_ARG(!cuda::capturing(stream()), "options.budget_rows", options.budget_rows,
                     " needs larger buffers than this dispatcher holds, and they cannot grow inside a CUDA graph "
                     "capture: make one uncaptured budget-mode dispatch with this budget, layout and pad_multiple "
                     "first");
    buf = Tensor();  // the old buffer goes back to the pool before the larger one is taken
    buf = Tensor::empty({n}, scratch_dtype(which), Device::cuda(comm_->device()));
  }
}

}  // namespace deepep

DeepEpMemory DeepEpDispatcher::size_hint(const DeepEpOptions& options, int ranks, int num_experts) {
  FLEXEP_CHECK_ARG(ranks >= 1, "ranks", "must be >= 1, got ", ranks);
  FLEXEP_CHECK_ARG(num_experts >= ranks && num_experts % ranks == 0, "num_experts", num_experts,
                   " must be a positive multiple of the ", ranks, " ranks");
  using deepep::Dispatcher;
  DeepEpMemory m;
  m.window = Dispatcher::window_layout(options, ranks, num_experts).bytes;
  m.flags = deepep::flag_buffer_bytes(ranks);
  m.local = Dispatcher::state_bytes(ranks, num_experts) + Dispatcher::budget_buffer_bytes(options, ranks, num_experts) +
            Dispatcher::low_latency_buffer_bytes(options, ranks, num_experts);
  return m;
}

}  // namespace flexep
