// Rows copied through shared memory: lane 0 of a warp bulk-loads pieces of rows (TMA) into the
// warp's ring of stages, and the warp's lanes store each stage to its destination with 16-byte
// stores.
//
// Why this split: a row copied through the registers (a warp per row, 16-byte loads then stores)
// moves ~35 GB/s per SM, and so does a copy that both loads and stores with the bulk-copy unit
// (measured: the unit's loads and stores share one rate). The unit's loads alone reach ~100 GB/s
// per SM and the lanes' stores ~62 GB/s (`flexep bench sm-copy`), so each takes the path where it
// is fastest and the loads cost no registers.
//
// The ring of warp w: `stages` stages of `stage_bytes` and two mbarriers per stage: full (count 1:
// lane 0's arrive with the bytes its bulk load brings) and empty (count 32: every lane arrives
// once it has read the stage, so the refill is an ordinary release/acquire that racecheck checks).
// Piece j of the warp's sequence uses stage j % stages; its load completes phase j / stages of
// full, its readers phase j / stages of empty. Loads run `stages` pieces ahead of the stores.
//
// Memory order: before its first load the issuing thread fences the proxies (the source may be rows
// another kernel or a peer wrote with ordinary stores, acquired by an earlier kernel). The stores
// are ordinary stores, ordered before the sender's flag by publish_to_peers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dispatch/hybridep/device/tma.cuh"

namespace flexep::deepep {

// The shape of every warp's ring in one CTA's dynamic shared memory: the stages of all warps, then
// their barriers. Sizes are multiples of 128 bytes, so every stage is 128-byte aligned.
struct CopyRingLayout {
  int warps = 1, stages = 2;
  unsigned stage_bytes = 128;
  unsigned piece_bytes = 16;  // the largest piece of a row one bulk copy moves (<= stage_bytes)

  __host__ __device__ std::size_t data_bytes() const {
    return static_cast<std::size_t>(warps) * stages * stage_bytes;
  }
  __host__ __device__ std::size_t bytes() const {
    return data_bytes() + static_cast<std::size_t>(warps) * stages * 2 * sizeof(std::uint64_t);
  }
};

// Rows of `row_bytes` in at most `max_warps` warps of at most `max_stages` stages within `budget`
// bytes of shared memory: rows longer than `max_piece` travel in pieces. stages = 0: nothing fits.
inline CopyRingLayout fit_copy_ring(long long row_bytes, int max_warps, int max_stages, std::size_t budget,
                                    unsigned max_piece = 16384) {
  CopyRingLayout l;
  l.piece_bytes = static_cast<unsigned>(row_bytes < max_piece ? row_bytes : max_piece);
  l.stage_bytes = (l.piece_bytes + 127u) / 128u * 128u;
  for (l.stages = max_stages; l.stages >= 2; --l.stages)
    for (l.warps = max_warps; l.warps >= 1; --l.warps)
      if (l.bytes() <= budget) return l;
  l.stages = 0;
  return l;
}

// The deepep copy kernels' rings: up to 8 warps of 3 stages; 14 KB rows (H 7168 bf16) give 5 warps,
// 210 KB. Beside them kFieldWarps warps store the rows' small fields (slots, weights, scales), a
// lane per row so that their loads overlap.
inline constexpr int kMaxCopyWarps = 8;
inline constexpr int kFieldWarps = 4;
inline constexpr int kCopyStages = 3;
inline CopyRingLayout copy_ring_for(long long row_bytes, std::size_t budget) {
  return fit_copy_ring(row_bytes, kMaxCopyWarps, kCopyStages, budget);
}

// A piece of a row: `bytes` (a multiple of 16) from `from` to `to` (16-byte aligned), of row `item`;
// `first`: the row's first piece (its small fields are stored with it).
struct Piece {
  const char* from;
  char* to;
  unsigned bytes;
  std::int64_t item;
  bool first;
};

// Where a row goes: to == nullptr skips it (a token not bound for that rank, a budget's tail).
struct RowRoute {
  const char* from;
  char* to;
};

// The pieces of rows first, first + stride, ... < items, in order; `where(item)` routes each. A
// cursor: copies advance independently (the ring walks one for the loads, one for the stores).
template <class Where>
struct RowPieces {
  Where where;
  std::int64_t next_item, stride, items;
  long long row_bytes;
  unsigned piece_bytes;
  long long offset;  // of the current row's next piece (row_bytes: look for the next row)
  std::int64_t item = -1;
  RowRoute route{};

