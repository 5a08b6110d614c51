// KeyedJaggedTensor and KeyedTensor: TorchRec's sparse input and pooled
// output layouts, as the client SDK takes and returns them.
//
//   KeyedJaggedTensor  keys [K]; lengths [K * B] key-major (all of key 0's
//                      bags, then key 1's...); values [sum(lengths)] ids in
//                      the same order; weights empty or [sum(lengths)].
//   KeyedTensor        keys [F]; length_per_key [F] (each feature's dim);
//                      values [B, sum(length_per_key)] row-major, feature f
//                      at columns offset_per_key()[f] .. + length_per_key[f].
//
// Thread-safe: value types; const methods only read.
#ifndef EMBER_CLIENT_KJT_H_
#define EMBER_CLIENT_KJT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/shared_buffer.h"

namespace ember {
namespace client {

// A KJT over memory its caller owns and keeps alive for the call: no copy.
// The Python SDK builds one over NumPy / torch buffers; KeyedJaggedTensor's
// View() gives one over its vectors. The same layout and rules as
// KeyedJaggedTensor's, below.
struct KjtView {
  absl::Span<const std::string> keys;
  absl::Span<const int64_t> lengths;
  absl::Span<const int64_t> values;
  absl::Span<const float> weights;

  absl::Status Validate() const;
  int64_t batch_size() const;
  std::vector<int64_t> key_offsets() const;
};

// A KeyedTensor (gradients) over caller-owned memory; KeyedTensor::View().
struct KeyedTensorView {
  absl::Span<const std::string> keys;
  absl::Span<const int64_t> length_per_key;
  int64_t batch_size = 0;
  absl::Span<const float> values;

  int64_t row_width() const;
  std::vector<int64_t> offset_per_key() const;
};

struct KeyedJaggedTensor {
  std::vector<std::string> keys;
  std::vector<int64_t> lengths;
  // A std::vector<int64_t> whose resize does not zero and whose large
  // buffers a worker on this host can read the ids from in place
  // (shared_buffer.h).
  IdBuffer values;
  std::vector<float> weights;

  // From per-key jagged lists: ids[k][b] is the bag of key k, sample b
  // (every key needs the same number of samples). weights, if given, has the
  // same shape. INVALID_ARGUMENT on ragged batches or shape mismatches.
  static absl::StatusOr<KeyedJaggedTensor> FromJagged(
      const std::vector<std::string>& keys,
      const std::vector<std::vector<std::vector<int64_t>>>& ids,
      const std::vector<std::vector<std::vector<float>>>& weights = {});

  // Checks the layout: keys unique and non-empty, lengths a multiple of the
  // key count, lengths >= 0 summing to the values, weights empty or one per
  // value. INVALID_ARGUMENT naming the problem.
  absl::Status Validate() const;

  int64_t batch_size() const;  // B; 0 without keys
  // Start of key k's values in `values` (size K + 1).
  std::vector<int64_t> key_offsets() const;

  KjtView View() const { return {keys, lengths, values, weights}; }
  // Where a call takes a KjtView (it reads the KJT during the call only).
  operator KjtView() const { return View(); }  // NOLINT(google-explicit-constructor)
};

struct KeyedTensor {
  std::vector<std::string> keys;
  std::vector<int64_t> length_per_key;
  int64_t batch_size = 0;
  // A std::vector<float> whose resize does not zero and whose large
  // buffers a worker on this host can write into (shared_buffer.h).
  FloatBuffer values;

  int64_t row_width() const;  // sum(length_per_key)
  std::vector<int64_t> offset_per_key() const;
  // Feature `key`'s [batch, dim] block copied out; NOT_FOUND if absent.
  absl::StatusOr<std::vector<float>> Get(const std::string& key) const;

  KeyedTensorView View() const { return {keys, length_per_key, batch_size, values}; }
  operator KeyedTensorView() const { return View(); }  // NOLINT(google-explicit-constructor)
};

// Checks that every id of `feature` lies in [0, rows) of `table`:
// INVALID_ARGUMENT naming the first that does not (FirstIdOutside, the
// backend's scan).
absl::Status CheckFeatureIds(absl::Span<const int64_t> ids, int64_t rows,
                             const std::string& feature, const std::string& table);

// Checks that every per-id weight is finite: INVALID_ARGUMENT "`what`
// weights[i] is x (NaN/Inf is refused)" for the first that is not.
absl::Status CheckWeights(absl::Span<const float> weights, const std::string& what = "");

// Checks that `grads` has the layout of a lookup's output: exactly `keys`
// in that order with widths `dims`, `batch` rows, values [batch, sum(dims)].
// INVALID_ARGUMENT naming the first difference.
absl::Status CheckGradientLayout(const KeyedTensorView& grads,
                                 const std::vector<std::string>& keys,
                                 const std::vector<int64_t>& dims, int64_t batch);

// One sequence (pooling NONE) feature's embeddings: one row per id, in the
// KJT's order, [num_ids, dim].
struct SequenceEmbeddingView {
  std::string key;
  int64_t dim = 0;
  absl::Span<const float> values;
};

struct SequenceEmbedding {
  std::string key;
  int64_t dim = 0;
  std::vector<float> values;

  SequenceEmbeddingView View() const { return {key, dim, values}; }
};

}  // namespace client
}  // namespace ember

#endif  // EMBER_CLIENT_KJT_H_
