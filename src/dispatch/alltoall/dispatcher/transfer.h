// Grouped point-to-point messages of the alltoall backend: for every peer (this rank included),
// one ncclSend and one ncclRecv per lane, inside one ncclGroupStart/End, then a wait until NCCL
// has enqueued them (non-blocking communicator) so that the stream can be used right after.
// Included only by *_cuda.cpp files.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "flexep/comm/communicator.h"

namespace flexep::alltoall {

// Rows per peer: sent from send + send_offset[p] rows, received into recv + recv_offset[p] rows.
struct Routes {
  const std::vector<std::int64_t>& send_count;
  const std::vector<std::int64_t>& send_offset;
  const std::vector<std::int64_t>& recv_count;
  const std::vector<std::int64_t>& recv_offset;
};

// One buffer pair moved along the routes; a row is row_bytes bytes in both.
struct Lane {
  const void* send;
  void* recv;
  std::size_t row_bytes;
};

void send_recv(Communicator& comm, cudaStream_t stream, const Routes& routes, std::initializer_list<Lane> lanes,
               const std::string& phase);

}  // namespace flexep::alltoall
