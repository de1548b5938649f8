// Simulated ranks (Communicator::simulate): R threads sharing GPU 0. The collectives give the values
// NCCL's would, the symmetric buffer's peer table points at every rank's own memory, each rank gets
// 1 / (2R) of the GPU's SMs, and the NCCL-based alltoall backend refuses such a communicator. The
// multi-GPU hybridep tests on simulated ranks are SimulatedRanks/HybridEpMultiGpu.* (test_hybridep.cpp).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "cpu/host_ranks.h"
#include "flexep/comm/symmetric_buffer.h"
#include "flexep/dispatch/alltoall.h"
#include "flexep/dispatch/deepep.h"
#include "flexep/dispatch/hybridep.h"
#include "gpu/dispatch_harness.h"
#include "gpu/gpu_test_util.h"
#include "gpu/multi_gpu.h"
#include "gpu/symmetric_peer_kernels.h"

namespace flexep::testing {
namespace {

TEST(SimulatedRanksComm, CollectivesGiveEveryRankTheSameValues) {
  if (!require_gpus(1)) return;
  const Simulate sim(3);
  const int R = gpu_ranks();
  std::vector<std::vector<long long>> gathered(R);
  std::vector<std::vector<float>> reduced(R);
  std::vector<int> domains_ok(R, 0);
  const auto errors = run_gpu_ranks(R, [&](GpuRank& g) {
    EXPECT_TRUE(g.comm->simulated());
    EXPECT_EQ(g.comm->rank(), g.rank);
    EXPECT_EQ(g.comm->size(), R);
    EXPECT_EQ(g.comm->device(), 0);
    domains_ok[g.rank] = g.comm->domains() == std::vector<int>(R, 0);
    gathered[g.rank] = g.comm->all_gather_i64({10 * g.rank, -g.rank}, "test gather");
    Tensor t = cuda::to_device(Tensor::from_vector<float>({float(g.rank + 1), 0.5f}, {2}), g.device, g.stream);
    g.comm->all_reduce_sum(t, "test all-reduce");
    const Tensor h = cuda::to_host(t, g.stream);
    reduced[g.rank] = {h.data<float>()[0], h.data<float>()[1]};
    g.comm->barrier("test barrier");
  });
  ASSERT_TRUE(all_ok(errors));
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(gathered[r], (std::vector<long long>{0, 0, 10, -1, 20, -2})) << "rank " << r;
    EXPECT_EQ(reduced[r], (std::vector<float>{6.f, 1.5f})) << "rank " << r;
    EXPECT_TRUE(domains_ok[r]) << "rank " << r;
  }
}

// Simulated ranks share GPU 0's memory pool: it must never make one rank's stream wait for another
// rank's kernels to reuse a block (that kernel may be waiting for this rank).
TEST(SimulatedRanksComm, TheSharedPoolNeverMakesOneRankWaitForAnother) {
  if (!require_gpus(1)) return;
  const Simulate sim(2);
  std::vector<int> allowed(2, -1);
  const auto errors = run_gpu_ranks(2, [&](GpuRank& g) {
    cudaMemPool_t pool = nullptr;
    FLEXEP_CUDA_CHECK(cudaDeviceGetMemPool(&pool, g.device));
    int allow = -1;
    FLEXEP_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &allow));
    allowed[static_cast<std::size_t>(g.rank)] = allow;
  });
  ASSERT_TRUE(all_ok(errors));
  EXPECT_EQ(allowed, (std::vector<int>{0, 0}));
}

// Every rank writes its rank into word `rank` of every peer's window and flag buffer through the
// peer table; afterwards each rank's own memory holds 0, 1, ..., R-1.
TEST(SimulatedRanksComm, SymmetricBufferPeersAreTheRanksOwnMemory) {
  if (!require_gpus(1)) return;
  const Simulate sim(2);
  const int R = gpu_ranks();
  std::vector<std::vector<int>> window(R), flags(R);
  const auto errors = run_gpu_ranks(R, [&](GpuRank& g) {
    SymmetricBuffer buf(g.comm, "test buffer");
    buf.init({1 << 20, 4096, 1});
    const SymmetricPeers& p = buf.peers();
    EXPECT_EQ(p.window[g.rank], buf.local());
    EXPECT_EQ(p.window[R], nullptr);
    for (int peer = 0; peer < R; ++peer) {
      FLEXEP_CUDA_CHECK(cudaMemcpyAsync(p.window[peer] + 4 * g.rank, &g.rank, 4, cudaMemcpyHostToDevice, g.stream));
      FLEXEP_CUDA_CHECK(cudaMemcpyAsync(p.flags[peer] + 4 * g.rank, &g.rank, 4, cudaMemcpyHostToDevice, g.stream));
    }
    FLEXEP_CUDA_CHECK(cudaStreamSynchronize(g.stream));
    g.comm->barrier("written");
    window[g.rank].resize(R);
    flags[g.rank].resize(R);
    FLEXEP_CUDA_CHECK(cudaMemcpy(window[g.rank].data(), buf.local(), 4 * R, cudaMemcpyDeviceToHost));
    FLEXEP_CUDA_CHECK(cudaMemcpy(flags[g.rank].data(), p.flags[g.rank], 4 * R, cudaMemcpyDeviceToHost));
    g.comm->barrier("read");
    buf.free();
  });
  ASSERT_TRUE(all_ok(errors));
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(window[r], (std::vector<int>{0, 1})) << "rank " << r;
    EXPECT_EQ(flags[r], (std::vector<int>{0, 1})) << "rank " << r;
  }
}

