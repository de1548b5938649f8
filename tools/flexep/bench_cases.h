// The benchmark cases of `flexep bench`. Each case registers itself (BENCH_CASE below) and appends
// records to the run; GPU cases live in *_cuda.cpp files that are built only with CUDA.
#pragma once

#include <string>
#include <vector>

#include "bench_record.h"

namespace flexep::tools {

struct BenchArgs {
  std::string backend = "all";   // a backend name, or "all" (every backend the case knows)
  std::string routing = "uniform";
  double zipf_s = 1.2;
  long long tokens = 0;          // 0 = the case's default
  int hidden = 0, topk = 0, experts = 0;
  std::vector<int> sms;          // SM counts to sweep where a backend has them
  int hybridep_part_tokens = 0;  // HybridEpOptions::part_tokens (0 = chosen per call)
  int warmup = 5, reps = 20;
  bool quiet = false;
};

using BenchFn = void (*)(const BenchArgs&, BenchRun&);

struct BenchCase {
  std::string name, help;
  BenchFn fn;
  int gpus;  // GPUs the case needs
};

std::vector<BenchCase>& bench_cases();

struct BenchRegistrar {
  BenchRegistrar(std::string name, std::string help, BenchFn fn, int gpus) {
    bench_cases().push_back({std::move(name), std::move(help), fn, gpus});
  }
};

}  // namespace flexep::tools

#define FLEXEP_BENCH_CASE(ident, name, help, gpus, fn) \
  static ::flexep::tools::BenchRegistrar flexep_bench_registrar_##ident(name, help, fn, gpus)
