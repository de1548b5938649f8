#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "cpu/host_ranks.h"
#include "flexep/comm/host_world.h"

using namespace flexep;
using flexep::testing::all_ok;
using flexep::testing::all_threw;
using flexep::testing::run_ranks;

namespace {
void random_sleep(std::mt19937& rng) {
  std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 200)(rng)));
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
}  // namespace

TEST(HostWorld, BarrierOrderingUnderStress) {
  // No rank may leave round i before every rank has finished round i's work.
  for (int R : {1, 2, 3, 5, 8}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    auto world = std::make_shared<HostWorld>(R, 10.0);
    constexpr int kRounds = 200;
    std::atomic<int> done{0};
    std::atomic<int> violations{0};
    auto errors = run_ranks(R, [&](int rank) {
      std::mt19937 rng(1234u + static_cast<unsigned>(rank));
      for (int i = 0; i < kRounds; ++i) {
        random_sleep(rng);
        done.fetch_add(1);
        world->barrier(rank, "stress");
        if (done.load() < R * (i + 1)) violations.fetch_add(1);
        world->barrier(rank, "stress:after");  // keeps round i+1 increments out of round i's check
      }
    });
    ASSERT_TRUE(all_ok(errors));
    EXPECT_EQ(violations.load(), 0);
    EXPECT_EQ(done.load(), R * kRounds);
    EXPECT_FALSE(world->broken());
  }
}

TEST(HostWorld, AllGatherPtrAcrossConsecutiveExchanges) {
  // Back-to-back exchanges with no barrier in between: a fast rank publishes round i+1 while a
  // slow one still reads round i. Each rank must always get exactly round i's pointers.
  for (int R : {1, 2, 4, 7}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    auto world = std::make_shared<HostWorld>(R, 10.0);
    constexpr int kRounds = 300;
    std::vector<std::vector<int>> values(static_cast<std::size_t>(R), std::vector<int>(kRounds));
    std::vector<int> wrong(static_cast<std::size_t>(R), 0);
    auto errors = run_ranks(R, [&](int rank) {
      std::mt19937 rng(99u + static_cast<unsigned>(rank));
      for (int i = 0; i < kRounds; ++i) {
        int& mine = values[static_cast<std::size_t>(rank)][static_cast<std::size_t>(i)];
        mine = rank * 100000 + i;
        if (i % 3 == rank % 3) random_sleep(rng);
        auto got = world->all_gather_ptr(rank, &mine, "gather");
        for (int r = 0; r < R; ++r) {
          const int* p = static_cast<const int*>(got[static_cast<std::size_t>(r)]);
          if (p != &values[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)] || *p != r * 100000 + i)
            ++wrong[static_cast<std::size_t>(rank)];
        }
      }
    });
    ASSERT_TRUE(all_ok(errors));
    for (int r = 0; r < R; ++r) EXPECT_EQ(wrong[static_cast<std::size_t>(r)], 0) << "rank " << r;
  }
}

TEST(HostWorld, AllReduceSumIsAscendingRankOrderInF32) {
  // f32 addition is not associative: (1e8 + 1) - 1e8 + 1 = 1 in ascending rank order, while
  // other orders give 0 or 2. All ranks must get the ascending-order bits.
  const std::vector<std::vector<float>> in = {
      {1e8f, 3.0f, 0.1f}, {1.0f, -3.0f, 0.2f}, {-1e8f, 1e-8f, 0.3f}, {1.0f, 7.0f, 0.4f}};
  const int R = 4;
  std::vector<float> expect(3);
  for (std::size_t i = 0; i < 3; ++i) {
    float acc = in[0][i];
    for (int r = 1; r < R; ++r) acc += in[static_cast<std::size_t>(r)][i];
    expect[i] = acc;
  }
  ASSERT_EQ(expect[0], 1.0f);  // the case is order-sensitive as intended
  auto world = std::make_shared<HostWorld>(R, 10.0);
  std::vector<Tensor> t(R);
  auto errors = run_ranks(R, [&](int rank) {
    HostProcessGroup pg(world, rank);
    t[static_cast<std::size_t>(rank)] = Tensor::from_vector(in[static_cast<std::size_t>(rank)], {3});
    pg.all_reduce_sum(t[static_cast<std::size_t>(rank)], "test-sum");
  });
  ASSERT_TRUE(all_ok(errors));
  for (int r = 0; r < R; ++r)
    EXPECT_EQ(0, std::memcmp(t[static_cast<std::size_t>(r)].raw(), expect.data(), 3 * sizeof(float))) << "rank " << r;
}

