// The shared-memory stage ring of a hybridep pipeline: one PRODUCER warp fills stages (a bulk
// load of a row, or only a job descriptor) and one CONSUMER group drains them (bulk stores, or
// arithmetic), in the same order. Job j uses stage j % stages; its k-th use (k = j / stages)
// completes phase k of the stage's two mbarriers:
//
//   full[s]   count 1: the producer's arrive (with expect_tx = the bytes its bulk loads bring), so
//             the phase completes when the descriptor is written AND the bytes have landed;
//   empty[s]  count = the consumer threads that read the stage or its descriptor: each of them
//             arrives itself once it is done with the stage, which may then be refilled.
//
// The producer waits empty[s] with parity (k & 1) ^ 1 (a fresh barrier counts as "free"), the
// consumer waits full[s] with parity k & 1. Descriptors (Job) are written by the producer's lane 0
// before its arrive (release, CTA scope) and read by the consumer after its wait (acquire).
//
// Why every reading thread arrives on empty[s], not one lane after a __syncwarp: an mbarrier arrive
// releases the accesses of the arriving thread. The PTX model would carry the other lanes' reads
// along (the warp barrier orders them before lane 0's release, cumulativity does the rest), but
// compute-sanitizer racecheck does not follow that chain and reports the producer's next write of
// the stage as a hazard against every other lane's read. With one arrival per reading thread the
// handoff is plain release/acquire that racecheck checks; a consumer warp whose lane 0 alone uses
// the stage (bulk stores) reads the descriptor through wait_lane0() and arrives once.
//
// Several rings share one dynamic shared-memory block (RingLayout): all stage data first (stage
// sizes are multiples of 128, so every stage is 128-byte aligned for the copy engine), then an
// optional extra region, the descriptors and the barriers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dispatch/hybridep/device/tma.cuh"

namespace flexep::hybridep {

// A job descriptor: `kind` and up to seven integers whose meaning belongs to the kernel.
struct Job {
  int kind;
  int a, b, c, d, e, f, g;
};
static_assert(sizeof(Job) == 32, "descriptors are 32 bytes");

struct RingLayout {
  int rings = 1, stages = 2, stage_bytes = 128;
  std::size_t extra_bytes = 0;  // e.g. a block of zeros for bulk zeroing

  __host__ __device__ std::size_t data_bytes() const {
    return static_cast<std::size_t>(rings) * stages * static_cast<std::size_t>(stage_bytes);
  }
  __host__ __device__ std::size_t off_extra() const { return data_bytes(); }
  __host__ __device__ std::size_t off_jobs() const { return (off_extra() + extra_bytes + 127) / 128 * 128; }
  __host__ __device__ std::size_t off_bars() const {
    return off_jobs() + static_cast<std::size_t>(rings) * stages * sizeof(Job);
  }
  __host__ __device__ std::size_t total_bytes() const {
    return off_bars() + static_cast<std::size_t>(rings) * stages * 2 * sizeof(std::uint64_t);
  }
};

struct Ring {
  unsigned char* data;
  std::uint64_t* full;
  std::uint64_t* empty;
  Job* jobs;
  int stages;
  int stage_bytes;

  __device__ static Ring make(unsigned char* smem, const RingLayout& l, int ring) {
    Ring r;
    r.stages = l.stages;
    r.stage_bytes = l.stage_bytes;
    r.data = smem + static_cast<std::size_t>(ring) * l.stages * static_cast<std::size_t>(l.stage_bytes);
    r.jobs = reinterpret_cast<Job*>(smem + l.off_jobs()) + static_cast<std::size_t>(ring) * l.stages;
    std::uint64_t* bars =
        reinterpret_cast<std::uint64_t*>(smem + l.off_bars()) + static_cast<std::size_t>(ring) * 2 * l.stages;
    r.full = bars;
    r.empty = bars + l.stages;
    return r;
  }

  __device__ int slot(unsigned j) const { return static_cast<int>(j % static_cast<unsigned>(stages)); }
  __device__ unsigned char* stage(unsigned j) const {
    return data + static_cast<std::size_t>(slot(j)) * static_cast<std::size_t>(stage_bytes);
  }
  __device__ std::uint32_t full_parity(unsigned j) const { return (j / static_cast<unsigned>(stages)) & 1u; }
  __device__ std::uint32_t empty_parity(unsigned j) const { return full_parity(j) ^ 1u; }

  // One thread, before the CTA barrier that precedes any use (then tma::fence_mbar_init()).
  __device__ void init(unsigned consumer_arrivals) const {
    for (int s = 0; s < stages; ++s) {
      tma::mbar_init(&full[s], 1);
      tma::mbar_init(&empty[s], consumer_arrivals);
    }
  }

  // ---- producer side (a whole warp calls these; lane 0 acts) ----

  // Waits until the stage of job j may be refilled.
  __device__ void acquire(unsigned j, int lane) const {
    if (lane == 0) tma::mbar_wait(&empty[slot(j)], empty_parity(j));
    __syncwarp();
  }
  // Lane 0: a descriptor-only job (no data).
  __device__ void post(unsigned j, const Job& job) const {
    jobs[slot(j)] = job;
    tma::mbar_arrive(&full[slot(j)]);
  }
  // Lane 0: a job whose data arrives through `bytes` of bulk loads into stage(j), issued right after
  // this call with full_bar(j) as their barrier.
  __device__ void post_expecting(unsigned j, const Job& job, std::uint32_t bytes) const {
    jobs[slot(j)] = job;
    tma::mbar_arrive_expect_tx(&full[slot(j)], bytes);
  }
  __device__ std::uint64_t* full_bar(unsigned j) const { return &full[slot(j)]; }

