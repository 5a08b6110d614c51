// The arguments of the CUDA backend's two fused launches (tbe_kernels.h):
// pointers into the device scratch and shards, and sizes. CUDA-free, so the
// host launchers (host_kernels.h) that run the same steps on the CPU take
// them too.
#ifndef EMBER_CUDA_LAUNCH_ARGS_H_
#define EMBER_CUDA_LAUNCH_ARGS_H_

#include <cstddef>
#include <cstdint>

#include "cuda/kernel_bodies.h"
#include "cuda/kernel_descs.h"

namespace ember {
namespace cuda {

// A Lookup call: request descriptors, the concatenated lengths, ids and
// weights, and where offsets and outputs go.
struct LookupLaunch {
  const int64_t* item_begin = nullptr;  // [num_requests + 1]
  const LookupDesc* descs = nullptr;    // [num_requests]
  int64_t num_requests = 0;
  int64_t total_items = 0;
  const int64_t* lengths = nullptr;  // [num_bags]
  int64_t num_bags = 0;
  const int64_t* ids = nullptr;
  const float* weights = nullptr;  // per id, or unread
  int64_t* offsets = nullptr;      // scratch: [num_bags + 1]
  float* out = nullptr;
  void* temp = nullptr;  // LookupTempBytes(num_bags)
  size_t temp_bytes = 0;
};

// An ApplyGradients call (or piece): descriptors, inputs, and the scratch
// arrays the backward pass works in.
struct BackwardLaunch {
  // Inputs.
  const int64_t* id_begin = nullptr;  // [num_requests + 1]
  const GradDesc* descs = nullptr;    // [num_requests]
  int64_t num_requests = 0;
  const UpdateDesc* updates = nullptr;  // [num_shards]
  const uint64_t* key_base = nullptr;   // [num_shards + 1]
  int64_t num_shards = 0;
  const int64_t* lengths = nullptr;  // [num_bags]
  int64_t num_bags = 0;
  const int64_t* ids = nullptr;  // [total_ids]
  int64_t total_ids = 0;
  const float* weights = nullptr;  // per id, or unread
  const float* grads = nullptr;
  int end_bit = 64;
  int64_t max_dim = 4;
  // Scratch.
  int64_t* offsets = nullptr;  // [num_bags + 1]
  uint64_t* keys_a = nullptr;  // [total_ids] each, to run_id
  uint64_t* keys_b = nullptr;
  int64_t* pos_a = nullptr;
  int64_t* pos_b = nullptr;
  int64_t* src_off = nullptr;
  float* scale = nullptr;
  int64_t* run_id = nullptr;
  int64_t* run_begin = nullptr;  // [total_ids + 1]
  int64_t* hot_units = nullptr;  // [total_ids]
  int64_t* hot_end = nullptr;    // [total_ids]
  float* partials = nullptr;     // [max_units, max_dim]
  int64_t max_units = 1;
  void* temp = nullptr;  // BackwardTempBytes(num_bags, total_ids, end_bit)
  size_t temp_bytes = 0;
  // What the update step does (kernel_descs.h's UpdateMode) and where a
  // check notes what it finds.
  int32_t mode = kApplyRows;
  int32_t guarded_apply = 0;
  int32_t guard_all = 0;
  OverflowRecord* record = nullptr;
};

// A check of a call's device inputs (kernel_bodies.h's BadInputOne): the
// smallest bad element number goes to *first_bad, which must hold
// UINT64_MAX before (and still does when every element is good).
struct InputCheckLaunch {
  const int64_t* begin = nullptr;  // [num_requests + 1]
  const InputCheckDesc* descs = nullptr;
  int64_t num_requests = 0;
  int64_t total = 0;  // elements: begin[num_requests]
  unsigned long long* first_bad = nullptr;  // NOLINT(runtime/int): atomicMin's type
  // The largest |gradient| and |weight| as float bits (atomicMax's type),
  // which must hold 0 before.
  unsigned int* max_bits = nullptr;  // [2]
};

// A measurement of a shard's values (overflow_guard.h's MeasureValues on
// the device, kernel_bodies.h's MeasureOne): out[0] and out[1] receive the
// largest |weight| and accumulator as float bits, out[2] 1 when an Adam
// row breaks |m| <= adam_c sqrt(v); they must hold 0 before.
struct MeasureLaunch {
  const void* weights = nullptr;  // [rows, dim] in weight_type
  int32_t weight_type = 0;
  int32_t adam = 0;
  int64_t rows = 0;
  int64_t dim = 0;
  const float* state = nullptr;  // [rows, state_width], or null
  int64_t state_width = 0;
  int64_t first_acc = 0;         // accumulators: state elements [first_acc, width)
  float adam_c = 0;
  unsigned int* out = nullptr;   // [3]
};

// A keyed lookup's ids found in the copy of a dynamic shard's key index
// (math/key_index.h), in place: each of ids[0, n) becomes its slot, or
// `missing` for a key without one (kernel_bodies.h's KeyFindOne).
struct KeyFindLaunch {
  int64_t* ids = nullptr;
  int64_t n = 0;
  const kernels::math::KeyLine* lines = nullptr;
  uint64_t mask = 0;  // the index's entries - 1
  int64_t missing = 0;
};

// Rows at any positions of a shard copied to or from a packed buffer
// (kernel_bodies.h's CopyRowWordOne), n rows of `words` words.
struct CopyRowsLaunch {
  const int64_t* rows = nullptr;  // [n], distinct
  int64_t n = 0;
  int64_t words = 0;
  const uint32_t* from = nullptr;
  uint32_t* to = nullptr;
  bool gather = false;  // shard -> packed; else packed -> shard
};

// The update steps' arguments (kernel_bodies.h) once the pairs are sorted
// and the runs found.
inline kernels::UpdateArgs UpdateArgsOf(const BackwardLaunch& a, const uint64_t* sorted_keys,
                                        const int64_t* sorted_positions,
                                        const int64_t* num_runs) {
  kernels::UpdateArgs u;
  u.sorted_keys = sorted_keys;
  u.sorted_positions = sorted_positions;
  u.run_begin = a.run_begin;
  u.num_runs = num_runs;
  u.hot_end = a.hot_end;
  u.key_base = a.key_base;
  u.shards = a.updates;
  u.num_shards = a.num_shards;
  u.src_off = a.src_off;
  u.scale = a.scale;
  u.grads = a.grads;
  u.partials = a.partials;
  u.partial_stride = a.max_dim;
  u.mode = a.mode;
  u.guarded_apply = a.guarded_apply;
  u.guard_all = a.guard_all;
  u.record = a.record;
  return u;
}

}  // namespace cuda
}  // namespace ember

#endif  // EMBER_CUDA_LAUNCH_ARGS_H_
