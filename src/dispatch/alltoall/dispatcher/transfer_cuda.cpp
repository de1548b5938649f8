#include "dispatch/alltoall/dispatcher/transfer.h"

#include <exception>

namespace flexep::alltoall {

void send_recv(Communicator& comm, cudaStream_t stream, const Routes& routes, std::initializer_list<Lane> lanes,
               const std::string& phase) {
  const int R = comm.size();
  FLEXEP_CHECK(static_cast<int>(routes.send_count.size()) == R && static_cast<int>(routes.recv_count.size()) == R,
               "alltoall: routes for ", routes.send_count.size(), " peers in a group of ", R);
  FLEXEP_NCCL_CHECK(ncclGroupStart());
  try {
    for (int p = 0; p < R; ++p) {
      const auto i = static_cast<std::size_t>(p);
      for (const Lane& lane : lanes) {
        // Both sides derive the counts from the same exchange, so skipping empty messages on one
        // side matches the other.
        if (lane.row_bytes == 0) continue;
        if (routes.send_count[i] > 0)
          FLEXEP_NCCL_CHECK(ncclSend(static_cast<const char*>(lane.send) +
                                         static_cast<std::size_t>(routes.send_offset[i]) * lane.row_bytes,
                                     static_cast<std::size_t>(routes.send_count[i]) * lane.row_bytes, ncclUint8, p,
                                     comm.get(), stream));
        if (routes.recv_count[i] > 0)
          FLEXEP_NCCL_CHECK(ncclRecv(static_cast<char*>(lane.recv) +
                                         static_cast<std::size_t>(routes.recv_offset[i]) * lane.row_bytes,
                                     static_cast<std::size_t>(routes.recv_count[i]) * lane.row_bytes, ncclUint8, p,
                                     comm.get(), stream));
      }
    }
  } catch (...) {
    ncclGroupEnd();  // never leave a group open on this thread
    throw;
  }
  FLEXEP_NCCL_CHECK(ncclGroupEnd());
  comm.wait_enqueued(phase);
}

}  // namespace flexep::alltoall
