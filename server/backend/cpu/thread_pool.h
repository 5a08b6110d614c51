// A fixed pool of threads for data-parallel loops on the hot path.
//
// ParallelFor hands out chunks of [0, n) through an atomic counter; the
// calling thread works too. No allocation per call. Between calls a worker
// spins for up to kSpinMicros before it sleeps, and the caller spins as
// long for the workers to finish: back-to-back calls (a fused lookup of a
// few hundred microseconds) then start and end without a futex wake-up,
// which took a tenth of such a call. At most kSpinMicros of a core per
// thread is spent idle after each call.
//
// Thread-safety: ParallelFor calls are serialised by an internal mutex, so
// concurrent callers take turns; fn must be safe to run on disjoint ranges
// concurrently.
#ifndef EMBER_SERVER_BACKEND_CPU_THREAD_POOL_H_
#define EMBER_SERVER_BACKEND_CPU_THREAD_POOL_H_

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace ember {
namespace backend {

class ThreadPool {
 public:
  // num_threads >= 1 threads in all, the caller included.
  explicit ThreadPool(int num_threads) : num_threads_(std::max(1, num_threads)) {
    for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Runs fn(begin, end) over chunks of [0, n) of about `grain` items.
  template <typename F>
  void ParallelFor(int64_t n, int64_t grain, F&& fn) {
    if (n <= 0) return;
    grain = std::max<int64_t>(1, grain);
    if (num_threads_ == 1 || n <= grain) {
      fn(int64_t{0}, n);
      return;
    }
    std::lock_guard<std::mutex> call_lock(call_mu_);
    using Fn = typename std::remove_reference<F>::type;
    Task task;
    task.n = n;
    task.grain = grain;
    task.ctx = const_cast<void*>(static_cast<const void*>(&fn));
    task.call = [](void* ctx, int64_t b, int64_t e) { (*static_cast<Fn*>(ctx))(b, e); };
    {
      std::lock_guard<std::mutex> lock(mu_);
      task_ = &task;
      next_.store(0);
      active_.store(static_cast<int>(workers_.size()));
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    RunChunks(task);
    SpinUntil([this] { return active_.load() == 0; });
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return active_.load() == 0; });
    task_ = nullptr;
  }

  static constexpr int kSpinMicros = 50;

 private:
  struct Task {
    int64_t n = 0;
    int64_t grain = 1;
    void* ctx = nullptr;
    void (*call)(void*, int64_t, int64_t) = nullptr;
  };

  void RunChunks(const Task& t) {
    for (;;) {
      const int64_t b = next_.fetch_add(t.grain);
      if (b >= t.n) return;
      t.call(t.ctx, b, std::min(t.n, b + t.grain));
    }
  }

  // Spins (with pause) until done() or kSpinMicros have passed.
  template <typename Done>
  static void SpinUntil(Done done) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
    for (int i = 1; !done(); ++i) {
#if defined(__x86_64__) || defined(__i386__)
      _mm_pause();
#else
      std::this_thread::yield();
#endif
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) return;
    }
  }

  void WorkerLoop() {
    uint64_t seen = 0;
    for (;;) {
      SpinUntil([&] { return generation_.load() != seen; });
      const Task* task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load() != seen; });
        seen = generation_.load();
        if (stop_) return;
        task = task_;
      }
      if (task != nullptr) RunChunks(*task);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (active_.fetch_sub(1) == 1) done_cv_.notify_one();
      }
    }
  }

  const int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one ParallelFor at a time
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  // Written under mu_ (so that sleepers cannot miss a change), read
  // without it by the spinners.
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;  // guarded by mu_
  std::atomic<int> active_{0};
  const Task* task_ = nullptr;  // guarded by mu_
  std::atomic<int64_t> next_{0};
};

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CPU_THREAD_POOL_H_
