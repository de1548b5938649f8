// The two buffers of a hybridep dispatcher, separate so that one layer's combine and another's
// dispatch can be in flight at once (different windows, flags and epochs):
//   DispatchStorage: the dispatch window (count slots, records, the expert-major output), its
//                    flags, and plain device memory for the plan, staging and control;
//   CombineStorage:  the combine window (partials, prob gradients, staged grad_out), its flags and
//                    control.
// Construction is collective (SymmetricBuffer::init; every rank passes the same BufferConfig,
// verified); destruction is local (see symmetric_buffer.h). Outputs of a dispatch keep their
// storage alive (shared_ptr owners), so resize() and release() never pull memory from under a
// tensor the caller still holds. Included only by *_cuda.cpp files.
#pragma once

#include <memory>

#include "dispatch/hybridep/kernels/kernels.h"
#include "dispatch/hybridep/dispatcher/layout.h"
#include "flexep/comm/symmetric_buffer.h"

namespace flexep::hybridep {

class DispatchStorage {
 public:
  DispatchStorage(std::shared_ptr<Communicator> comm, const BufferConfig& config);  // collective
  ~DispatchStorage();
  DispatchStorage(const DispatchStorage&) = delete;
  DispatchStorage& operator=(const DispatchStorage&) = delete;

  const BufferConfig& config() const { return geo_.cfg; }
  const DispatchGeometry& geometry() const { return geo_; }
  SymmetricBuffer& symmetric() { return sym_; }
  char* window() const { return static_cast<char*>(sym_.local()); }
  char* local() const { return local_; }
  template <class T>
  T* at(std::size_t offset) const {
    return reinterpret_cast<T*>(local_ + offset);
  }
  DispatchControl* control() const { return at<DispatchControl>(geo_.off_control); }

  DispatchView view(Status* status, double timeout_seconds) const;

  std::size_t window_bytes() const { return geo_.window_bytes; }
  std::size_t flag_bytes() const { return geo_.flag_bytes; }
  std::size_t local_bytes() const { return geo_.local_bytes; }

 private:
  DispatchGeometry geo_;
  SymmetricBuffer sym_;
  char* local_ = nullptr;
};

class CombineStorage {
 public:
  CombineStorage(std::shared_ptr<Communicator> comm, const BufferConfig& config);  // collective
  ~CombineStorage();
  CombineStorage(const CombineStorage&) = delete;
  CombineStorage& operator=(const CombineStorage&) = delete;

  const CombineGeometry& geometry() const { return geo_; }
  SymmetricBuffer& symmetric() { return sym_; }
  CombineView view(Status* status, double timeout_seconds) const;

  std::size_t window_bytes() const { return geo_.window_bytes; }
  std::size_t flag_bytes() const { return geo_.flag_bytes; }
  std::size_t local_bytes() const { return geo_.local_bytes; }

 private:
  CombineGeometry geo_;
  SymmetricBuffer sym_;
  char* local_ = nullptr;
};

}  // namespace flexep::hybridep
