// Fault injection on the host backend: a rank that stops before one phase of a dispatch sequence
// (the dispatch's count exchange, combine, dispatch_backward, combine_backward), in either layout,
// makes every other rank raise a TimeoutError naming that phase and the missing rank within the
// deadline; the world then stays broken, so every later call fails at once instead of hanging.
#include <gtest/gtest.h>

#include <chrono>

#include "cpu/host_dispatch_reference.h"

using namespace flexep;
using namespace flexep::testing;

namespace {

enum class Step { dispatch, combine, dispatch_backward, combine_backward };

const char* phase_of(Step s) {
  switch (s) {
    case Step::dispatch: return "dispatch:count-exchange";
    case Step::combine: return "combine:exchange";
    case Step::dispatch_backward: return "dispatch_backward:exchange";
    case Step::combine_backward: return "combine_backward:exchange";
  }
  return "";
}

// The sequence dispatch, combine, dispatch_backward, combine_backward; `stop` stops before `at`.
void run_until(TokenDispatcher& d, const RankInput& in, const DispatchOptions& o, Step at, bool stop) {
  if (stop && at == Step::dispatch) return;
  const DispatchResult res = d.dispatch(in.topk(), o);
  if (stop && at == Step::combine) return;
  d.combine(res.handle, res.tokens);
  if (stop && at == Step::dispatch_backward) return;
  const bool rank_major = o.layout == DispatchLayout::rank_major;
  const Tensor gp = rank_major ? Tensor::zeros({res.tokens.size(0), in.indices.size(1)}, DType::f32)
                               : Tensor::zeros({res.tokens.size(0)}, DType::f32);
  d.dispatch_backward(res.handle, res.tokens, gp);
  if (stop && at == Step::combine_backward) return;
  d.combine_backward(res.handle, in.hidden);
}

// Three ranks, one of them without tokens, two experts each, top-2.
Spec three_ranks() {
  Spec s;
  s.ranks = 3;
  s.experts = 6;
  s.topk = 2;
  s.hidden = 16;
  s.tokens = {5, 0, 7};
  return s;
}

}  // namespace

TEST(HostFaults, AStoppedRankTimesOutEveryOtherRankNamingPhaseAndPeer) {
  for (DispatchLayout layout : {DispatchLayout::expert_major, DispatchLayout::rank_major})
    for (Step at : {Step::dispatch, Step::combine, Step::dispatch_backward, Step::combine_backward}) {
      const int R = 3, missing = 2;
      SCOPED_TRACE(std::string(phase_of(at)) + (layout == DispatchLayout::rank_major ? ", rank-major" : ""));
      const Spec s = three_ranks();
      const auto in = make_inputs(s);
      DispatchOptions o;
      o.layout = layout;
      Group g(R, s.experts, 0.3);
      const auto start = std::chrono::steady_clock::now();
      auto errors = g.run([&](int r, TokenDispatcher& d) {
        run_until(d, in[static_cast<std::size_t>(r)], o, at, r == missing);
      });
      EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
      EXPECT_EQ(errors[missing], nullptr);
      for (int r = 0; r < R; ++r) {
        if (r == missing) continue;
        try {
          std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
        } catch (const TimeoutError& e) {
          EXPECT_EQ(e.phase(), phase_of(at)) << e.what();
          EXPECT_EQ(e.peer(), missing) << e.what();
        } catch (...) {
          ADD_FAILURE() << "rank " << r << ": " << what_of(errors[static_cast<std::size_t>(r)]);
        }
      }
      // Broken: the next call fails at once on every rank, the stopped one included.
      errors = g.run([&](int r, TokenDispatcher& d) { d.dispatch(in[static_cast<std::size_t>(r)].topk(), o); });
      EXPECT_TRUE(all_threw<Error>(errors, [](const Error& e) {
        return std::string(e.what()).find("broken") != std::string::npos;
      }));
    }
}

