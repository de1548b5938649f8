// Rows moved by the TMA engine: global -> shared -> global, one warp's ring of stages, lane 0
// issuing every bulk copy while the warp steps along so that its lanes can store a row's small
// fields (slots, weights, scales) beside it.
//
// Why: a row copied through the registers moves ~35 GB/s per SM (a warp per row, four 16-byte loads
// in flight per lane); the SM's store path takes ~62 GB/s and one thread's bulk loads ~46-51 GB/s
// (`flexep bench sm-copy`), so a few warps each keeping whole rows in flight through shared memory
// reach the store limit without spending registers or issue slots on the bytes.
//
// The ring of warp w: `stages` stages of `stage_bytes` and one mbarrier per stage (count 1). Piece
// j of the warp's sequence uses stage j % stages; its bulk load completes phase j / stages of the
// stage's barrier. The loads run stages - 1 pieces ahead of the stores; before a stage is
// refilled, lane 0 waits (cp.async.bulk.wait_group.read 1) until the store issued from it one
// step earlier has read it, so the newest store may still be reading its own stage.
//
// Memory order: the bytes never pass through the generic proxy here. Before its first load the
// issuing thread fences the proxies (the source may be rows another kernel or a peer wrote with
// ordinary stores, acquired by an earlier kernel); after its last store it waits for the writes to
// complete and fences again, so that the sender's flag release (publish_to_peers) covers them.
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
    return data_bytes() + static_cast<std::size_t>(warps) * stages * sizeof(std::uint64_t);
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

// The deepep copy kernels' rings: up to 8 warps (issuing threads) of 3 stages; 14 KB rows (H 7168
// bf16) give 5 warps, 210 KB.
inline constexpr int kMaxCopyWarps = 8;
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
        full_(reinterpret_cast<std::uint64_t*>(smem + l.data_bytes()) + static_cast<std::size_t>(warp) * l.stages),
        stages_(l.stages),
        stage_bytes_(l.stage_bytes),
        lane_(lane) {
    if (lane_ == 0) {
      for (int s = 0; s < stages_; ++s) hybridep::tma::mbar_init(full_ + s, 1);
      hybridep::tma::fence_mbar_init();
    }
    __syncwarp();
  }

  // Copies every piece `cursor` yields, in order; beside(piece) runs on every lane once the piece's
  // store is issued (the piece's bytes are in flight, not yet written). Ends with every write of
  // this warp complete and fenced for a release.
  template <class Cursor, class Beside>
  __device__ void copy(Cursor loads, Beside beside) {
    Cursor stores = loads;
    if (lane_ == 0) hybridep::tma::fence_proxy_global();
    Piece p{}, q{};
    unsigned loaded = 0, stored = 0;
    while (loaded + 1 < static_cast<unsigned>(stages_) && loads(p)) load(loaded++, p);
    while (stores(q)) {
      hybridep::tma::mbar_wait(full_ + slot(stored), (stored / stages_) & 1u);
      if (lane_ == 0) {
        hybridep::tma::store_async(q.to, stage(stored), q.bytes);
        hybridep::tma::commit();
      }
      beside(q);
      ++stored;
      if (loads(p)) {
        if (lane_ == 0) hybridep::tma::wait_groups_read<1>();  // the stage's previous store has read it
        load(loaded++, p);
      }
    }
    if (lane_ == 0) {
      hybridep::tma::wait_groups<0>();
      hybridep::tma::fence_proxy_global();
    }
    __syncwarp();
  }

 private:
  __device__ int slot(unsigned j) const { return static_cast<int>(j % static_cast<unsigned>(stages_)); }
  __device__ unsigned char* stage(unsigned j) const { return data_ + static_cast<std::size_t>(slot(j)) * stage_bytes_; }
  __device__ void load(unsigned j, const Piece& p) const {
    if (lane_ != 0) return;
    std::uint64_t* bar = full_ + slot(j);
    hybridep::tma::mbar_arrive_expect_tx(bar, p.bytes);
    hybridep::tma::load_async(stage(j), p.from, p.bytes, bar);
  }

  unsigned char* data_;
  std::uint64_t* full_;
  int stages_;
  unsigned stage_bytes_;
  int lane_;
};

}  // namespace flexep::deepep
