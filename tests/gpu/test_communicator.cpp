// The NCCL communicator: borrowing an existing ncclComm_t (the way PyTorch hands us its own), the
// topology it discovers, the unique-id text form, and the version check. One thread per GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "flexep/comm/communicator.h"
#include "flexep/cuda/runtime.h"
#include "gpu_test_util.h"

namespace flexep {
namespace {

TEST(Communicator, UniqueIdHexRoundTripAndVersion) {
  if (!testing::require_gpus(1)) return;
  EXPECT_NO_THROW(check_nccl_version());  // this binary runs with the NCCL it was built against
  const ncclUniqueId id = Communicator::new_unique_id();
  const ncclUniqueId back = unique_id_from_hex(unique_id_to_hex(id));
  EXPECT_EQ(0, std::memcmp(&id, &back, sizeof id));
  try {
    unique_id_from_hex("xyz");
    FAIL() << "expected ArgumentError";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "FLEXEP_NCCL_ID");
  }
}

// A communicator made outside flexep, borrowed: rank, size, topology and an all-reduce work, and
// destroying the borrowed wrapper leaves the original usable (it is not ours to destroy).
TEST(CommunicatorMultiGpu, BorrowedCommunicatorWorksAndIsNotDestroyed) {
  if (!testing::require_gpus(2)) return;
  const int R = 2;
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::vector<std::thread> threads;
  std::vector<std::string> failures(R);
  for (int r = 0; r < R; ++r)
    threads.emplace_back([&, r] {
      try {
        cuda::DeviceGuard guard(r);
        ncclComm_t raw = nullptr;
        FLEXEP_NCCL_CHECK(ncclCommInitRank(&raw, R, id, r));
        {
          auto comm = Communicator::borrow(raw, r);
          if (comm->rank() != r || comm->size() != R) failures[r] = "rank/size";
          if (comm->local_rank() != r) failures[r] = "local rank";
          if (comm->domains() != std::vector<int>(R, 0)) failures[r] = "one host is one NVLink domain";
          Tensor t = cuda::to_device(Tensor::from_vector<float>({float(r + 1), 10.f}, {2}), r, nullptr);
          comm->all_reduce_sum(t, "test all-reduce");
          Tensor h = cuda::to_host(t, nullptr);
          if (h.data<float>()[0] != 3.f || h.data<float>()[1] != 20.f) failures[r] = "all-reduce values";
        }
        // Still usable after the wrapper is gone.
        Tensor one = cuda::to_device(Tensor::from_vector<float>({1.f}, {1}), r, nullptr);
        FLEXEP_NCCL_CHECK(ncclAllReduce(one.raw(), one.raw(), 1, ncclFloat32, ncclSum, raw, nullptr));
        FLEXEP_CUDA_CHECK(cudaStreamSynchronize(nullptr));
        if (cuda::to_host(one, nullptr).data<float>()[0] != 2.f) failures[r] = "raw comm after borrow";
        ncclCommDestroy(raw);
      } catch (const std::exception& e) {
        failures[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < R; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// ranks_per_domain splits one host into NVLink domains (how tests emulate several domains).
TEST(CommunicatorMultiGpu, RanksPerDomainSplitsTheHost) {
  if (!testing::require_gpus(2)) return;
  const ncclUniqueId id = Communicator::new_unique_id();
  std::vector<std::vector<int>> domains(2);
  std::vector<std::string> failures(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        CommunicatorOptions o;
        o.ranks_per_domain = 1;
        auto comm = Communicator::create(id, r, 2, r, o);
        domains[r] = comm->domains();
      } catch (const std::exception& e) {
        failures[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(failures[r], "");
    EXPECT_EQ(domains[r], (std::vector<int>{0, 1}));
  }
}

}  // namespace
}  // namespace flexep
