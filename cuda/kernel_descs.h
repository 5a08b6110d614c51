// The descriptors the CUDA backend's kernels read: plain data, built on the
// host by request_plan.h and copied to the device as they are (the emulated
// backend reads them from host memory).
#ifndef EMBER_CUDA_KERNEL_DESCS_H_
#define EMBER_CUDA_KERNEL_DESCS_H_

#include <cstdint>

#include "math/embedding_math.h"

namespace ember {
namespace cuda {

// One lookup request. Work items of request r are [item_begin[r],
// item_begin[r + 1]) (kept in a separate array for the binary search).
struct LookupDesc {
  const void* weights;  // the shard's [rows, dim] table, in weight_type
  int64_t dim;
  int64_t bag_begin;  // its first bag in the concatenated lengths / offsets
  int64_t id_begin;   // its first id in the concatenated ids (and weights)
  int64_t out_begin;  // its first float in the concatenated output
  int32_t weight_type;
  int32_t pooling;
  int32_t weighted;
  int32_t unused;
};

// One gradient request. Its ids are [id_begin[r], id_begin[r + 1]).
struct GradDesc {
  int64_t dim;
  int64_t bag_begin;   // as in LookupDesc
  int64_t num_bags;
  int64_t grad_begin;  // its first float in the concatenated gradients
  uint64_t key_base;   // sort key of its shard's row 0
  int32_t pooling;
  int32_t weighted;
};

// One shard touched by an ApplyGradients call. Keys [key_base[s],
// key_base[s + 1]) are its rows.
struct UpdateDesc {
  void* weights;  // [rows, dim] in weight_type
  float* state;   // [rows, state_width] fp32, or null
  int64_t dim;
  int64_t state_width;
  int32_t weight_type;
  int32_t stochastic;               // fp16/bf16 updates rounded stochastically
  backend::math::StepParams params;  // this call's hyper-parameters
  uint64_t seed;                    // stochastic rounding: the table's seed,
  int64_t step;                     // this call's step,
  int64_t row_offset;               // and the shard's place in the table
  int64_t col_offset;
  // Its rows are checked before they are applied (overflow_guard.h): in a
  // check launch, and row by row in a guarded apply.
  int32_t guard;
  int32_t unused;
};

// What the update kernels do with each row (UpdateArgs::mode).
enum UpdateMode : int32_t {
  kApplyRows = 0,   // apply (rows of guarded shards only where they fit, when guarded_apply)
  kCheckRows = 1,   // compute guarded shards' rows, store nothing, note misfits
  kReportRow = 2,   // compute OverflowRecord::first_key's row, note its first bad element
};

// A check's findings (overflow_guard.h), in device memory; first_key
// starts at UINT64_MAX and the rest at 0.
struct OverflowRecord {
  unsigned long long first_key;    // NOLINT(runtime/int): the smallest misfit's sort key
  unsigned long long skipped;      // NOLINT(runtime/int): rows a guarded apply left alone
  unsigned int max_weight_bits;    // the largest |weight| of the rows that fit, as float bits
  unsigned int max_acc_bits;       // their largest accumulator, as float bits
  int64_t bad;                     // kReportRow: its first bad element (weights, then state)
  float value;                     // and the value it would take
  int32_t unused;
};

// One request's inputs in device memory (FeatureRequest::on_device: a
// worker's link channel), checked before its call runs: ids in [0, rows),
// weights and gradient floats finite. Its elements are numbered weights
// first, then ids, then gradient floats, from `begin` on (numbers run on
// across the call's requests), so the smallest bad number is the first bad
// value in the order backend::ValidateRequests meets them.
struct InputCheckDesc {
  const int64_t* ids;
  const float* weights;  // [num_weights], or null
  const float* grad;     // [num_grad], or null
  int64_t num_ids;
  int64_t num_weights;  // 0 or num_ids
  int64_t num_grad;
  int64_t rows;
  int64_t begin;
};

}  // namespace cuda
}  // namespace ember

#endif  // EMBER_CUDA_KERNEL_DESCS_H_