// Every collective of a dispatch sequence, including those in the middle of a call (the rows'
// exchange after the counts', the barriers that end each call): a rank that dies there (its
// thread stops, as a crashed process would) or stalls past the deadline makes every other rank
// raise a TimeoutError naming that collective and that rank; the stalled rank, arriving late, gets
// the broken world's error instead of waiting. Nothing leaks (the sanitizer build checks).
TEST(HostFaults, ARankThatDiesOrStallsInAnyCollectiveTimesOutTheOthers) {
  const char* phases[] = {"dispatch:count-exchange",    "dispatch:row-exchange",    "dispatch:done",
                          "combine:exchange",           "combine:done",             "dispatch_backward:exchange",
                          "dispatch_backward:done",     "combine_backward:exchange", "combine_backward:done"};
  const double deadline = 0.3;
  {  // the list is every collective the sequence makes, in order
    const Spec s = three_ranks();
    Group g(s.ranks, s.experts, deadline);
    const auto in = make_inputs(s);
    g.world->trace(true);
    const auto errors = g.run([&](int r, TokenDispatcher& d) {
      run_until(d, in[static_cast<std::size_t>(r)], DispatchOptions(), Step::combine_backward, false);
    });
    ASSERT_TRUE(all_ok(errors));
    EXPECT_EQ(g.world->traced(1), std::vector<std::string>(std::begin(phases), std::end(phases)));
  }
  for (DispatchLayout layout : {DispatchLayout::expert_major, DispatchLayout::rank_major})
    for (const char* phase : phases)
      for (const bool dies : {true, false}) {
        const int R = 3, faulty = 1;
        SCOPED_TRACE(std::string(phase) + (dies ? ", dies" : ", stalls") +
                     (layout == DispatchLayout::rank_major ? ", rank-major" : ""));
        const Spec s = three_ranks();
        const auto in = make_inputs(s);
        DispatchOptions o;
        o.layout = layout;
        Group g(R, s.experts, deadline);
        g.world->inject({faulty, phase, dies ? -1.0 : 2 * deadline});
        const auto start = std::chrono::steady_clock::now();
        const auto errors = g.run([&](int r, TokenDispatcher& d) {
          run_until(d, in[static_cast<std::size_t>(r)], o, Step::combine_backward, false);
        });
        EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
        for (int r = 0; r < R; ++r) {
          try {
            std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
          } catch (const TimeoutError& e) {
            EXPECT_NE(r, faulty) << e.what();
            EXPECT_EQ(e.phase(), phase) << e.what();
            EXPECT_EQ(e.peer(), faulty) << e.what();
          } catch (const InjectedFault& e) {
            EXPECT_TRUE(r == faulty && dies) << "rank " << r << ": " << e.what();
          } catch (const Error& e) {
            // The stalled rank arrives after the deadline broke the world.
            EXPECT_TRUE(r == faulty && !dies) << "rank " << r << ": " << e.what();
            EXPECT_NE(std::string(e.what()).find("broken"), std::string::npos) << e.what();
          } catch (...) {
            ADD_FAILURE() << "rank " << r << ": " << what_of(errors[static_cast<std::size_t>(r)]);
          }
        }
      }
}

// A rank that passes an exchange and then reads slowly (longer than the deadline): the others time
// out at the barrier that ends the call, naming it, but wait until it has stopped reading before
// they unwind and free the rows it reads (the sanitizer build would see a read of freed memory).
TEST(HostFaults, ASlowReaderKeepsItsPeersRowsAliveUntilItStops) {
  const char* exchanges[] = {"dispatch:row-exchange", "combine:exchange", "dispatch_backward:exchange",
                             "combine_backward:exchange"};
  const double deadline = 0.5, stall = 0.8;  // the slow rank gets one more deadline to finish reading
  for (DispatchLayout layout : {DispatchLayout::expert_major, DispatchLayout::rank_major})
    for (const char* exchange : exchanges) {
      const int R = 3, slow = 1;
      const std::string phase(exchange), done = phase.substr(0, phase.find(':')) + ":done";
      SCOPED_TRACE(phase + (layout == DispatchLayout::rank_major ? ", rank-major" : ""));
      const Spec s = three_ranks();
      const auto in = make_inputs(s);
      DispatchOptions o;
      o.layout = layout;
      Group g(R, s.experts, deadline);
      HostWorld::Fault fault{slow, phase, stall};
      fault.after = true;
      g.world->inject(fault);
      const auto start = std::chrono::steady_clock::now();
      std::vector<double> left(R, 0.0);  // when each rank's call sequence unwound
      const auto errors = g.run([&](int r, TokenDispatcher& d) {
        try {
          run_until(d, in[static_cast<std::size_t>(r)], o, Step::combine_backward, false);
        } catch (...) {
          left[static_cast<std::size_t>(r)] =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          throw;
        }
      });
      for (int r = 0; r < R; ++r) {
        try {
          std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
        } catch (const TimeoutError& e) {
          EXPECT_NE(r, slow) << e.what();
          EXPECT_EQ(e.phase(), done) << e.what();
          EXPECT_EQ(e.peer(), slow) << e.what();
          EXPECT_GE(left[static_cast<std::size_t>(r)], stall) << "rank " << r << " unwound while rank " << slow
                                                               << " still read its rows";
          EXPECT_LT(left[static_cast<std::size_t>(r)], 2 * deadline + 1.0);
        } catch (const Error& e) {
          EXPECT_EQ(r, slow) << e.what();
          EXPECT_NE(std::string(e.what()).find("broken"), std::string::npos) << e.what();
        } catch (...) {
          ADD_FAILURE() << "rank " << r << ": " << what_of(errors[static_cast<std::size_t>(r)]);
        }
      }
    }
}
