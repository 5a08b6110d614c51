#include "server/backend/cuda/slot_pool.h"

#include <cstdlib>

namespace ember {
namespace backend {

SlotPool::SlotPool(int slots) : held_(slots > 0 ? slots : 1, false) {}

int SlotPool::Acquire() {
  absl::MutexLock lock(&mu_);
  const int n = static_cast<int>(held_.size());
  mu_.Await(absl::Condition(this, &SlotPool::HasFree));
  for (int i = 0; i < n; ++i) {
    if (!held_[i]) {
      held_[i] = true;
      ++num_held_;
      return i;
    }
  }
  std::abort();  // num_held_ < n guarantees a free slot
}

void SlotPool::Release(int slot) {
  absl::MutexLock lock(&mu_);
  if (slot < 0 || slot >= static_cast<int>(held_.size()) || !held_[slot]) {
    std::abort();  // a slot released twice, or never acquired: the caller's bug
  }
  held_[slot] = false;
  --num_held_;
}

int SlotPool::Held() const {
  absl::MutexLock lock(&mu_);
  return num_held_;
}

}  // namespace backend
}  // namespace ember
