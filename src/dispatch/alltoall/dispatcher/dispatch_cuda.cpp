// The alltoall dispatch. Its steps, on every rank:
//   1. local argument checks (a failure is not raised yet: it travels with step 3);
//   2. count kernel: validated slots, pairs per global expert, tokens per destination rank;
//   3. ONE ncclAllGather of [header | counts | tokens per rank], host sync ("dispatch:count-exchange");
//      every rank applies the same agreement rules to the same words and raises the same errors;
//   4. every rank builds the same DispatchPlan; this rank keeps its message sizes and placement;
//   5. pack each token once per destination rank, ordered (destination rank, token), with metadata;
//   6. grouped send/recv of the metadata, then of the rows ("dispatch:tokens");
//   7. place every received (row, entry) expert-major and scatter rows and probs there.
#include <algorithm>
#include <climits>

#include "dispatch/alltoall/dispatcher/dispatcher.h"
#include "dispatch/alltoall/kernels/kernels.h"
#include "dispatch/alltoall/dispatcher/layout.h"
#include "dispatch/alltoall/dispatcher/transfer.h"
#include "dispatch/common/count_routes.h"
#include "dispatch/common/routing_checks.h"
#include "flexep/core/checks.h"
#include "flexep/cuda/runtime.h"

namespace flexep {
namespace alltoall {

namespace {

}  // namespace

// This rank's input after the local checks.
struct AlltoallDispatcher::Routing {
  std::int64_t tokens = 0, hidden = 0;
  int slots = 0;  // k, or E in the multihot form (converted to slots with k = E on the device)
  bool multihot = false;
};

namespace {

AlltoallDispatcher::Routing check_input(const DispatchInput& in, const DispatchOptions& opt, int ranks, int experts, int device) {
  const Device dev = Device::cuda(device);
  check::rank(in.hidden, 2, "hidden");
  check::dtype(in.hidden, {DType::bf16}, "hidden");
  check::device(in.hidden, dev, "hidden");
  AlltoallDispatcher::Routing r;
  r.tokens = in.hidden.size(0);
  r.hidden = in.hidden.size(1);
  r.multihot = in.multihot();
  check::routing_form(in, r.tokens, experts, dev, [](std::int64_t k) {
    FLEXEP_CHECK_ARG(k <= INT_MAX, "indices", "has ", k, " columns; at most ", INT_MAX);
  });
  r.slots = r.multihot ? experts : static_cast<int>(in.indices.size(1));
  check::expert_major_layout(opt, "alltoall");
  validate(plan_params(opt, ranks, experts));
  // Slots and send positions are indexed with 32-bit integers in the kernels.
  FLEXEP_CHECK_ARG(r.tokens * std::max(r.slots, ranks) <= INT_MAX, "hidden", "has ", r.tokens,
                   " tokens; the alltoall backend handles at most ", INT_MAX / std::max(r.slots, ranks),
                   " per call with ", r.slots, " slots and ", ranks, " ranks");
  return r;
}

long long* words_of(const Tensor& t) { return reinterpret_cast<long long*>(t.raw()); }

}  // namespace

// The sender's working tensors of one call, from the count kernel to the pack.
struct AlltoallDispatcher::Staging {
  Tensor payload;      // this rank's words of the count exchange: [header | counts | tokens per rank]
  Tensor slot_expert;  // [T * k] validated expert of every slot (-1: bad id)
  Tensor slot_weight;  // [T * k] the slot weights, multihot form only
  Tensor dest_flag;    // [R * T] token t goes to rank r
  const float* weights = nullptr;
};

// Rows and their metadata, as sent or as received.
struct AlltoallDispatcher::Packed {
  Tensor meta;  // [rows * M] SlotMeta
  Tensor rows;  // [rows, H] bf16
};

DispatchResult AlltoallDispatcher::dispatch(const DispatchInput& input, const DispatchOptions& options) {
  cuda::init();
  cuda::DeviceGuard device_guard(comm_->device());
  const cudaStream_t s = stream();
  cuda::StreamGuard stream_guard(s);  // temporaries and outputs are allocated (and freed) on s
  handshake();

  // 1. Local checks.
  Routing rt;
  RankHeader mine;
  const std::exception_ptr local = call_signature::run_local_checks(
      mine, [&] { rt = check_input(input, options, world_size(), experts_, comm_->device()); });
  call_signature::set_call(mine, experts_, input.multihot(), rt.hidden, rt.multihot ? 0 : rt.slots, options,
                           rt.tokens);

  // 2-4. Counts, their exchange, the agreement and this rank's plan. The tensors of one call live
  //      until it returns: they are freed on s, after the kernels that use them.
  const Staging staged = count_slots(input, rt, mine, local != nullptr);
  const Exchange ex = exchange_counts(staged.payload);
  if (local) std::rethrow_exception(local);
  const RankPlan rp = agree(ex, options, rt.slots);
  const Tensor placement = upload_placement(rp);  // now, while the stream is idle
  auto h = make_handle(rt, rp, staged.slot_expert);

  // 5-7. Pack, send, place.
  const Packed packed = pack(*h, staged, input.hidden, rp);
  const Packed received = send_tokens(*h, packed);
  DispatchResult result = place_received(*h, received, placement, rp, options.mode);
  comm_->wait(s, "dispatch:tokens");
  result.handle = std::move(h);
  return result;
}

// The count kernel (skipped after a local failure: the inputs may not be safe to read), then the
// header after it, so that a bad id the kernel finds travels in this rank's header.
AlltoallDispatcher::Staging AlltoallDispatcher::count_slots(const DispatchInput& input, const Routing& rt,
                                                            const RankHeader& mine, bool failed) {
  const cudaStream_t s = stream();
  const int R = world_size(), E = experts_;
  const Device dev = Device::cuda(comm_->device());
  const std::int64_t T = rt.tokens;
  const int k = rt.slots;
  Staging st;
  st.payload = Tensor::empty({payload_words(E, R)}, DType::i64, dev);
  cuda::zero_async(st.payload, s);
  if (!failed) {
    st.slot_expert = Tensor::empty({T * k}, DType::i32, dev);
    st.dest_flag = Tensor::empty({R * T}, DType::i32, dev);
    cuda::zero_async(st.dest_flag, s);
    const void* indices = nullptr;
    bool indices_i64 = false;
    if (rt.multihot) {
      st.slot_weight = Tensor::empty({T * k}, DType::f32, dev);
      launch_multihot_to_slots(static_cast<const unsigned char*>(input.routing_map.data), input.probs.ptr<float>(), T,
                               E, st.slot_expert.data<std::int32_t>(), st.slot_weight.data<float>(), s);
      indices = st.slot_expert.raw();
      st.weights = st.slot_weight.data<float>();
    } else {
      indices = input.indices.data;
      indices_i64 = input.indices.dtype == DType::i64;
      st.weights = input.weights.ptr<float>();
    }
    CountRoutesCall count;
    count.indices = indices;
    count.indices_i64 = indices_i64;
    count.tokens = T;
    count.k = k;
    count.experts = E;
    count.local_experts = local_experts();
    count.ranks = world_size();
    count.slot_expert = st.slot_expert.data<std::int32_t>();
    count.expert_counts = words_of(st.payload) + word::count;
    count.dest_counts = words_of(st.payload) + word::count + E;
    count.dest_flag = st.dest_flag.data<std::int32_t>();
    count.errors = errors_.record();
    launch_count_routes(count, s);
  }
  HeaderWords header{};
  const std::vector<std::int64_t> encoded = encode(mine);
  for (int i = 0; i < word::count; ++i) header.w[i] = encoded[static_cast<std::size_t>(i)];
  launch_write_header(header, errors_.record(), words_of(st.payload), s);
  return st;
}

// ONE ncclAllGather of every rank's payload, and a host sync.
Exchange AlltoallDispatcher::exchange_counts(const Tensor& payload) {
  const cudaStream_t s = stream();
  const int R = world_size();
  const std::int64_t P = payload.numel();
  Tensor gathered = Tensor::empty({R * P}, DType::i64, Device::cuda(comm_->device()));
  {
    const cudaStream_t cs = fork(s);
    FLEXEP_NCCL_CHECK(ncclAllGather(payload.raw(), gathered.raw(), static_cast<std::size_t>(P), ncclInt64,
                                    comm_->get(), cs));
    comm_->wait_enqueued("dispatch:count-exchange");
    join(s, join_event_);
  }
  comm_->wait(s, "dispatch:count-exchange");
  const Tensor gathered_host = cuda::to_host(gathered, s);
  const std::int64_t* g = gathered_host.data<std::int64_t>();
  return parse_exchange(std::vector<std::int64_t>(g, g + R * P), R, experts_);
}

// The same words on every rank, so the same decision everywhere: every rank raises the same
// errors, and builds the same plan (an overflow raises on every rank).
RankPlan AlltoallDispatcher::agree(const Exchange& ex, const DispatchOptions& options, int slots) {
  const int me = rank();
  if (ex.headers[static_cast<std::size_t>(me)].device_arg != 0) {
    errors_.check(stream(), "dispatch");  // raises this rank's precise error
    throw_error("alltoall dispatch: the count kernel reported an error that the record no longer holds");
  }
  if (auto err = peer_failure(ex, me)) std::rethrow_exception(err);
  if (auto err = compare_headers(ex.headers)) std::rethrow_exception(err);
  const DispatchPlan plan = DispatchPlan::build(ex.counts, plan_params(options, world_size(), experts_));
  check_index_range(plan, ex, meta_width(slots, local_experts()));
  return rank_plan(plan, ex, me);
}

// The receiver's placement parameters [expert_begin | kept_rows | pairs_before | tokens_per_expert]
// on the device. A copy from pageable memory waits for the stream: made while it is idle.
Tensor AlltoallDispatcher::upload_placement(const RankPlan& rp) {
  std::vector<std::int64_t> params;
  for (const auto* v : {&rp.expert_begin, &rp.kept_rows, &rp.pairs_before, &rp.tokens_per_expert})
    params.insert(params.end(), v->begin(), v->end());
  Tensor dev = Tensor::empty({4 * local_experts()}, DType::i64, Device::cuda(comm_->device()));
  FLEXEP_CUDA_CHECK(cudaMemcpyAsync(dev.raw(), params.data(), params.size() * sizeof(std::int64_t),
                                    cudaMemcpyHostToDevice, stream()));
  return dev;
}

std::shared_ptr<AlltoallHandle> AlltoallDispatcher::make_handle(const Routing& rt, const RankPlan& rp,
                                                                const Tensor& slot_expert) {
  auto h = std::make_shared<AlltoallHandle>();
  h->backend = "alltoall";
  h->owner = this;
  h->rank = rank();
  h->tokens = rt.tokens;
  h->topk = rt.slots;  // k, or E in the multihot form
  h->multihot = rt.multihot;
  h->hidden = rt.hidden;
  h->rows = rp.out_rows;
  h->local_experts = local_experts();
  h->hidden_dtype = DType::bf16;
  h->prob_dtype = DType::f32;
  h->slots = rt.slots;
  h->meta_width = meta_width(rt.slots, local_experts());
  h->send_count = rp.send_count;
  h->send_offset = rp.send_offset;
  h->recv_count = rp.recv_count;
  h->recv_offset = rp.recv_offset;
  h->total_send = rp.total_send;
  h->total_recv = rp.total_recv;
  h->slot_expert = slot_expert;
  return h;
}

// One row per (destination rank, token), ordered so, with its metadata; the handle keeps where
// every slot and row went (combine's way back).
AlltoallDispatcher::Packed AlltoallDispatcher::pack(AlltoallHandle& h, const Staging& st, const TensorView& hidden,
                                                    const RankPlan& rp) {
  const cudaStream_t s = stream();
  const Device dev = Device::cuda(comm_->device());
  const std::int64_t T = h.tokens, H = h.hidden;
  const int R = world_size(), k = h.slots, M = h.meta_width;
  h.slot_entry = Tensor::empty({T * k}, DType::i32, dev);
  h.send_pos = Tensor::empty({R * T}, DType::i32, dev);
  Tensor dest_scan = Tensor::empty({R * T}, DType::i32, dev);
  exclusive_sum(st.dest_flag.data<std::int32_t>(), dest_scan.data<std::int32_t>(), R * T, comm_->device(), s);
  Packed out;
  out.meta = Tensor::empty({rp.total_send * M}, DType::i64, dev);  // SlotMeta: 8 bytes
  out.rows = Tensor::empty({rp.total_send, H}, DType::bf16, dev);
  launch_pack_meta(st.slot_expert.data<std::int32_t>(), st.weights, T, k, h.local_experts, R, M,
                   st.dest_flag.data<std::int32_t>(), dest_scan.data<std::int32_t>(), h.send_pos.data<std::int32_t>(),
                   h.slot_entry.data<std::int32_t>(), static_cast<SlotMeta*>(out.meta.raw()), s);
  launch_pack_rows(hidden.data, T, H, R, h.send_pos.data<std::int32_t>(), out.rows.raw(), s);
  return out;
}

// Metadata first, then rows: with a separate stream the receiver places rows while the rows are
// still in flight (meta_event_ marks the metadata's arrival, join_event_ the rows').
AlltoallDispatcher::Packed AlltoallDispatcher::send_tokens(const AlltoallHandle& h, const Packed& sent) {
  const Device dev = Device::cuda(comm_->device());
  const int M = h.meta_width;
  Packed in;
  in.meta = Tensor::empty({h.total_recv * M}, DType::i64, dev);
  in.rows = Tensor::empty({h.total_recv, h.hidden}, DType::bf16, dev);
  const Routes forward{h.send_count, h.send_offset, h.recv_count, h.recv_offset};
  const cudaStream_t cs = fork(stream());
  send_recv(*comm_, cs, forward, {{sent.meta.raw(), in.meta.raw(), M * sizeof(SlotMeta)}}, "dispatch:tokens");
  if (comm_stream_) FLEXEP_CUDA_CHECK(cudaEventRecord(meta_event_, cs));
  send_recv(*comm_, cs, forward, {{sent.rows.raw(), in.rows.raw(), static_cast<std::size_t>(h.hidden) * 2}},
            "dispatch:tokens");
  if (comm_stream_) FLEXEP_CUDA_CHECK(cudaEventRecord(join_event_, cs));
  return in;
}

// Every received (row, entry) gets its expert-major place, and rows and probs are scattered there.
// Padding rows and the budget's tail stay zero (prob 0).
DispatchResult AlltoallDispatcher::place_received(AlltoallHandle& h, const Packed& in, const Tensor& placement,
                                                  const RankPlan& rp, DispatchMode mode) {
  const cudaStream_t s = stream();
  const Device dev = Device::cuda(comm_->device());
  const int L = h.local_experts, M = h.meta_width;
  const std::int64_t N = rp.out_rows, H = h.hidden, recv = h.total_recv;
  const auto* meta = static_cast<const SlotMeta*>(in.meta.raw());
  DispatchResult result;
  result.tokens = Tensor::empty({N, H}, DType::bf16, dev);
  result.token_probs = Tensor::empty({N}, DType::f32, dev);
  cuda::zero_async(result.tokens, s);
  cuda::zero_async(result.token_probs, s);
  Tensor flags = Tensor::empty({L * recv}, DType::i32, dev);
  Tensor flag_scan = Tensor::empty({L * recv}, DType::i32, dev);
  cuda::zero_async(flags, s);
  h.out_row = Tensor::empty({recv * M}, DType::i32, dev);
  if (comm_stream_) FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(s, meta_event_, 0));
  launch_mark_received(meta, recv, M, L, flags.data<std::int32_t>(), s);
  exclusive_sum(flags.data<std::int32_t>(), flag_scan.data<std::int32_t>(), L * recv, comm_->device(), s);
  launch_place_received(meta, flag_scan.data<std::int32_t>(), recv, M, L, words_of(placement), N,
                        h.out_row.data<std::int32_t>(), s);
  if (comm_stream_) FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(s, join_event_, 0));
  launch_scatter_rows(in.rows.raw(), meta, h.out_row.data<std::int32_t>(), recv, M, H, result.tokens.raw(),
                      result.token_probs.data<float>(), s);
  if (mode == DispatchMode::budget) {  // stays on the device in budget mode
    result.tokens_per_expert = Tensor::empty({L}, DType::i64, dev);
    FLEXEP_CUDA_CHECK(cudaMemcpyAsync(result.tokens_per_expert.raw(), words_of(placement) + 3 * L,
                                      static_cast<std::size_t>(L) * sizeof(std::int64_t), cudaMemcpyDeviceToDevice, s));
  } else {
    result.tokens_per_expert = Tensor::from_vector(rp.tokens_per_expert, {L});
  }
  result.dropped = rp.dropped;
  return result;
}

}  // namespace alltoall
}  // namespace flexep
