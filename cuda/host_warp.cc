// HostWarp: 32 lanes as ucontext fibers on the calling thread. A shuffle
// stores the lane's value, yields to the scheduler, and, once every lane has
// reached the same shuffle, reads the source lane's value (double-buffered,
// so a lane that runs ahead to the next shuffle cannot overwrite what others
// still read).
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "cuda/warp.h"

namespace ember {
namespace cuda {

struct HostWarp::Group {
  static constexpr size_t kStackBytes = size_t{256} << 10;
  ucontext_t scheduler;
  ucontext_t lanes[kWarpSize];
  std::vector<char> stacks = std::vector<char>(kWarpSize * kStackBytes);
  uint64_t write[kWarpSize] = {};
  uint64_t read[kWarpSize] = {};
  bool waiting[kWarpSize] = {};
  bool done[kWarpSize] = {};
  const std::function<void(HostWarp&)>* body = nullptr;
};

namespace {
thread_local HostWarp::Group* current_group = nullptr;
}  // namespace

void HostWarp::LaneMain(int lane) {
  Group* g = current_group;
  HostWarp w(g, lane);
  (*g->body)(w);
  g->done[lane] = true;
  // Returning resumes uc_link: the scheduler.
}

uint64_t HostWarp::Exchange(uint64_t mine, int src) {
  Group* g = group_;
  g->write[lane_] = mine;
  g->waiting[lane_] = true;
  swapcontext(&g->lanes[lane_], &g->scheduler);
  return g->read[src];
}

void HostWarp::Run(const std::function<void(HostWarp&)>& body) {
  // Stacks reused by every Run of this thread, freed when it exits.
  thread_local std::unique_ptr<Group> group(new Group());
  Group* g = group.get();
  Group* outer = current_group;
  if (outer == g) {
    std::fprintf(stderr, "HostWarp::Run: nested Run on one thread\n");
    std::abort();
  }
  current_group = g;
  g->body = &body;
  for (int l = 0; l < kWarpSize; ++l) {
    g->waiting[l] = g->done[l] = false;
    getcontext(&g->lanes[l]);
    g->lanes[l].uc_stack.ss_sp = g->stacks.data() + l * Group::kStackBytes;
    g->lanes[l].uc_stack.ss_size = Group::kStackBytes;
    g->lanes[l].uc_link = &g->scheduler;
    makecontext(&g->lanes[l], reinterpret_cast<void (*)()>(&HostWarp::LaneMain), 1, l);
  }
  for (;;) {
    // Run every lane to its next shuffle (or to its end).
    for (int l = 0; l < kWarpSize; ++l) {
      if (g->done[l]) continue;
      g->waiting[l] = false;
      swapcontext(&g->scheduler, &g->lanes[l]);
    }
    int done = 0, waiting = 0;
    for (int l = 0; l < kWarpSize; ++l) {
      done += g->done[l];
      waiting += g->waiting[l];
    }
    if (done == kWarpSize) break;
    if (waiting != kWarpSize) {
      std::fprintf(stderr,
                   "HostWarp: %d lane(s) at a shuffle while %d finished: a divergent shuffle "
                   "(the device code requires all 32 lanes)\n",
                   waiting, done);
      std::abort();
    }
    for (int l = 0; l < kWarpSize; ++l) g->read[l] = g->write[l];
  }
  current_group = outer;
}

}  // namespace cuda
}  // namespace ember
