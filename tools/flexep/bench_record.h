// Benchmark results in the JSON form of docs/benchmarks.md ("The JSON files"): one file per run in bench/results/, with the run's
// device, date and commit, and one record per (case, routing, backend, phase, timing, sms).
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace flexep::tools {

struct TimeStats {
  double min = 0, median = 0, max = 0;  // microseconds
};

struct BenchRecord {
  std::string case_name, routing = "uniform", backend, phase, timing = "call";
  std::optional<int> sms;
  long long tokens_per_rank = 0;
  int hidden = 0, topk = 0, experts = 0;
  std::string dtype = "bf16";
  TimeStats time_us;
  std::optional<double> algo_gbps, nvlink_gbps, tflops, hbm_gbps;
  // Layer cases: device memory a forward's result keeps for backward, beyond its output y (MB = 1e6 B).
  std::optional<double> saved_mb;
  // Layer cases: the host's time to enqueue one step with nothing in flight before it. Near the step's
  // GPU time, it means the step is bound by the host (or waits for the GPU inside).
  std::optional<double> host_us;
  std::string pass;                           // "forward", "backward" or empty
  std::vector<std::pair<std::string, double>> parts_us;  // per-part median split of a layer time
  std::string note;  // free text: what exactly was timed
  // Calls only: "" (the call starts on an idle stream right after a host barrier) or "aligned" (on a
  // busy stream, the ranks lined up on the GPU first: bench_dispatch_cuda.cpp).
  std::string start;
};

struct BenchRun {
  std::string run_id, date, commit, device;
  int gpus = 0;  // GPUs the run used (its cases' ranks), not the GPUs of the machine
  std::vector<BenchRecord> records;
};

// Fills run_id/date/commit (commit: FLEXEP_COMMIT env, else the build's git hash, else "unknown").
BenchRun new_bench_run(const std::string& device, int gpus);
std::string to_json(const BenchRun& run);
// Writes <dir>/<run_id>.json and returns the path.
std::string write_bench_run(const BenchRun& run, const std::string& dir);
// A fixed-width table of the records for the terminal.
std::string format_table(const std::vector<BenchRecord>& records);

TimeStats stats_of(std::vector<double> samples_us);

}  // namespace flexep::tools
