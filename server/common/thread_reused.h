// A value kept per thread between calls, so that its buffers (megabytes of
// ids, outputs or gradients) are reused instead of allocated afresh each
// call: fresh memory of that size is faulted in and zeroed by the kernel
// page by page (measured: docs/lab-notes/2026-11-benchmarks.md, the worker's request copies
// and the in-process collection's parts).
//
// ThreadReused<T, Traits> leases this thread's T for one scope. On release
// the value is dropped (reset to T()) if Traits::Bytes(value) exceeds
// Traits::kKeptBytes, else handed to Traits::Keep(&value) (empty it, or
// leave it as is). Leases of one T must not nest on a thread: they share
// the one value.
//
//   struct Traits {
//     static constexpr size_t kKeptBytes = ...;
//     static size_t Bytes(const T&);
//     static void Keep(T*);
//   };
#ifndef EMBER_SERVER_COMMON_THREAD_REUSED_H_
#define EMBER_SERVER_COMMON_THREAD_REUSED_H_

#include <cstddef>

namespace ember {

template <typename T, typename Traits>
class ThreadReused {
 public:
  ThreadReused() : value_(Slot()) {}
  ~ThreadReused() {
    if (Traits::Bytes(*value_) > Traits::kKeptBytes) {
      *value_ = T();
    } else {
      Traits::Keep(value_);
    }
  }
  ThreadReused(const ThreadReused&) = delete;
  ThreadReused& operator=(const ThreadReused&) = delete;

  T* get() { return value_; }

 private:
  static T* Slot() {
    thread_local T value;
    return &value;
  }
  T* const value_;
};

}  // namespace ember

#endif  // EMBER_SERVER_COMMON_THREAD_REUSED_H_