TEST(HostWorld, AllReduceSumF64AndI64AndRepeatedCalls) {
  for (int R : {1, 2, 3, 8}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    auto world = std::make_shared<HostWorld>(R, 10.0);
    std::vector<double> got_f(static_cast<std::size_t>(R) * 5);
    std::vector<std::int64_t> got_i(static_cast<std::size_t>(R) * 4);
    auto errors = run_ranks(R, [&](int rank) {
      HostProcessGroup pg(world, rank);
      EXPECT_EQ(pg.rank(), rank);
      EXPECT_EQ(pg.size(), R);
      for (int round = 0; round < 5; ++round) {
        Tensor f = Tensor::from_vector(std::vector<double>{0.5 * rank + round, -1.0 * rank}, {2});
        pg.all_reduce_sum(f, "f64");
        got_f[static_cast<std::size_t>(rank * 5 + round)] = f.data<double>()[0];
      }
      Tensor i = Tensor::from_vector(std::vector<std::int64_t>{rank, 1, 1LL << 40, -rank}, {2, 2});
      pg.all_reduce_sum(i, "i64");
      for (int j = 0; j < 4; ++j) got_i[static_cast<std::size_t>(rank * 4 + j)] = i.data<std::int64_t>()[j];
    });
    ASSERT_TRUE(all_ok(errors));
    for (int rank = 0; rank < R; ++rank) {
      for (int round = 0; round < 5; ++round) {
        double expect = 0.0;
        for (int r = 0; r < R; ++r) expect += 0.5 * r + round;
        EXPECT_EQ(got_f[static_cast<std::size_t>(rank * 5 + round)], expect);
      }
      const std::int64_t tri = static_cast<std::int64_t>(R) * (R - 1) / 2;
      EXPECT_EQ(got_i[static_cast<std::size_t>(rank * 4 + 0)], tri);
      EXPECT_EQ(got_i[static_cast<std::size_t>(rank * 4 + 1)], R);
      EXPECT_EQ(got_i[static_cast<std::size_t>(rank * 4 + 2)], static_cast<std::int64_t>(R) << 40);
      EXPECT_EQ(got_i[static_cast<std::size_t>(rank * 4 + 3)], -tri);
    }
  }
}

TEST(HostWorld, AllReduceSumRejectsMismatchOnEveryRank) {
  const int R = 3;
  auto world = std::make_shared<HostWorld>(R, 10.0);
  auto errors = run_ranks(R, [&](int rank) {
    HostProcessGroup pg(world, rank);
    Tensor t = Tensor::zeros({rank == 2 ? 4 : 3}, DType::f32);
    pg.all_reduce_sum(t, "expert-load");
  });
  EXPECT_TRUE(all_threw<ArgumentError>(errors, [](const ArgumentError& e) {
    return e.argument() == "expert-load" && contains(e.what(), "rank 2") && contains(e.what(), "[4]") &&
           contains(e.what(), "[3]");
  }));
  // The failure was consistent, so the world stays usable.
  EXPECT_FALSE(world->broken());
  auto dtype_errors = run_ranks(R, [&](int rank) {
    HostProcessGroup pg(world, rank);
    Tensor t = Tensor::zeros({3}, rank == 1 ? DType::bf16 : DType::f32);
    pg.all_reduce_sum(t, "grads");
  });
  EXPECT_TRUE(all_threw<ArgumentError>(dtype_errors, [](const ArgumentError& e) {
    return e.argument() == "grads" && contains(e.what(), "rank 1") && contains(e.what(), "bf16");
  }));
}