// More ranks than SymmetricBuffer's by-value table holds (and than a warp has lanes): that table is
// refused by name, and every rank reaches every peer through the device table deepep's kernels
// read. Each rank's kernel stores without waiting, so 40 ranks may share fewer hardware queues.
TEST(SimulatedRanksComm, SymmetricPeerTableReachesFortyRanks) {
  if (!require_gpus(1)) return;
  const Simulate sim(40);
  const int R = gpu_ranks();
  std::vector<std::vector<int>> window(R), flags(R);
  std::vector<std::exception_ptr> by_value(R);
  std::vector<int> own_entries(R, 0);
  const auto errors = run_gpu_ranks(R, [&](GpuRank& g) {
    SymmetricBuffer buf(g.comm, "test buffer");
    buf.init({1 << 16, 4096, 1});
    try {
      buf.peers();
    } catch (...) {
      by_value[g.rank] = std::current_exception();
    }
    own_entries[g.rank] = buf.peer_window(g.rank) == buf.local();
    launch_write_through_peer_table(buf.peer_table(), R, g.rank, g.stream);
    FLEXEP_CUDA_CHECK(cudaStreamSynchronize(g.stream));
    g.comm->barrier("written");
    window[g.rank].resize(R);
    flags[g.rank].resize(R);
    FLEXEP_CUDA_CHECK(cudaMemcpy(window[g.rank].data(), buf.local(), 4 * R, cudaMemcpyDeviceToHost));
    FLEXEP_CUDA_CHECK(cudaMemcpy(flags[g.rank].data(), buf.peer_flags(g.rank), 4 * R, cudaMemcpyDeviceToHost));
    g.comm->barrier("read");
    buf.free();
  });
  ASSERT_TRUE(all_ok(errors));
  std::vector<int> every_rank(R);
  std::iota(every_rank.begin(), every_rank.end(), 0);
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(window[r], every_rank) << "rank " << r;
    EXPECT_EQ(flags[r], every_rank) << "rank " << r;
    EXPECT_TRUE(own_entries[r]) << "rank " << r;
  }
  EXPECT_TRUE(all_threw<Error>(by_value, [](const Error& e) { return contains(e.what(), "the group has 40"); }));
}

// The hardware queues this process's GPU context got (the driver's rule: 8 unless
// CUDA_DEVICE_MAX_CONNECTIONS says otherwise, 32 at most).
int hardware_queues() {
  const char* text = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  return text != nullptr && *text != '\0' ? std::min(32, std::atoi(text)) : 8;
}

// deepep's kernels wait for their peers': one more simulated rank than the GPU has hardware
// queues is refused by name on every rank, before any kernel could hang on a shared queue.
TEST(SimulatedRanksComm, WaitingBackendsNeedAHardwareQueuePerRank) {
  if (!require_gpus(1)) return;
  const int queues = hardware_queues();
  const Simulate sim(queues + 1);
  const int R = gpu_ranks();
  std::vector<std::exception_ptr> refused(R);
  const auto errors = run_gpu_ranks(R, [&](GpuRank& g) {
    DeepEpOptions o;
    o.hidden = 64;
    o.max_tokens_per_rank = 4;
    o.stream = g.stream;
    try {
      make_deepep_dispatcher(g.comm, R, o);
    } catch (...) {
      refused[g.rank] = std::current_exception();
    }
  });
  ASSERT_TRUE(all_ok(errors));
  const std::string expected = std::to_string(R) + " simulated ranks share GPU 0 but it has " +
                               std::to_string(queues) + " hardware queues";
  EXPECT_TRUE(all_threw<ArgumentError>(refused, [&](const ArgumentError& e) {
    return e.argument() == "comm" && contains(e.what(), "deepep") && contains(e.what(), expected);
  })) << expected;
}

TEST(SimulatedRanksComm, SmShareAndNcclBackendsAreRefusedByName) {
  if (!require_gpus(1)) return;
  const Simulate sim(2);
  const int R = gpu_ranks(), share = cuda::sm_count(0) / (2 * R);
  std::vector<std::exception_ptr> alltoall(R), too_many(R);
  const auto errors = run_gpu_ranks(R, [&](GpuRank& g) {
    EXPECT_EQ(g.comm->sms_per_rank(), share);
    try {
      make_alltoall_dispatcher(g.comm, 2 * R);
    } catch (...) {
      alltoall[g.rank] = std::current_exception();
    }
    HybridEpOptions o;
    o.max_tokens_per_rank = 16;
    o.hidden = 8;
    o.stream = g.stream;
    auto d = make_hybridep_dispatcher(g.comm, 2 * R, o);
    d->set_num_sms(share, share, share);  // the share itself is allowed
    try {
      d->set_num_sms(share + 1);
    } catch (...) {
      too_many[g.rank] = std::current_exception();
    }
  });
  ASSERT_TRUE(all_ok(errors));
  EXPECT_TRUE(all_threw<ArgumentError>(alltoall, [](const ArgumentError& e) {
    return e.argument() == "comm" && contains(e.what(), "simulates its ranks");
  }));
  EXPECT_TRUE(all_threw<ArgumentError>(too_many, [&](const ArgumentError& e) {
    return e.argument() == "num_sms" && contains(e.what(), "[0, " + std::to_string(share) + "]") &&
           contains(e.what(), "2 simulated ranks share it");
  }));
}

}  // namespace
}  // namespace flexep::testing
