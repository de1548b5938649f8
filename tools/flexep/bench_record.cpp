#include "bench_record.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <unistd.h>
#include <filesystem>
#include <fstream>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "flexep/core/error.h"

#ifndef FLEXEP_GIT_COMMIT
#define FLEXEP_GIT_COMMIT "unknown"
#endif

namespace flexep::tools {

BenchRun new_bench_run(const std::string& device, int gpus) {
  BenchRun run;
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&now, &tm);
  char date[32], id[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tm);
  std::strftime(id, sizeof id, "%Y%m%d-%H%M%S", &tm);
  const char* env_commit = std::getenv("FLEXEP_COMMIT");
  run.commit = env_commit && *env_commit ? env_commit : FLEXEP_GIT_COMMIT;
  run.date = date;
  // The pid keeps two runs started within the same second apart.
  run.run_id = fmt::format("{}-{}-{}", id, run.commit.substr(0, 8), static_cast<long>(getpid()));
  run.device = device;
  run.gpus = gpus;
  return run;
}

namespace {
nlohmann::json optional_number(const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(); }
}  // namespace

std::string to_json(const BenchRun& run) {
  nlohmann::json j = {{"run_id", run.run_id}, {"date", run.date}, {"commit", run.commit},
                      {"device", run.device}, {"gpus", run.gpus}, {"records", nlohmann::json::array()}};
  for (const BenchRecord& r : run.records) {
    nlohmann::json rec = {{"case", r.case_name}, {"routing", r.routing}, {"backend", r.backend},
                          {"phase", r.phase}, {"timing", r.timing},
                          {"sms", r.sms ? nlohmann::json(*r.sms) : nlohmann::json()},
                          {"tokens_per_rank", r.tokens_per_rank}, {"hidden", r.hidden}, {"topk", r.topk},
                          {"experts", r.experts}, {"dtype", r.dtype},
                          {"time_us", {{"min", r.time_us.min}, {"median", r.time_us.median}, {"max", r.time_us.max}}},
                          {"algo_gbps", optional_number(r.algo_gbps)},
                          {"nvlink_gbps", optional_number(r.nvlink_gbps)}};
    if (r.tflops) rec["tflops"] = *r.tflops;
    if (r.hbm_gbps) rec["hbm_gbps"] = *r.hbm_gbps;
    if (r.saved_mb) rec["saved_mb"] = *r.saved_mb;
    if (r.host_us) rec["host_us"] = *r.host_us;
    if (!r.pass.empty()) rec["pass"] = r.pass;
    if (!r.parts_us.empty()) {
      nlohmann::json parts = nlohmann::json::object();
      for (const auto& [k, v] : r.parts_us) parts[k] = v;
      rec["parts_us"] = parts;
    }
    if (!r.start.empty()) rec["start"] = r.start;
    if (!r.note.empty()) rec["note"] = r.note;
    j["records"].push_back(rec);
  }
  return j.dump(1);
}

std::string write_bench_run(const BenchRun& run, const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string path = (std::filesystem::path(dir) / (run.run_id + ".json")).string();
  std::ofstream out(path);
  FLEXEP_CHECK_ARG(out.good(), "--out", "cannot write '", path, "'");
  out << to_json(run) << "\n";
  return path;
}

std::string format_table(const std::vector<BenchRecord>& records) {
  std::string s = fmt::format("{:<14} {:<8} {:<16} {:<16} {:<7} {:>4} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8}\n",
                              "case", "routing", "backend", "phase", "timing", "sms", "min us", "median us",
                              "max us", "GB/s", "nvl GB/s", "TFLOP/s");
  auto num = [](const std::optional<double>& v) { return v ? fmt::format("{:.1f}", *v) : std::string("-"); };
  for (const BenchRecord& r : records)
    s += fmt::format("{:<14} {:<8} {:<16} {:<16} {:<7} {:>4} {:>10.1f} {:>10.1f} {:>10.1f} {:>9} {:>9} {:>8}\n",
                     r.case_name, r.routing, r.backend, r.pass.empty() ? r.phase : r.phase + ":" + r.pass.substr(0, 3),
                     r.start.empty() ? r.timing : r.timing + "-" + r.start.substr(0, 2), r.sms ? std::to_string(*r.sms) : "-",
                     r.time_us.min, r.time_us.median, r.time_us.max, num(r.algo_gbps ? r.algo_gbps : r.hbm_gbps),
                     num(r.nvlink_gbps), num(r.tflops));
  return s;
}

TimeStats stats_of(std::vector<double> samples) {
  FLEXEP_CHECK(!samples.empty(), "stats_of: no samples");
  std::sort(samples.begin(), samples.end());
  const std::size_t n = samples.size();
  const double median = n % 2 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
  return {samples.front(), median, samples.back()};
}

}  // namespace flexep::tools