TEST(HostWorld, TimeoutNamesPhaseAndMissingRank) {
  const int R = 4;
  auto world = std::make_shared<HostWorld>(R, 0.2);
  const auto start = std::chrono::steady_clock::now();
  auto errors = run_ranks(R, [&](int rank) {
    if (rank == 2) return;  // never arrives
    world->barrier(rank, "dispatch:count-exchange");
  });
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(elapsed, 5.0);
  EXPECT_GE(elapsed, 0.19);
  EXPECT_EQ(errors[2], nullptr);
  for (int r : {0, 1, 3}) {
    try {
      std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
    } catch (const TimeoutError& e) {
      EXPECT_EQ(e.phase(), "dispatch:count-exchange") << "rank " << r;
      EXPECT_EQ(e.peer(), 2) << "rank " << r;
      EXPECT_TRUE(contains(e.what(), "ranks present: 0, 1, 3")) << e.what();
      EXPECT_TRUE(contains(e.what(), "0.2 s")) << e.what();
    } catch (...) {
      ADD_FAILURE() << "rank " << r << ": " << flexep::testing::what_of(errors[static_cast<std::size_t>(r)]);
    }
  }
  EXPECT_TRUE(world->broken());
}

TEST(HostWorld, BrokenWorldFailsFastAfterwards) {
  const int R = 2;
  auto world = std::make_shared<HostWorld>(R, 0.2);
  EXPECT_THROW(world->barrier(0, "first"), TimeoutError);  // rank 1 never comes
  ASSERT_TRUE(world->broken());
  // Later calls fail at once (well below the timeout) and quote the original reason.
  for (int rank : {0, 1}) {
    const auto start = std::chrono::steady_clock::now();
    try {
      world->all_gather_ptr(rank, nullptr, "second");
      ADD_FAILURE() << "a broken world must not complete an exchange";
    } catch (const TimeoutError&) {
      ADD_FAILURE() << "a later call is not itself a timeout";
    } catch (const Error& e) {
      EXPECT_TRUE(contains(e.what(), "broken")) << e.what();
      EXPECT_TRUE(contains(e.what(), "rank 1 did not arrive at 'first'")) << e.what();
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 0.1);
  }
  HostProcessGroup pg(world, 1);
  Tensor t = Tensor::zeros({2}, DType::f32);
  EXPECT_THROW(pg.all_reduce_sum(t, "late"), Error);
}

TEST(HostWorld, DifferentPhasesFailEveryRank) {
  // Rank 1 is one collective ahead: pairing its call with the others' would mix up their data.
  const int R = 3;
  auto world = std::make_shared<HostWorld>(R, 5.0);
  auto errors = run_ranks(R, [&](int rank) { world->barrier(rank, rank == 1 ? "combine:exchange" : "dispatch:done"); });
  EXPECT_TRUE(all_threw<Error>(errors, [](const Error& e) {
    return contains(e.what(), "combine:exchange") && contains(e.what(), "dispatch:done");
  }));
  EXPECT_TRUE(world->broken());
}

TEST(HostWorld, RejectsBadArguments) {
  EXPECT_THROW(HostWorld(0), ArgumentError);
  EXPECT_THROW(HostWorld(2, 0.0), ArgumentError);
  auto world = std::make_shared<HostWorld>(2, 1.0);
  try {
    world->barrier(2, "x");
    ADD_FAILURE() << "rank 2 of 2 accepted";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "rank");
  }
  EXPECT_THROW(HostProcessGroup(world, -1), ArgumentError);
  EXPECT_THROW(HostProcessGroup(nullptr, 0), ArgumentError);
  EXPECT_FALSE(world->broken());
}

// A rank kept waiting says so long before the deadline, once per wait and from one rank only;
// waits shorter than the notice say nothing.
TEST(HostWorld, AWaitingRankSaysWhatItWaitsFor) {
  auto world = std::make_shared<HostWorld>(3, 5.0);
  std::mutex m;
  std::vector<std::string> notices;
  world->set_notice(0.2, [&](const std::string& s) {
    const std::lock_guard<std::mutex> lock(m);
    notices.push_back(s);
  });
  ASSERT_TRUE(all_ok(run_ranks(3, [&](int rank) {
    world->barrier(rank, "quick");
    if (rank == 2) std::this_thread::sleep_for(std::chrono::milliseconds(700));
    world->barrier(rank, "slow");
  })));
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0], "flexep: rank 0 has waited 0.2 s in 'slow' for rank(s) 2 (deadline 5 s)");
  EXPECT_THROW(world->set_notice(0), ArgumentError);
}
