// A fixed set of slots, each held by one caller at a time: the CUDA
// backend's staging buffers. A call holds a slot from before it queues any
// GPU work until that work has finished, so with two slots one call stages
// its inputs while the previous call's kernels run and its outputs are
// copied out (double-buffered staging), and no more than two calls are in
// flight on the device. CUDA-free, so it is tested on every machine.
#ifndef EMBER_SERVER_BACKEND_CUDA_SLOT_POOL_H_
#define EMBER_SERVER_BACKEND_CUDA_SLOT_POOL_H_

#include <vector>

#include "absl/synchronization/mutex.h"

namespace ember {
namespace backend {

class SlotPool {
 public:
  // slots >= 1.
  explicit SlotPool(int slots);
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;

  int size() const { return static_cast<int>(held_.size()); }

  // The index of a free slot, now held by the caller; waits while every
  // slot is held.
  int Acquire() ABSL_LOCKS_EXCLUDED(mu_);
  // Frees a slot Acquire returned (and not yet released).
  void Release(int slot) ABSL_LOCKS_EXCLUDED(mu_);
  // Slots held now.
  int Held() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  bool HasFree() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return num_held_ < static_cast<int>(held_.size());
  }

  mutable absl::Mutex mu_;
  std::vector<bool> held_ ABSL_GUARDED_BY(mu_);
  int num_held_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CUDA_SLOT_POOL_H_
