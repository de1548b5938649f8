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
#include "dispatch/common/routing_checks.h"
#include "flexep/core/checks.h"
#include "flexep/cuda/runtime.h"

namespace flexep {
namespace alltoall {

namespace {

// This rank's input after the local checks.
struct Routing {
  std::int64_t tokens = 0, hidden = 0;
  int slots = 0;  // k, or E in the multihot form (converted to slots with k = E on the device)
  bool multihot = false;
};

Routing check_input(const DispatchInput& in, const DispatchOptions& opt, int ranks, int experts, int device) {
  const Device dev = Device::cuda(device);
  check::rank(in.hidden, 2, "hidden");
  check::dtype(in.hidden, {DType::bf16}, "hidden");
  check::device(in.hidden, dev, "hidden");
  Routing r;
  r.tokens = in.hidden.size(0);
  r.hidden = in.hidden.size(1);
  r.multihot = in.multihot();
  check::routing_form(in, r.tokens, experts, dev, [](std::int64_t k) {
    FLEXEP_CHECK_ARG(k <= INT_MAX, "indices", "has ", k, " columns; at most ", INT_MAX);
  });
  r.slots = r.multihot ? experts : static_cast<int>(in.indices.size(1));
  validate(plan_params(opt, ranks, experts));
  // Slots and send positions are indexed with 32-bit integers in the kernels.
  FLEXEP_CHECK_ARG(r.tokens * std::max(r.slots, ranks) <= INT_MAX, "hidden", "has ", r.tokens,
                   " tokens; the alltoall backend handles at most ", INT_MAX / std::max(r.slots, ranks),
                   " per call with ", r.slots, " slots and ", ranks, " ranks");
  return r;
}

long long* words_of(const Tensor& t) { return reinterpret_cast<long long*>(t.raw()); }

}  // namespace

DispatchResult AlltoallDispatcher::dispatch(const DispatchInput& input, const DispatchOptions& options) {
  cuda::init();
  cuda::DeviceGuard device_guard(comm_->device());
  const cudaStream_t s = stream();
  cuda::StreamGuard stream_guard(s);  // temporaries and outputs are allocated (and freed) on s
  const int R = world_size(), E = experts_, L = local_experts(), me = rank(), device = comm_->device();
  const Device dev = Device::cuda(device);
  handshake();

  // 1. Local checks.
  Routing rt;
  RankHeader mine;
  const std::exception_ptr local =
      call_signature::run_local_checks(mine, [&] { rt = check_input(input, options, R, E, device); });
  call_signature::set_call(mine, E, input.multihot(), rt.hidden, rt.multihot ? 0 : rt.slots, options, rt.tokens);

  // 2. Count kernel (skipped after a local failure: the inputs may not be safe to read).
  const std::int64_t T = rt.tokens, H = rt.hidden, P = payload_words(E, R);
  const int k = rt.slots;
  Tensor payload = Tensor::empty({P}, DType::i64, dev);
  cuda::zero_async(payload, s);
  Tensor slot_expert, slot_weight, dest_flag;
  const float* weights = nullptr;
  if (!local) {
    slot_expert = Tensor::empty({T * k}, DType::i32, dev);
    dest_flag = Tensor::empty({R * T}, DType::i32, dev);
    cuda::zero_async(dest_flag, s);
    const void* indices = nullptr;
    bool indices_i64 = false;
    if (rt.multihot) {
      slot_weight = Tensor::empty({T * k}, DType::f32, dev);
      launch_multihot_to_slots(static_cast<const unsigned char*>(input.routing_map.data), input.probs.ptr<float>(), T,
                               E, slot_expert.data<std::int32_t>(), slot_weight.data<float>(), s);
      indices = slot_expert.raw();
      weights = slot_weight.data<float>();
    } else {
      indices = input.indices.data;
      indices_i64 = input.indices.dtype == DType::i64;
      weights = input.weights.ptr<float>();
    }
    launch_count_slots(indices, indices_i64, T, k, E, L, slot_expert.data<std::int32_t>(),
                       words_of(payload) + word::count, words_of(payload) + word::count + E,
                       dest_flag.data<std::int32_t>(), errors_.record(), s);
  }
  HeaderWords header{};
  const std::vector<std::int64_t> encoded = encode(mine);
  for (int i = 0; i < word::count; ++i) header.w[i] = encoded[static_cast<std::size_t>(i)];
  launch_write_header(header, errors_.record(), words_of(payload), s);

  // 3. Count exchange.
  Tensor gathered = Tensor::empty({R * P}, DType::i64, dev);
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
  const Exchange ex = parse_exchange(std::vector<std::int64_t>(g, g + R * P), R, E);

  // 4. Agreement and plan: the same words on every rank, so the same decision everywhere.
  if (local) std::rethrow_exception(local);
  if (ex.headers[static_cast<std::size_t>(me)].device_arg != 0) {
    errors_.check(s, "dispatch");  // raises this rank's precise error
    throw_error("alltoall dispatch: the count kernel reported an error that the record no longer holds");
  }
  if (auto err = peer_failure(ex, me)) std::rethrow_exception(err);
  if (auto err = compare_headers(ex.headers)) std::rethrow_exception(err);
  const DispatchPlan plan = DispatchPlan::build(ex.counts, plan_params(options, R, E));  // overflow: every rank
  const int M = meta_width(k, L);
  check_index_range(plan, ex, M);
  const RankPlan rp = rank_plan(plan, ex, me);
  const std::int64_t N = rp.out_rows;

  // The receiver's placement parameters [expert_begin | kept_rows | pairs_before | tokens_per_expert].
  // Copied now, while the stream is idle (a copy from pageable memory waits for the stream).
  std::vector<std::int64_t> params;
  for (const auto* v : {&rp.expert_begin, &rp.kept_rows, &rp.pairs_before, &rp.tokens_per_expert})
    params.insert(params.end(), v->begin(), v->end());
  Tensor params_dev = Tensor::empty({4 * L}, DType::i64, dev);
  FLEXEP_CUDA_CHECK(cudaMemcpyAsync(params_dev.raw(), params.data(), params.size() * sizeof(std::int64_t),
                                    cudaMemcpyHostToDevice, s));

  auto h = std::make_shared<AlltoallHandle>();
  h->backend = "alltoall";
  h->owner = this;
  h->rank = me;
  h->tokens = T;
  h->topk = k;  // k, or E in the multihot form
  h->multihot = rt.multihot;
  h->hidden = H;
  h->rows = N;
  h->local_experts = L;
  h->hidden_dtype = DType::bf16;
  h->prob_dtype = DType::f32;
  h->slots = k;
  h->meta_width = M;
  h->send_count = rp.send_count;
  h->send_offset = rp.send_offset;
  h->recv_count = rp.recv_count;
  h->recv_offset = rp.recv_offset;
  h->total_send = rp.total_send;
  h->total_recv = rp.total_recv;
  h->slot_expert = slot_expert;

  // 5. Sender: one row per (destination rank, token), ordered so, with its metadata.
  h->slot_entry = Tensor::empty({T * k}, DType::i32, dev);
  h->send_pos = Tensor::empty({R * T}, DType::i32, dev);
  Tensor dest_scan = Tensor::empty({R * T}, DType::i32, dev);
  exclusive_sum(dest_flag.data<std::int32_t>(), dest_scan.data<std::int32_t>(), R * T, device, s);
  Tensor send_meta = Tensor::empty({rp.total_send * M}, DType::i64, dev);  // SlotMeta: 8 bytes
  Tensor send_rows = Tensor::empty({rp.total_send, H}, DType::bf16, dev);
  auto* send_meta_ptr = static_cast<SlotMeta*>(send_meta.raw());
  launch_pack_meta(slot_expert.data<std::int32_t>(), weights, T, k, L, R, M, dest_flag.data<std::int32_t>(),
                   dest_scan.data<std::int32_t>(), h->send_pos.data<std::int32_t>(),
                   h->slot_entry.data<std::int32_t>(), send_meta_ptr, s);
  launch_pack_rows(input.hidden.data, T, H, R, h->send_pos.data<std::int32_t>(), send_rows.raw(), s);

  // 6. Metadata first, then rows: with a separate stream the receiver places rows (step 7) while
  //    the rows are still in flight.
  Tensor recv_meta = Tensor::empty({rp.total_recv * M}, DType::i64, dev);
  Tensor recv_rows = Tensor::empty({rp.total_recv, H}, DType::bf16, dev);
  auto* recv_meta_ptr = static_cast<SlotMeta*>(recv_meta.raw());
  const Routes forward{rp.send_count, rp.send_offset, rp.recv_count, rp.recv_offset};
  {
    const cudaStream_t cs = fork(s);
    send_recv(*comm_, cs, forward, {{send_meta.raw(), recv_meta.raw(), M * sizeof(SlotMeta)}}, "dispatch:tokens");
    if (comm_stream_) FLEXEP_CUDA_CHECK(cudaEventRecord(meta_event_, cs));
    send_recv(*comm_, cs, forward, {{send_rows.raw(), recv_rows.raw(), static_cast<std::size_t>(H) * 2}},
              "dispatch:tokens");
    if (comm_stream_) FLEXEP_CUDA_CHECK(cudaEventRecord(join_event_, cs));
  }

  // 7. Receiver. Padding rows and the budget's tail stay zero (prob 0).
  DispatchResult result;
  result.tokens = Tensor::empty({N, H}, DType::bf16, dev);
  result.token_probs = Tensor::empty({N}, DType::f32, dev);
  cuda::zero_async(result.tokens, s);
  cuda::zero_async(result.token_probs, s);
  Tensor flags = Tensor::empty({L * rp.total_recv}, DType::i32, dev);
  Tensor flag_scan = Tensor::empty({L * rp.total_recv}, DType::i32, dev);
  cuda::zero_async(flags, s);
  h->out_row = Tensor::empty({rp.total_recv * M}, DType::i32, dev);
  if (comm_stream_) FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(s, meta_event_, 0));
  launch_mark_received(recv_meta_ptr, rp.total_recv, M, L, flags.data<std::int32_t>(), s);
  exclusive_sum(flags.data<std::int32_t>(), flag_scan.data<std::int32_t>(), L * rp.total_recv, device, s);
  launch_place_received(recv_meta_ptr, flag_scan.data<std::int32_t>(), rp.total_recv, M, L, words_of(params_dev), N,
                        h->out_row.data<std::int32_t>(), s);
  if (comm_stream_) FLEXEP_CUDA_CHECK(cudaStreamWaitEvent(s, join_event_, 0));
  launch_scatter_rows(recv_rows.raw(), recv_meta_ptr, h->out_row.data<std::int32_t>(), rp.total_recv, M, H,
                      result.tokens.raw(), result.token_probs.data<float>(), s);
  if (options.mode == DispatchMode::budget) {  // stays on the device in budget mode
    result.tokens_per_expert = Tensor::empty({L}, DType::i64, dev);
    FLEXEP_CUDA_CHECK(cudaMemcpyAsync(result.tokens_per_expert.raw(), words_of(params_dev) + 3 * L,
                                      static_cast<std::size_t>(L) * sizeof(std::int64_t), cudaMemcpyDeviceToDevice, s));
  } else {
    result.tokens_per_expert = Tensor::from_vector(rp.tokens_per_expert, {L});
  }
  comm_->wait(s, "dispatch:tokens");
  result.dropped = rp.dropped;
  result.handle = std::move(h);
  return result;
}

}  // namespace alltoall
}  // namespace flexep
