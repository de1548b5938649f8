// Case `sm-copy`: what one SM's copy paths move per second between shared memory and HBM (probes in
// sm_copy_kernels.cu), over SM counts and copies in flight: bulk stores (one issuing thread, the
// dispatch consumer's path), bulk loads (the producers' path; also by 2 and 4 issuing threads), 16-byte
// stores by W warps, 16-byte loads by W warps with U in flight per lane (a combine that sums rows
// straight from HBM), bulk loads with warp loads at once (whether the two load paths add up), and
// deepep's row copy (loads then stores by W warps) into plain memory, into an NCCL window and from
// an L2-resident source (what limits a copy per SM). The
// hybridep kernels move ~66 GB/s per SM (dispatch) and ~49 (combine) on 2x H200; these numbers
// say how much of that is the path itself. Records: backend "<path>/<in flight or warps>", sms set,
// hbm_gbps = bytes / kernel time (per SM in the note).
#include <algorithm>

#include <fmt/format.h>

#include "bench_cases.h"
#include "bench_timing_cuda.h"
#include "flexep/comm/communicator.h"
#include "flexep/comm/symmetric_buffer.h"
#include "flexep/core/error.h"
#include "flexep/cuda/runtime.h"
#include "sm_copy_kernels.h"

namespace flexep::tools {
namespace {

constexpr long long kL2Rows = 1024;  // 14.7 MB of 14 KB rows: well inside the 50 MB L2

void run(const BenchArgs& a, BenchRun& run) {
  cuda::init();
  const cuda::OwnedStream stream;
  const int row_bytes = 2 * (a.hidden ? a.hidden : 7168);
  FLEXEP_CHECK_ARG(row_bytes % 16 == 0, "--hidden", "must be a multiple of 8, got ", row_bytes / 2);
  const long long buffer_bytes = 1LL << 30;  // 1 GiB: far beyond L2, so the rows reach HBM
  const long long rows = buffer_bytes / row_bytes;
  unsigned char* buffer = nullptr;
  FLEXEP_CUDA_CHECK(cudaMalloc(&buffer, static_cast<std::size_t>(rows) * row_bytes));
  FLEXEP_CUDA_CHECK(cudaMemsetAsync(buffer, 0, static_cast<std::size_t>(rows) * row_bytes, stream));
  float* sink = nullptr;
  FLEXEP_CUDA_CHECK(cudaMalloc(&sink, 1024 * sizeof(float)));
  const std::vector<int> sms_list = a.sms.empty() ? std::vector<int>{1, 8, 16, 32} : a.sms;
  const long long total_bytes = 512LL << 20;  // per probe and SM count

  // The copy probes' destinations: the buffer's second half, and an NCCL window of a one-rank
  // communicator (what deepep's rows are stored into), through ncclMemAlloc's address and through
  // NCCL's LSA mapping of it (the address deepep's kernels take from the peer table).
  const long long half_rows = rows / 2;
  std::shared_ptr<Communicator> comm;
  std::unique_ptr<SymmetricBuffer> window;
  try {
    int device = 0;
    FLEXEP_CUDA_CHECK(cudaGetDevice(&device));
    comm = Communicator::create(Communicator::new_unique_id(), 0, 1, device);
    window = std::make_unique<SymmetricBuffer>(comm, "sm-copy window");
    window->init({static_cast<std::size_t>(half_rows) * row_bytes, 0, 1});
  } catch (const std::exception& e) {
    fmt::print(stderr, "sm-copy: no NCCL window ({}): the window probes are left out\n", e.what());
    window.reset();
  }

  auto probe = [&](const std::string& path, int variant, int sms,
                   void (*launch)(const SmCopyParams&, int, cudaStream_t), const std::string& what,
                   unsigned char* copy_dst = nullptr, long long src_rows = 0) {
    SmCopyParams p;
    p.dst = buffer;
    p.src = buffer;
    p.rows = rows;
    p.row_bytes = row_bytes;
    p.copies = static_cast<int>(std::max<long long>(1, total_bytes / row_bytes / sms));
    p.in_flight = path == "warp-store" ? 1 : variant;
    p.warps = path == "warp-store" ? variant : 1;
    if (path == "warp-load" || path == "warp-load-cg")
      p.in_flight = variant % 100, p.warps = variant / 100;  // variant = 100 W + U
    if (path.rfind("bulk-load-issuers", 0) == 0 || path == "bulk-load-lanes") p.issuers = variant, p.in_flight = 8 / variant;
    if (path == "bulk-load-issuers-smsp0") p.issuer_warp_step = 4;
    if (path == "bulk-load-lanes") p.issuer_warp_step = 0;
    if (path.rfind("ring-load", 0) == 0) p.pipes = variant, p.read_stages = path != "ring-load-free";
    if (path == "ring-load-store") p.store_every = 4;  // a partial per token of ~4 rows (dsv3-ep2, 2 ranks)
    if (path == "mixed-load") {  // W warps' loads take two thirds of the rows, one thread's bulk loads a third
      p.warps = variant;
      p.in_flight = 8;
      p.bulk_copies = std::max(1, p.copies / 3);
      p.copies = std::max(1, p.copies - p.bulk_copies);
    }
    p.l2_only = path == "warp-load-cg";
    if (copy_dst != nullptr) p.dst = copy_dst, p.rows = half_rows, p.src_rows = src_rows > 0 ? src_rows : half_rows;
    if (path.rfind("warp-copy", 0) == 0) p.in_flight = variant % 100, p.warps = variant / 100;
    p.sink = sink;
    const TimeStats t = time_cuda([&] { launch(p, sms, stream); }, a.warmup, a.reps, stream);
    const double bytes = static_cast<double>(p.copies + p.bulk_copies) * sms * row_bytes;
    BenchRecord r;
    r.case_name = "sm-copy";
    const bool w_by_u = path.rfind("warp-load", 0) == 0 || path.rfind("warp-copy", 0) == 0;
    r.backend = w_by_u ? fmt::format("{}/{}x{}", path, p.warps, p.in_flight)  // warps x in flight
                                    : fmt::format("{}/{}", path, variant);
    r.phase = "copy";
    r.timing = "kernel";
    r.sms = sms;
    r.hidden = row_bytes / 2;
    r.time_us = t;
    r.hbm_gbps = bytes / (t.median * 1e-6) / 1e9;
    r.note =
        fmt::format("{}: {:.1f} GB/s per SM ({} rows of {} B per CTA)", what, *r.hbm_gbps / sms,
                    p.copies + p.bulk_copies, row_bytes);
    run.records.push_back(r);
    if (!a.quiet)
      fmt::print(stderr, "  sm-copy {:<14} {:>3} SMs  {:8.1f} GB/s  {:6.1f} GB/s per SM\n", r.backend, sms, *r.hbm_gbps,
                 *r.hbm_gbps / sms);
  };
  try {
    for (int sms : sms_list) {
      for (int k : {1, 2, 4, 8}) {
        probe("bulk-store", k, sms, launch_bulk_store_probe,
              fmt::format("cp.async.bulk shared->global by one thread, {} in flight", k));
        probe("bulk-load", k, sms, launch_bulk_load_probe,
              fmt::format("cp.async.bulk global->shared by one thread, {} in flight", k));
      }
      for (int n : {2, 4}) {
        probe("bulk-load-issuers", n, sms, launch_bulk_load_probe,
              fmt::format("cp.async.bulk global->shared by lane 0 of {} warps (sub-partitions 0..{}), {} in flight each",
                          n, n - 1, 8 / n));
        probe("bulk-load-issuers-smsp0", n, sms, launch_bulk_load_probe,
              fmt::format("cp.async.bulk global->shared by lane 0 of {} warps of sub-partition 0, {} in flight each", n,
                          8 / n));
        probe("bulk-load-lanes", n, sms, launch_bulk_load_probe,
              fmt::format("cp.async.bulk global->shared by {} lanes of one warp, {} in flight each", n, 8 / n));
      }
      for (int n : {2, 3}) {
        probe("ring-load", n, sms, launch_ring_load_probe,
              fmt::format("the combine's data path: {} rings, whole rows bulk-loaded by lane 0 of each producer warp, "
                          "read by 4 consumer warps (16-byte shared loads) and freed",
                          n));
        probe("ring-load-free", n, sms, launch_ring_load_probe,
              fmt::format("as ring-load/{}, the consumers free each stage without reading it", n));
        probe("ring-load-store", n, sms, launch_ring_load_probe,
              fmt::format("as ring-load/{}, the consumers also store one row per 4 loaded (16-byte stores), as the "
                          "combine stores a partial per token",
                          n));
      }
      for (int w : {8, 12})
        probe("mixed-load", w, sms, launch_mixed_load_probe,
              fmt::format("16-byte loads by {} warps (8 per lane in flight) on 2/3 of the rows while one thread "
                          "bulk-loads the other 1/3 (8 in flight)",
                          w));
      for (int w : {1, 4, 16})
        probe("warp-store", w, sms, launch_warp_store_probe, fmt::format("16-byte stores by {} warps", w));
      for (int w : {4, 8, 16})
        for (int u : {2, 4, 8})
          for (const char* path : {"warp-load", "warp-load-cg"})
            probe(path, 100 * w + u, sms, launch_warp_load_probe,
                  fmt::format("16-byte loads ({}) by {} warps, {} per lane in flight, summed",
                              std::string(path) == "warp-load" ? "ld.global.nc" : "ld.global.cg", w, u));
      unsigned char* plain = buffer + half_rows * row_bytes;
      for (int w : {8, 16})
        for (int u : {4, 8}) {
          const std::string shape = fmt::format("{} warps, {} 16-byte loads per lane before their stores", w, u);
          probe("warp-copy", 100 * w + u, sms, launch_warp_copy_probe,
                fmt::format("rows copied HBM to HBM (cudaMalloc), {}", shape), plain);
          probe("warp-copy-l2src", 100 * w + u, sms, launch_warp_copy_probe,
                fmt::format("rows copied from {} source rows (in L2) to HBM, {}", kL2Rows, shape), plain, kL2Rows);
          if (!window) continue;
          probe("warp-copy-window", 100 * w + u, sms, launch_warp_copy_probe,
                fmt::format("rows copied into an NCCL window (ncclMemAlloc address), {}", shape),
                static_cast<unsigned char*>(window->local()));
          probe("warp-copy-lsa", 100 * w + u, sms, launch_warp_copy_probe,
                fmt::format("rows copied into an NCCL window through its LSA mapping (the peer table's), {}", shape),
                reinterpret_cast<unsigned char*>(window->peer_window(0)));
        }
    }
  } catch (...) {
    cudaFree(buffer);
    cudaFree(sink);
    throw;
  }
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (window) window->free();
  FLEXEP_CUDA_CHECK(cudaFree(buffer));
  FLEXEP_CUDA_CHECK(cudaFree(sink));
}

FLEXEP_BENCH_CASE(sm_copy, "sm-copy", "one SM's copy paths (bulk store/load, warp stores) in GB/s per SM", 1, run);

}  // namespace
}  // namespace flexep::tools
