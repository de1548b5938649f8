// Pieces shared by the CPU and the GPU training loops of `flexep train`.
#pragma once

#include <exception>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "flexep/core/error.h"
#include "flexep/layer/moe_layer.h"
#include "train.h"

namespace flexep::tools {

struct Batch {
  Tensor x;        // [T_r, dim] f32 (on the CPU)
  Tensor padding;  // [T_r] bool
  std::int64_t global_valid = 0;
};

// Rows [begin, end) of the global batch owned by `rank`.
std::pair<std::int64_t, std::int64_t> rank_rows(std::int64_t tokens, int ranks, int rank);
// Step `step`'s slice of rank `rank`: the same numbers for any rank count.
Batch make_batch(const TrainOptions& o, int step, int rank, int ranks);
// The fixed teacher: narrower experts (docs/training.md) and the student's initial router.
std::unique_ptr<MoELayer> make_teacher(const TrainOptions& o);
// Sum of squared errors over the unpadded tokens and its gradient 2 (out - target) / (valid * dim).
std::pair<double, Tensor> squared_error(const Tensor& out, const Tensor& target, const Batch& batch, std::int64_t dim);

// The per-step losses into the report, and check 1: the mean of the last few steps under a quarter
// of the first few's (single batches are noisy).
void record_losses(TrainReport& report, const std::vector<double>& losses);
// Runs fn(rank) on one thread per rank; rethrows the most informative failure.
template <class Fn>
void run_ranks(int ranks, Fn fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  std::exception_ptr timeout;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const TimeoutError&) {
      if (!timeout) timeout = e;
    } catch (...) {
      std::rethrow_exception(e);  // a real error beats the timeouts it caused on the other ranks
    }
  }
  if (timeout) std::rethrow_exception(timeout);
}

}  // namespace flexep::tools
