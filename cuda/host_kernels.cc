#include "cuda/host_kernels.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "cuda/kernel_bodies.h"
#include "cuda/warp.h"

namespace ember {
namespace cuda {
namespace {

// offsets[0] = 0, offsets[b + 1] = lengths[0] + ... + lengths[b].
void ScanLengths(const int64_t* lengths, int64_t num_bags, int64_t* offsets) {
  offsets[0] = 0;
  std::partial_sum(lengths, lengths + num_bags, offsets + 1);
}

// CUB's temporary storage holds its own data during a launch: nothing may
// rely on what it held before, nor on it after.
void Scribble(void* temp, size_t bytes) {
  if (temp != nullptr && bytes > 0) std::memset(temp, 0xa5, bytes);
}

}  // namespace

void RunLookupOnHost(const LookupLaunch& a) {
  Scribble(a.temp, a.temp_bytes);
  ScanLengths(a.lengths, a.num_bags, a.offsets);
  HostWarp::Run([&](HostWarp& w) {
    kernels::LookupWarp(w, 0, 1, a.item_begin, a.descs, a.num_requests, a.offsets, a.ids,
                        a.weights, a.out);
  });
}

void RunBackwardOnHost(const BackwardLaunch& a) {
  const int64_t total = a.total_ids;
  if (total <= 0) std::abort();  // the GPU launch reads run_id[total - 1] too
  Scribble(a.temp, a.temp_bytes);
  ScanLengths(a.lengths, a.num_bags, a.offsets);
  for (int64_t p = 0; p < total; ++p) {
    kernels::ExpandOne(p, a.id_begin, a.descs, a.num_requests, a.offsets, a.ids, a.weights,
                       a.keys_a, a.pos_a, a.src_off, a.scale);
  }
  // CUB's radix sort is stable (equal keys keep their position order) and
  // sorts on bits [0, end_bit) only: the rest is not the key.
  const uint64_t mask = a.end_bit >= 64 ? ~uint64_t{0} : (uint64_t{1} << a.end_bit) - 1;
  std::vector<int64_t> order(total);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return (a.keys_a[x] & mask) < (a.keys_a[y] & mask);
  });
  for (int64_t k = 0; k < total; ++k) {
    a.keys_b[k] = a.keys_a[order[k]];
    a.pos_b[k] = a.pos_a[order[k]];
  }
  for (int64_t k = 0; k < total; ++k) kernels::HeadFlagOne(k, a.keys_b, a.run_id);
  std::partial_sum(a.run_id, a.run_id + total, a.run_id);
  for (int64_t k = 0; k < total; ++k) kernels::RunBeginOne(k, a.run_id, total, a.run_begin);
  const int64_t* num_runs = a.run_id + (total - 1);
  std::fill(a.hot_units, a.hot_units + total, 0);
  for (int64_t u = 0; u < *num_runs; ++u) kernels::HotUnitsOne(u, a.run_begin, a.hot_units);
  std::partial_sum(a.hot_units, a.hot_units + total, a.hot_end);
  const kernels::UpdateArgs u = UpdateArgsOf(a, a.keys_b, a.pos_b, num_runs);
  HostWarp::Run([&](HostWarp& w) { kernels::PartialSumWarp(w, 0, 1, u); });
  HostWarp::Run([&](HostWarp& w) { kernels::UpdateWarpAs(w, 0, 1, u); });
}

}  // namespace cuda
}  // namespace ember
