// The deepep dispatch and combine_backward: the rows out, at their final rank-major places. The
// dispatch's steps, on every rank:
//   1. local checks, and the count kernel (ids validated, rows per destination, pairs per expert,
//      the destination masks); a failure is not raised yet: it travels with step 2, so that every
//      rank stops together;
//   2. the count exchange of [signature | pairs per expert | rows per destination], and the call's
//      layout (layout_word) and chunk bases from it, the same rules on every rank: blocking mode
//      through one host all-gather (then every error is raised here, on every rank) and a kernel
//      for the chunk bases; budget mode on the device (notify kernel: no host sync; an error is
//      raised by the next check on every rank);
//   3. the send kernel: each (token, destination) row placed from the masks and stored once into
//      the destination's window, with its slots; dest_row written for the way back;
//   4. the listing kernel(s): every source's flag acquired, each local expert's rows listed;
//   5. the expert-major layout only: the rows gathered into their experts' lists (no communication);
//      with rows_in_place (blocking, bf16) the rank-major rows are copied out of the window instead,
//      compact (a token once per rank, not once per expert), and the listing is the experts' row
//      table into them.
#include <algorithm>
#include <iterator>
#include <utility>
#include <vector>

#include "dispatch/common/call_signature.h"
#include "dispatch/common/count_routes.h"
#include "dispatch/deepep/dispatcher/dispatcher.h"
#include "flexep/core/checks.h"
#include "flexep/core/plan.h"
#include "flexep/cuda/runtime.h"

