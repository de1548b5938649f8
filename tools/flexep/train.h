// `flexep train`: trains one MoE layer on a synthetic regression task (a fixed random teacher MoE
// of the same shape generates the targets) over R expert-parallel ranks, and checks two things:
//   1. the loss falls to under a quarter of its start;
//   2. one step on R ranks gives the same gradients as the same step on 1 rank (fp32 rounding).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flexep/core/config.h"

namespace flexep::tools {

struct TrainOptions {
  MoEConfig moe;
  BackendConfig backend;
  int ranks = 4;
  int steps = 800;
  int tokens = 256;  // global tokens per step, split across ranks (ragged when not divisible)
  std::uint64_t seed = 7;
  double lr = 3e-3;
  double teacher_std = 0.1;  // init std of the teacher's weights (the student starts at 0.02)
  double padding_fraction = 0.0;  // fraction of tokens marked as padding
  std::string device = "cpu";
  bool quiet = false;
};

struct TrainReport {
  std::vector<double> losses;  // mean squared error per step
  double first_loss = 0, last_loss = 0;
  double max_grad_rel_diff = 0;  // R ranks vs 1 rank, worst parameter
  std::string worst_parameter;
  bool loss_check = false, rank_check = false;
  std::string rank_check_label;   // what check 2 compared
  double rank_check_limit = 1e-5;
};

// Defaults of the main job (the "embedded default"), also written to configs/default.json.
TrainOptions default_train_options();
// Parses the "train" section of a config file (JSON text) onto `o`.
void apply_train_json(TrainOptions& o, const std::string& json_text);
std::string train_json(const TrainOptions& o);  // the "train" section
// Every field and combination checked before any work: an ArgumentError naming the first bad one.
void validate_train_options(const TrainOptions& o);

TrainReport run_training(const TrainOptions& options);
// The same job with the student on GPUs (one per rank; train_cuda.cpp, CUDA builds only).
TrainReport run_training_cuda(const TrainOptions& options);

}  // namespace flexep::tools