  // ---- producer side, by position ----
  // A producer that posts one job after the other can carry its next job's slot and phase parity
  // instead of deriving them from the job number (j % stages, j / stages: an integer division each,
  // a ~20-instruction routine; ncu put ~9% of the combine's stall samples on them in its loader).
  struct Slot {
    int slot = 0;
    std::uint32_t parity = 0;  // of the full barrier's phase the job completes
  };
  __device__ void advance(Slot& s) const {
    if (++s.slot == stages) s.slot = 0, s.parity ^= 1u;
  }
  __device__ void acquire(const Slot& s, int lane) const {
    if (lane == 0) tma::mbar_wait(&empty[s.slot], s.parity ^ 1u);
    __syncwarp();
  }
  __device__ void post(const Slot& s, const Job& job) const {
    jobs[s.slot] = job;
    tma::mbar_arrive(&full[s.slot]);
  }
  __device__ void post_expecting(const Slot& s, const Job& job, std::uint32_t bytes) const {
    jobs[s.slot] = job;
    tma::mbar_arrive_expect_tx(&full[s.slot], bytes);
  }
  __device__ unsigned char* stage(const Slot& s) const {
    return data + static_cast<std::size_t>(s.slot) * static_cast<std::size_t>(stage_bytes);
  }
  __device__ std::uint64_t* full_bar(const Slot& s) const { return &full[s.slot]; }

  // ---- consumer side ----

  // Every consumer thread waits for job j (descriptor written, data landed), then may read both;
  // each such thread later calls release(j).
  __device__ Job wait(unsigned j) const {
    tma::mbar_wait(&full[slot(j)], full_parity(j));
    return jobs[slot(j)];
  }
  // A whole warp: lane 0 alone waits and reads the descriptor, the other lanes get it by shuffles
  // and never touch the ring, so lane 0's release(j) is the stage's one arrival from this warp.
  __device__ Job wait_lane0(unsigned j, int lane) const {
    Job job{};
    if (lane == 0) job = wait(j);
    // Lane 0's acquire, then this barrier: the other lanes' reads of what the poster wrote before
    // the job (the fused dispatch kernel's staged records) are ordered after it (a shuffle is not).
    __syncwarp();
    auto from_lane0 = [](int x) { return __shfl_sync(0xffffffffu, x, 0); };
    return Job{from_lane0(job.kind), from_lane0(job.a), from_lane0(job.b), from_lane0(job.c),
               from_lane0(job.d),    from_lane0(job.e), from_lane0(job.f), from_lane0(job.g)};
  }
  // This thread's arrival: it is done with the stage of job j (init()'s count says how many).
  __device__ void release(unsigned j) const { tma::mbar_arrive(&empty[slot(j)]); }

  // ---- consumer side, by position ----
  // A consumer that takes one job after the other carries its position: the slot and phase parity
  // of its next job, and the 32-bit shared addresses of that stage's data (at the thread's own byte
  // offset) and of its full barrier. Deriving them per job costs an integer division by the runtime
  // stage count (j % stages, j / stages: ~20 dependent instructions) and, from generic pointers, a
  // 64-bit multiply and an address conversion per access: ncu counted both in the combine's compute
  // loop, which runs once per row.
  struct Pos {
    int slot;
    std::uint32_t parity;  // of the full barrier's phase this job completes
    std::uint32_t data;    // shared address of the stage + the thread's offset
    std::uint32_t full;    // shared address of full[slot]; empty[slot] is `stages` barriers on
  };
  __device__ Pos first_pos(std::uint32_t offset) const {
    return Pos{0, 0, tma::smem_addr(data) + offset, tma::smem_addr(full)};
  }
  __device__ void advance(Pos& p) const {
    if (++p.slot == stages) {
      p.slot = 0;
      p.parity ^= 1u;
      p.data -= static_cast<std::uint32_t>((stages - 1) * stage_bytes);
      p.full -= static_cast<std::uint32_t>((stages - 1) * sizeof(std::uint64_t));
    } else {
      p.data += static_cast<std::uint32_t>(stage_bytes);
      p.full += static_cast<std::uint32_t>(sizeof(std::uint64_t));
    }
  }
  __device__ Job wait(const Pos& p) const {
    tma::mbar_wait(p.full, p.parity);
    return jobs[p.slot];
  }
  // Waits for the job's data only (a consumer that already holds the descriptor).
  __device__ void wait_data(const Pos& p) const { tma::mbar_wait(p.full, p.parity); }
  __device__ void release(const Pos& p) const {
    tma::mbar_arrive(p.full + static_cast<std::uint32_t>(stages * sizeof(std::uint64_t)));
  }
};

// 16 bytes of shared memory at a 32-bit shared address. Volatile: it must stay between the wait for
// the stage and the arrival that frees it, both of which are volatile asm too.
__device__ __forceinline__ uint4 ld_shared_16(std::uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

}  // namespace flexep::hybridep