namespace flexep::deepep {

namespace {

struct Routing {
  std::int64_t tokens = 0, hidden = 0;
  int k = 0;
};

Routing check_input(const DispatchInput& in, const TensorView& scales, bool fp8, const DispatchOptions& opt,
                    int ranks, int experts, int device, std::int64_t hidden, std::int64_t max_tokens, int max_topk,
                    std::int64_t capacity) {
  FLEXEP_CHECK_ARG(!in.multihot(), "routing_map",
                   "the deepep backend takes the top-k form (indices, weights), as DeepEP's dispatch does");
  const Device dev = Device::cuda(device);
  check::rank(in.hidden, 2, "hidden");
  check::dtype(in.hidden, {fp8 ? DType::e4m3 : DType::bf16}, "hidden");
  check::device(in.hidden, dev, "hidden");
  Routing r;
  r.tokens = in.hidden.size(0);
  r.hidden = in.hidden.size(1);
  FLEXEP_CHECK_ARG(r.hidden == hidden, "hidden", "has H=", r.hidden,
                   " but this deepep dispatcher was created for DeepEpOptions::hidden=", hidden);
  if (fp8) {
    FLEXEP_CHECK_ARG(r.hidden % kFp8ScaleBlock == 0, "hidden", "has H=", r.hidden, "; FP8 rows need a multiple of ",
                     kFp8ScaleBlock, " (one scale per ", kFp8ScaleBlock, " elements)");
    check::shape(scales, {r.tokens, r.hidden / kFp8ScaleBlock}, "scales");
    check::dtype(scales, {DType::f32}, "scales");
    check::device(scales, dev, "scales");
  }
  FLEXEP_CHECK_ARG(r.tokens <= max_tokens, "hidden", "has ", r.tokens, " tokens, more than the ", max_tokens,
                   " the buffers hold (DeepEpOptions::max_tokens_per_rank)");
  FLEXEP_CHECK_ARG(reinterpret_cast<std::uintptr_t>(in.hidden.data) % 16 == 0, "hidden",
                   "must be 16-byte aligned (rows move as 16-byte vectors)");
  FLEXEP_CHECK_ARG(in.indices.defined(), "indices", "is required (the top-k form: indices, weights)");
  check::shape(in.indices, {r.tokens, -1}, "indices");
  check::dtype(in.indices, {DType::i32, DType::i64}, "indices");
  check::device(in.indices, dev, "indices");
  r.k = static_cast<int>(in.indices.size(1));
  FLEXEP_CHECK_ARG(r.k >= 1 && r.k <= max_topk, "indices", "has k=", r.k, " columns; this deepep dispatcher holds 1 to ",
                   max_topk, " slots per token (DeepEpOptions::max_topk)");
  check::shape(in.weights, {r.tokens, r.k}, "weights");
  check::dtype(in.weights, {DType::f32}, "weights");
  check::device(in.weights, dev, "weights");
  validate(call_signature::plan_params(opt, ranks, experts));
  if (opt.mode == DispatchMode::budget && opt.layout == DispatchLayout::rank_major)
    FLEXEP_CHECK_ARG(opt.budget_rows <= capacity, "options.budget_rows", opt.budget_rows,
                     " rows exceed the receive window's ", capacity, " (DeepEpOptions::max_recv_rows)");
  return r;
}

call_signature::DeviceViolation describe_violation(const call_signature::CallSignature& h) {
  return {"indices", call_signature::index_violation(h)};
}

}  // namespace

DispatchResult Dispatcher::dispatch(const DispatchInput& input, const DispatchOptions& options) {
  return dispatch_rows(input, TensorView(), options, false, nullptr);
}

Fp8DispatchResult Dispatcher::dispatch_fp8(const DispatchInput& input, const TensorView& scales,
                                           const DispatchOptions& options) {
  Fp8DispatchResult r;
  r.dispatch = dispatch_rows(input, scales, options, true, &r.scales);
  return r;
}

DispatchResult Dispatcher::dispatch_rows(const DispatchInput& input, const TensorView& scales,
                                         const DispatchOptions& options, bool fp8, Tensor* scales_out) {
  const CallScope call = open_call();
  const cudaStream_t s = call.stream;
  require_usable();
  ensure_initialized();
  const int R = world_size(), E = experts_, L = local_experts();
  const Device dev = Device::cuda(comm_->device());
  const bool budget = options.mode == DispatchMode::budget;

  // 1. Local checks and the count kernel.
  Routing rt;
  call_signature::CallSignature mine;
  auto h = std::make_shared<DeepEpHandle>();
  Tensor dest_mask, counts, counts_host;
  const std::exception_ptr local = call_signature::run_local_checks(mine, [&] {
    rt = check_input(input, scales, fp8, options, R, E, comm_->device(), options_.hidden, options_.max_tokens_per_rank,
                     max_topk_, capacity_rows_);
    if (budget) reserve_budget(options, rt.k, rt.hidden, fp8);
    h->slot_expert = scratch(budget, Scratch::slot_expert, rt.tokens * rt.k, false);
    dest_mask = scratch(budget, Scratch::dest_mask, R * mask_chunks(rt.tokens), false);  // written whole
    counts = scratch(budget, Scratch::counts, E + R, !budget);  // budget: zero on entry (the notify kernel's)
    CountRoutesCall count;
    count.indices = input.indices.data;
    count.indices_i64 = input.indices.dtype == DType::i64;
    count.tokens = rt.tokens;
    count.k = rt.k;
    count.experts = E;
    count.local_experts = L;
    count.ranks = R;
    count.slot_expert = h->slot_expert.data<std::int32_t>();
    count.expert_counts = reinterpret_cast<long long*>(counts.raw());
    count.dest_counts = count.expert_counts + E;
    count.dest_mask = reinterpret_cast<unsigned*>(dest_mask.raw());
    count.mask_chunks = mask_chunks(rt.tokens);
    count.errors = errors_.record();
    launch_count_routes(count, s);
    if (budget) return;  // a bad id travels with the count exchange, on the device
    counts_host = cuda::to_host(counts, s);  // waits for the count kernel: the check below does not wait again
    errors_.check(s, "dispatch");            // a bad id: ArgumentError naming "indices"
  });
  call_signature::set_call(mine, E, false, rt.hidden, rt.k, options, local ? 0 : rt.tokens);
  mine.fp8 = fp8;

  // 2. The count exchange and the call's layout.
  CallLayout lay;
  if (budget) {
    if (local) {  // this rank still takes part, with nothing to send, so that every rank stops together
      rt = Routing{0, options_.hidden, 1};
      h->slot_expert = scratch(true, Scratch::slot_expert, 0, false);
      dest_mask = scratch(true, Scratch::dest_mask, 0, false);
      counts = Tensor();
    }
  }
  // This rank's first row on each destination per chunk of 32 tokens (device/chunk_rows.cuh): the
  // notify kernel's in budget mode, a kernel of their own after the host's layout in blocking mode.
  const Tensor chunk_base = scratch(budget, Scratch::chunk_base, R * mask_chunks(rt.tokens), false);
  RowPlaces places{reinterpret_cast<const unsigned*>(dest_mask.raw()), chunk_base.data<std::int32_t>(),
                   mask_chunks(rt.tokens), -1};
  if (budget) {
    lay = exchange_on_device(mine, counts, options, rt.k, local != nullptr, places);
  } else {
    lay = exchange_on_host(mine, local, counts_host, options);
    ChunkBasesCall cb;
    cb.dest_mask = places.dest_mask;
    cb.layout = reinterpret_cast<const long long*>(lay.words.raw());
    cb.chunks = places.chunks;
    cb.ranks = R;
    cb.chunk_base = chunk_base.data<std::int32_t>();
    launch_chunk_bases(cb, s);
  }
  const std::int64_t N = lay.recv_rows, k = rt.k;

  // 3. Where each token goes, then the rows out.
  const bool expert_major = options.layout == DispatchLayout::expert_major;
  h->backend = "deepep";
  h->owner = this;
  h->rank = rank();
  h->tokens = rt.tokens;
  h->topk = k;
  h->hidden = rt.hidden;
  h->rows = expert_major ? lay.entries : N;
  h->recv_rows = N;
  h->local_experts = L;
  h->hidden_dtype = DType::bf16;
  h->prob_dtype = DType::f32;
  h->layout = options.layout;
  h->budget = budget;
  h->sequence = ++calls_;
  h->generation = generation_;
  h->call_layout = lay.words;
  h->dest_row = scratch(budget, Scratch::dest_row, R * rt.tokens, false);
  if (budget) budget_sequence_ = h->sequence;
  last_was_budget_ = budget;
  places.budget = budget && !expert_major && options.overflow == OverflowPolicy::drop ? options.budget_rows : -1;
  const auto* layout_words = reinterpret_cast<const long long*>(lay.words.raw());

  DispatchResult result;
  Tensor expert_rows = scratch(budget, Scratch::expert_rows, lay.entries, false);
  ReceiveCall listing;
  listing.expert_rows = expert_rows.data<std::int32_t>();
  if (budget) {
    result.tokens_per_expert = scratch(true, Scratch::tokens_per_expert, L, false);
    listing.tokens_per_expert = reinterpret_cast<long long*>(result.tokens_per_expert.raw());
    listing.layout = layout_words;
    listing.pad = options.pad_multiple;
    listing.capacity = lay.entries;
    listing.lengths_known = expert_major || options.overflow != OverflowPolicy::drop;  // by the notify kernel
    if (options.overflow == OverflowPolicy::drop && !expert_major) {
      listing.exchanged = reinterpret_cast<const long long*>(window() + win_.counts);
      listing.words = exchange_word::words(E, R);
      listing.rank = rank();
      listing.dropped = reinterpret_cast<unsigned long long*>(dropped_.raw());
    }
  } else {
    listing.capacity = lay.entries;
    listing.list_begin = layout_words + layout_word::list_begin(R);
    listing.list_len = layout_words + layout_word::list_len(R, L);
    result.tokens_per_expert = Tensor::from_vector(lay.tokens_per_expert, {L});
  }
  if (expert_major) {
    result.token_probs = scratch(budget, Scratch::token_probs, lay.entries, false);
    h->slot_pos = scratch(budget, Scratch::slot_pos, N * k, false);
    h->row_order = scratch(budget, Scratch::row_order, N * k, false);
    listing.weights = reinterpret_cast<const float*>(window() + win_.w);
    listing.probs = result.token_probs.data<float>();
    listing.slot_pos = h->slot_pos.data<std::int32_t>();
    listing.row_order = h->row_order.data<std::int32_t>();
  }
  const int S = fp8 ? static_cast<int>(rt.hidden / kFp8ScaleBlock) : 0;
  const RowPayload payload{input.hidden.data, fp8 ? rt.hidden : 2 * rt.hidden,
                           fp8 && rt.tokens > 0 ? scales.ptr<float>() : nullptr, S};
  h->recv_src = scratch(budget, Scratch::recv_src, N, false);  // kept: a later dispatch rewrites the window's copy
  listing.src = reinterpret_cast<const int*>(window() + win_.src);
  listing.src_out = h->recv_src.data<std::int32_t>();
  listing.src_rows = N;
  move_rows(*h, payload, &h->slot_expert, input.weights, win_.x, kDispatch, Phase::dispatch_tokens, &listing,
            &places);
  // Rows in place (DispatchOptions::rows_in_place): blocking mode only, whose listing and probs are
  // this call's own tensors (budget mode's are scratch a later dispatch rewrites), and bf16 rows.
  const bool in_place = expert_major && options.rows_in_place && !budget && !fp8;
  if (in_place) {
    // 5. The received rows out of the window (a later dispatch rewrites it), as they are: the experts
    //    read them through the listing.
    result.tokens = Tensor::empty({N, rt.hidden}, DType::bf16, dev);
    if (N > 0)
      FLEXEP_CUDA_CHECK(cudaMemcpyAsync(result.tokens.raw(), window() + win_.x,
                                        static_cast<std::size_t>(N) * payload.row_bytes, cudaMemcpyDeviceToDevice, s));
    result.expert_rows = expert_rows;
    h->expert_rows = std::move(expert_rows);
  } else if (expert_major) {
    // 5. Each entry's row out of the window; the window itself is rewritten by a later dispatch.
    const DType row_dtype = fp8 ? DType::e4m3 : DType::bf16;
    result.tokens = budget ? Tensor::wrap(TensorView(scratch(true, Scratch::entry_rows, lay.entries * payload.row_bytes / 2,
                                                             false).raw(),
                                                     row_dtype, {lay.entries, rt.hidden}, dev))
                           : Tensor::empty({lay.entries, rt.hidden}, row_dtype, dev);
    launch_gather_rows(window() + win_.x, expert_rows.data<std::int32_t>(), lay.entries, payload.row_bytes,
                       result.tokens.raw(), s);
    if (fp8) {
      *scales_out = budget ? Tensor::wrap(TensorView(scratch(true, Scratch::entry_scales, lay.entries * S, false).raw(),
                                                     DType::f32, {lay.entries, S}, dev))
                           : Tensor::empty({lay.entries, S}, DType::f32, dev);
      launch_gather_scales(reinterpret_cast<const float*>(window() + win_.scales), expert_rows.data<std::int32_t>(),
                           lay.entries, S, scales_out->data<float>(), s);
    }
    h->expert_rows = std::move(expert_rows);
  } else {
    result.tokens =
        Tensor::wrap(TensorView(window() + win_.x, fp8 ? DType::e4m3 : DType::bf16, {N, rt.hidden}, dev));
    if (fp8) *scales_out = Tensor::wrap(TensorView(window() + win_.scales, DType::f32, {N, S}, dev));
    result.topk_indices = Tensor::wrap(TensorView(window() + win_.idx, DType::i32, {N, k}, dev));
    result.topk_weights = Tensor::wrap(TensorView(window() + win_.w, DType::f32, {N, k}, dev));
    result.expert_rows = std::move(expert_rows);
  }
  if (local) std::rethrow_exception(local);  // budget mode: after this rank's part of the protocol
  if (!budget) check(s, "dispatch");
  result.handle = std::move(h);
  return result;
}

Dispatcher::CallLayout Dispatcher::exchange_on_host(const call_signature::CallSignature& mine,
                                                                const std::exception_ptr& local,
                                                                const Tensor& counts_host,
                                                                const DispatchOptions& options) {
  const int R = world_size(), E = experts_, L = local_experts(), me = rank();
  std::vector<long long> words(static_cast<std::size_t>(exchange_word::words(E, R)), 0);
  call_signature::encode_words(mine, words.data());
  words[exchange_word::fp8] = mine.fp8 ? 1 : 0;
  words[exchange_word::layout] = mine.layout == DispatchLayout::expert_major ? 1 : 0;
  if (!local)
    std::copy(counts_host.data<std::int64_t>(), counts_host.data<std::int64_t>() + E + R,
              words.begin() + exchange_word::header);
  const std::vector<long long> all = comm_->all_gather_i64(words, "deepep dispatch:count-exchange");
  const Gathered g = read_gathered(all.data());
  if (local) std::rethrow_exception(local);
  const std::vector<RankMajorLayout> layouts = agree(g, options);

  // The layout words: what the kernels read, uploaded once.
  const RankMajorLayout& lay = layouts[static_cast<std::size_t>(me)];
  std::vector<std::int64_t> w(static_cast<std::size_t>(layout_word::words(R, L)), 0);
  w[layout_word::received] = lay.required_rows;
  for (int d = 0; d < R; ++d)
    w[static_cast<std::size_t>(layout_word::row_begin + d)] =
        layouts[static_cast<std::size_t>(d)].source_begin[static_cast<std::size_t>(me)];
  for (int src = 0; src <= R; ++src)
    w[static_cast<std::size_t>(layout_word::source_begin(R) + src)] =
        src < R ? lay.source_begin[static_cast<std::size_t>(src)] : lay.required_rows;
  CallLayout out;
  out.recv_rows = lay.out_rows;
  out.tokens_per_expert.resize(static_cast<std::size_t>(L));
  for (int le = 0; le < L; ++le) {
    std::int64_t here = 0;  // pairs for this rank's expert le from every source
    for (int src = 0; src < R; ++src) here += g.pairs[static_cast<std::size_t>(src) * E + me * L + le];
    const std::int64_t pad = options.pad_multiple;
    const std::int64_t n = (here + pad - 1) / pad * pad;
    out.tokens_per_expert[static_cast<std::size_t>(le)] = n;
    w[static_cast<std::size_t>(layout_word::list_begin(R) + le)] = out.entries;
    w[static_cast<std::size_t>(layout_word::list_len(R, L) + le)] = n;
    out.entries += n;
  }
  out.words = cuda::to_device(Tensor::from_vector(w, {static_cast<std::int64_t>(w.size())}), comm_->device(), stream());
  return out;
}

Dispatcher::Gathered Dispatcher::read_gathered(const long long* all) const {
  const int R = world_size(), E = experts_;
  const std::int64_t P = exchange_word::words(E, R);
  Gathered g;
  g.rows.resize(static_cast<std::size_t>(R * R));
  g.pairs.resize(static_cast<std::size_t>(R) * static_cast<std::size_t>(E));
  for (int src = 0; src < R; ++src) {
    const long long* p = all + src * P;
    g.headers.push_back(call_signature::decode_words(p));
    g.headers.back().fp8 = p[exchange_word::fp8] != 0;
    g.headers.back().layout = p[exchange_word::layout] != 0 ? DispatchLayout::expert_major : DispatchLayout::rank_major;
    std::copy(p + exchange_word::header, p + exchange_word::header + E,
              g.pairs.begin() + static_cast<std::ptrdiff_t>(src) * E);
    for (int d = 0; d < R; ++d) g.rows[static_cast<std::size_t>(src * R + d)] = p[exchange_word::header + E + d];
  }
  return g;
}

std::vector<RankMajorLayout> Dispatcher::agree(const Gathered& g, const DispatchOptions& options) const {
  if (auto err = call_signature::peer_failure(g.headers, rank(), describe_violation)) std::rethrow_exception(err);
  if (auto err = call_signature::compare_headers(g.headers)) std::rethrow_exception(err);
  // Throws the budget overflow; then every rank checks every receiver's window: all raise alike.
  // The expert-major layout's budget counts entries: every rank-major row is received (the window
  // bounds them), and the expert-major plan of every receiver raises its overflow.
  const PlanParams params = call_signature::plan_params(options, world_size(), experts_);
  const bool entries_budget = options.mode == DispatchMode::budget && options.layout == DispatchLayout::expert_major;
  PlanParams rows_params = params;
  if (entries_budget) rows_params.budget_rows.reset();
  std::vector<RankMajorLayout> layouts = rank_major_layouts(g.rows, rows_params);
  for (std::size_t d = 0; d < layouts.size(); ++d)
    FLEXEP_CHECK(layouts[d].out_rows <= capacity_rows_, "deepep dispatch: rank ", d, " receives ", layouts[d].out_rows,
                 " rows, more than the ", capacity_rows_, " its receive buffer holds (DeepEpOptions::max_recv_rows)");
  if (entries_budget) DispatchPlan::build(g.pairs, params);
  return layouts;
}

Dispatcher::CallLayout Dispatcher::exchange_on_device(const call_signature::CallSignature& mine,
                                                                  const Tensor& counts, const DispatchOptions& options,
                                                                  int k, bool failed, const RowPlaces& places) {
  const int R = world_size(), L = local_experts();
  const bool expert_major = options.layout == DispatchLayout::expert_major;
  CallLayout out;  // a rank whose checks failed (its options may be the reason) receives nothing
  out.recv_rows = failed ? 0 : (expert_major ? capacity_rows_ : options.budget_rows);
  out.entries = failed ? 0
                       : (expert_major ? options.budget_rows
                                       : expert_rows_capacity(options.budget_rows, k, L, options.pad_multiple));
  out.words = scratch(true, Scratch::layout, layout_word::words(R, L), false);
  NotifyCall c;
  c.peers = sym_.peer_table();
  c.rank = rank();
  c.ranks = R;
  c.experts = experts_;
  call_signature::encode_words(mine, c.header);
  c.header[exchange_word::fp8] = mine.fp8 ? 1 : 0;
  c.header[exchange_word::layout] = mine.layout == DispatchLayout::expert_major ? 1 : 0;
  c.errors = errors_.record();
  c.counts = counts.defined() ? reinterpret_cast<long long*>(counts.raw()) : nullptr;
  c.words = exchange_word::words(experts_, R);
  c.win = win_;
  c.op = ops_ + kCounts;
  c.status = status_;
  c.timeout_ns = device_timeout_ns(options_.timeout_seconds);
  c.budget = out.recv_rows;
  c.capacity = capacity_rows_;
  c.drop = options.overflow == OverflowPolicy::drop;
  c.expert_major = expert_major;
  c.entries_budget = options.budget_rows;
  c.pad = options.pad_multiple;
  c.local_experts = L;
  c.tokens_per_expert = reinterpret_cast<long long*>(scratch(true, Scratch::tokens_per_expert, L, false).raw());
  c.rank_major_lengths = !expert_major && options.overflow != OverflowPolicy::drop;
  c.dest_mask = places.dest_mask;
  c.chunk_base = const_cast<int*>(places.chunk_base);
  c.chunks = places.chunks;
  c.dropped = reinterpret_cast<long long*>(dropped_.raw());
  c.layout = reinterpret_cast<long long*>(out.words.raw());
  c.snapshot = snapshot_;
  launch_notify(c, stream());
  return out;
}

DType Dispatcher::scratch_dtype(Scratch which) {  // counts and layout words int64, row indices int32
  switch (which) {
    case Scratch::counts:
    case Scratch::layout:
    case Scratch::tokens_per_expert:
      return DType::i64;
    case Scratch::token_probs:
    case Scratch::entry_scales:
      return DType::f32;
    case Scratch::entry_rows:
      return DType::bf16;
    default:
      return DType::i32;
  }
}

Tensor Dispatcher::scratch(bool budget, Scratch which, std::int64_t n, bool zero) {
  const DType dt = scratch_dtype(which);
  const Device dev = Device::cuda(comm_->device());
  if (!budget) return zero ? Tensor::zeros({n}, dt, dev) : Tensor::empty({n}, dt, dev);
  Tensor& buf = budget_buffers_[static_cast<std::size_t>(which)];
  FLEXEP_CHECK(buf.numel() >= n, "deepep: budget buffer ", static_cast<int>(which), " holds ", buf.numel(),
               " elements, the call needs ", n, " (reserve_budget was not called)");
  Tensor t = Tensor::wrap(TensorView(buf.raw(), dt, {n}, dev));
  if (zero && n > 0) FLEXEP_CUDA_CHECK(cudaMemsetAsync(t.raw(), 0, static_cast<std::size_t>(t.nbytes()), stream()));
  return t;
}

void Dispatcher::move_rows(const DeepEpHandle& h, const RowPayload& payload, const Tensor* slot_expert,
                           const TensorView& weights, unsigned long long rows_at, Kind kind, Phase phase,
                           const ReceiveCall* listing, const RowPlaces* places) {
  const cudaStream_t s = stream();
  SendRowsCall c = rows_sender(kind);
  c.k = static_cast<int>(h.topk);
  c.tokens = h.tokens;
  c.row_bytes = payload.row_bytes;
  c.x = payload.rows;
  c.scales = payload.scales;
  c.scale_cols = payload.scale_cols;
  c.slot_expert = slot_expert ? slot_expert->data<std::int32_t>() : nullptr;
  c.weights = slot_expert && h.tokens > 0 ? weights.ptr<float>() : nullptr;  // none when a failed rank sends nothing
  if (places != nullptr) {  // a dispatch: the kernel places each row and writes h.dest_row
    c.dest_mask = places->dest_mask;
    c.chunk_base = places->chunk_base;
    c.chunks = places->chunks;
    c.budget = places->budget;
    c.layout = reinterpret_cast<const long long*>(h.call_layout.raw());
    c.dest_row_out = const_cast<int*>(h.dest_row.data<std::int32_t>());
    if (h.layout == DispatchLayout::expert_major) {  // -1 before the listing kernel writes the entries'
      c.minus_one[0] = const_cast<int*>(h.slot_pos.data<std::int32_t>());
      c.minus_one[1] = const_cast<int*>(h.row_order.data<std::int32_t>());
      c.minus_one_count = h.recv_rows * h.topk;
    }
  } else {
    c.dest_row = h.dest_row.data<std::int32_t>();
  }
  c.rows_at = rows_at;
  // Budget mode: the window region's rows past the received ones zeroed (not for the expert-major
  // layout, which reads none of them) and, with slots, their slots cleared.
  if (h.budget && (kind == kDispatch || h.layout == DispatchLayout::rank_major)) {
    c.tail.window = window();
    c.tail.rows_at = rows_at;
    c.tail.win = win_;
    c.tail.slots = slot_expert != nullptr;
    c.tail.zero_rows = h.layout == DispatchLayout::rank_major;
    c.tail.layout = reinterpret_cast<const long long*>(h.call_layout.raw());
    c.tail.rows = h.recv_rows;
    c.tail.row_bytes = payload.row_bytes;
    c.tail.k = static_cast<int>(h.topk);
    c.tail.scale_cols = payload.scale_cols;
  }
  launch_send_rows(c, send_ctas(), s);

  ReceiveCall r = rows_receiver(kind, phase, listing);
  r.idx = reinterpret_cast<const int*>(window() + win_.idx);
  r.k = static_cast<int>(h.topk);
  r.rows = h.recv_rows;
  launch_receive(r, s);
}

SendRowsCall Dispatcher::rows_sender(Kind kind) const {
  SendRowsCall c;
  c.peers = sym_.peer_table();
  c.rank = rank();
  c.ranks = world_size();
  c.local_experts = local_experts();
  c.win = win_;
  c.op = ops_ + kind;
  c.kind = kind;
  return c;
}

ReceiveCall Dispatcher::rows_receiver(Kind kind, Phase phase, const ReceiveCall* listing) const {
  ReceiveCall r = listing ? *listing : ReceiveCall{};
  r.flags = own_flags();
  r.rank = rank();
  r.ranks = world_size();
  r.kind = kind;
  r.op = ops_ + kind;
  r.status = status_;
  r.timeout_ns = device_timeout_ns(options_.timeout_seconds);
  r.phase = phase;
  r.local_experts = local_experts();
  return r;
}

Tensor Dispatcher::combine_backward(const Handle& handle, const TensorView& grad_out) {
  const CallScope call = open_call();
  const cudaStream_t s = call.stream;
  require_usable();
  require_buffers();
  const DeepEpHandle* hp = nullptr;
  try {
    hp = &own_handle(handle);
    check_rows(grad_out, hp->tokens, *hp, "grad_out");
  } catch (const Error&) {
    stop_together(kCombineBackward, Phase::combine_backward_rows, failed_arg_of(std::current_exception()));
    throw;
  }
  const DeepEpHandle& h = *hp;
  move_rows(h, bf16_rows(grad_out), nullptr, TensorView(), win_.grad, kCombineBackward, Phase::combine_backward_rows,
            nullptr, nullptr);
  const Device dev = Device::cuda(comm_->device());
  Tensor out;
  if (h.layout == DispatchLayout::expert_major) {
    out = Tensor::empty({h.rows, h.hidden}, DType::bf16, dev);
    launch_gather_rows(window() + win_.grad, h.expert_rows.data<std::int32_t>(), h.rows, 2 * h.hidden, out.raw(), s);
  } else {
    out = Tensor::wrap(TensorView(window() + win_.grad, DType::bf16, {h.rows, h.hidden}, dev));
  }
  if (options_.check_blocking_calls && !h.budget) check(s, "combine_backward");
  return out;
}

}  // namespace flexep::deepep