  __device__ RowPieces(Where w, std::int64_t first, std::int64_t stride_, std::int64_t items_, long long row_bytes_,
                       unsigned piece_bytes_)
      : where(w), next_item(first), stride(stride_), items(items_), row_bytes(row_bytes_), piece_bytes(piece_bytes_),
        offset(row_bytes_) {}

  __device__ bool operator()(Piece& p) {
    while (offset >= row_bytes) {
      if (next_item >= items) return false;
      item = next_item;
      next_item += stride;
      route = where(item);
      offset = route.to != nullptr ? 0 : row_bytes;
    }
    const long long left = row_bytes - offset;
    p.bytes = left < piece_bytes ? static_cast<unsigned>(left) : piece_bytes;
    p.from = route.from + offset;
    p.to = route.to + offset;
    p.item = item;
    p.first = offset == 0;
    offset += p.bytes;
    return true;
  }
};

class WarpCopyRing {
 public:
  // Every lane of warp `warp`; the barriers are ready for the whole warp when it returns.
  __device__ WarpCopyRing(unsigned char* smem, const CopyRingLayout& l, int warp, int lane)
      : data_(smem + static_cast<std::size_t>(warp) * l.stages * l.stage_bytes),
        full_(reinterpret_cast<std::uint64_t*>(smem + l.data_bytes()) + static_cast<std::size_t>(warp) * 2 * l.stages),
        empty_(full_ + l.stages),
        stages_(l.stages),
        stage_bytes_(l.stage_bytes),
        lane_(lane) {
    if (lane_ == 0) {
      for (int s = 0; s < stages_; ++s) {
        hybridep::tma::mbar_init(full_ + s, 1);
        hybridep::tma::mbar_init(empty_ + s, 32);
      }
      hybridep::tma::fence_mbar_init();
    }
    __syncwarp();
  }

  // Copies every piece `cursor` yields, in order.
  template <class Cursor>
  __device__ void copy(Cursor loads) {
    Cursor stores = loads;
    if (lane_ == 0) hybridep::tma::fence_proxy_global();
    Piece p{}, q{};
    unsigned loaded = 0, stored = 0;
    while (loaded < static_cast<unsigned>(stages_) && loads(p)) load(loaded++, p);
    while (stores(q)) {
      const unsigned use = stored / static_cast<unsigned>(stages_);
      hybridep::tma::mbar_wait(full_ + slot(stored), use & 1u);
      store_stage(stage(stored), q.to, q.bytes / 16);
      hybridep::tma::mbar_arrive(empty_ + slot(stored));
      if (loads(p)) {  // into the stage just read
        if (lane_ == 0) hybridep::tma::mbar_wait(empty_ + slot(stored), use & 1u);
        load(loaded++, p);
      }
      ++stored;
    }
  }

 private:
  static constexpr int kUnroll = 4;  // 16-byte shared loads per lane before their stores

  __device__ int slot(unsigned j) const { return static_cast<int>(j % static_cast<unsigned>(stages_)); }
  __device__ unsigned char* stage(unsigned j) const { return data_ + static_cast<std::size_t>(slot(j)) * stage_bytes_; }
  __device__ void load(unsigned j, const Piece& p) const {
    if (lane_ != 0) return;
    std::uint64_t* bar = full_ + slot(j);
    hybridep::tma::mbar_arrive_expect_tx(bar, p.bytes);
    hybridep::tma::load_async(stage(j), p.from, p.bytes, bar);
  }
  __device__ void store_stage(const unsigned char* stage, char* to, unsigned vectors) const {
    const auto* from = reinterpret_cast<const uint4*>(stage);
    auto* dst = reinterpret_cast<uint4*>(to);
    unsigned v = static_cast<unsigned>(lane_);
    for (; v + 32 * (kUnroll - 1) < vectors; v += 32 * kUnroll) {
      uint4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) r[u] = from[v + 32 * u];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) dst[v + 32 * u] = r[u];
    }
    for (; v < vectors; v += 32) dst[v] = from[v];
  }

  unsigned char* data_;
  std::uint64_t* full_;
  std::uint64_t* empty_;
  int stages_;
  unsigned stage_bytes_;
  int lane_;
};

}  // namespace flexep::deepep
