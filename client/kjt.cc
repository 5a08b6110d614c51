#include "client/kjt.h"

#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "server/common/id_range.h"

namespace ember {
namespace client {
namespace {

int64_t FirstNonFinite(absl::Span<const float> values) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace

absl::StatusOr<KeyedJaggedTensor> KeyedJaggedTensor::FromJagged(
    const std::vector<std::string>& keys,
    const std::vector<std::vector<std::vector<int64_t>>>& ids,
    const std::vector<std::vector<std::vector<float>>>& weights) {
  if (ids.size() != keys.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(keys.size(), " keys but ids for ", ids.size()));
  }
  if (!weights.empty() && weights.size() != keys.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(keys.size(), " keys but weights for ", weights.size()));
  }
  KeyedJaggedTensor kjt;
  kjt.keys = keys;
  for (size_t k = 0; k < keys.size(); ++k) {
    if (ids[k].size() != ids[0].size()) {
      return absl::InvalidArgumentError(absl::StrCat("key '", keys[k], "' has ", ids[k].size(),
                                                     " samples, key '", keys[0], "' has ",
                                                     ids[0].size()));
    }
    for (size_t b = 0; b < ids[k].size(); ++b) {
      kjt.lengths.push_back(static_cast<int64_t>(ids[k][b].size()));
      kjt.values.insert(kjt.values.end(), ids[k][b].begin(), ids[k][b].end());
      if (!weights.empty()) {
        if (weights[k].size() != ids[k].size() || weights[k][b].size() != ids[k][b].size()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "weights of key '", keys[k], "' sample ", b, " do not match its ids"));
        }
        kjt.weights.insert(kjt.weights.end(), weights[k][b].begin(), weights[k][b].end());
      }
    }
  }
  if (absl::Status s = kjt.Validate(); !s.ok()) return s;
  return kjt;
}

absl::Status KeyedJaggedTensor::Validate() const { return View().Validate(); }
int64_t KeyedJaggedTensor::batch_size() const { return View().batch_size(); }
std::vector<int64_t> KeyedJaggedTensor::key_offsets() const { return View().key_offsets(); }

absl::Status KjtView::Validate() const {
  std::set<std::string> seen;
  for (const std::string& k : keys) {
    if (k.empty()) return absl::InvalidArgumentError("a KJT key is empty");
    if (!seen.insert(k).second) {
      return absl::InvalidArgumentError(absl::StrCat("KJT key '", k, "' appears twice"));
    }
  }
  if (keys.empty()) {
    if (!lengths.empty() || !values.empty()) {
      return absl::InvalidArgumentError("a KJT without keys has lengths or values");
    }
    return absl::OkStatus();
  }
  if (lengths.size() % keys.size() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(lengths.size(), " lengths for ", keys.size(),
                                                   " keys: not a whole batch per key"));
  }
  int64_t total = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("lengths[", i, "] = ", lengths[i], " < 0"));
    }
    if (__builtin_add_overflow(total, lengths[i], &total)) {
      return absl::InvalidArgumentError(absl::StrCat("lengths overflow int64 at [", i, "]"));
    }
  }
  if (total != static_cast<int64_t>(values.size())) {
    return absl::InvalidArgumentError(absl::StrCat("lengths sum to ", total, " but there are ",
                                                   values.size(), " values"));
  }
  if (!weights.empty() && weights.size() != values.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(weights.size(), " weights for ", values.size(), " values"));
  }
  return CheckWeights(weights);
}

absl::Status CheckWeights(absl::Span<const float> weights, const std::string& what) {
  if (const int64_t i = FirstNonFinite(weights); i >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, "weights[", i, "] is ", weights[i], " (NaN/Inf is refused)"));
  }
  return absl::OkStatus();
}

int64_t KjtView::batch_size() const {
  return keys.empty() ? 0 : static_cast<int64_t>(lengths.size() / keys.size());
}

std::vector<int64_t> KjtView::key_offsets() const {
  std::vector<int64_t> off(keys.size() + 1, 0);
  const int64_t b = batch_size();
  for (size_t k = 0; k < keys.size(); ++k) {
    int64_t sum = 0;
    for (int64_t i = 0; i < b; ++i) sum += lengths[k * b + i];
    off[k + 1] = off[k] + sum;
  }
  return off;
}

int64_t KeyedTensorView::row_width() const {
  int64_t w = 0;
  for (int64_t d : length_per_key) w += d;
  return w;
}

std::vector<int64_t> KeyedTensorView::offset_per_key() const {
  std::vector<int64_t> off(length_per_key.size() + 1, 0);
  for (size_t k = 0; k < length_per_key.size(); ++k) off[k + 1] = off[k] + length_per_key[k];
  return off;
}

int64_t KeyedTensor::row_width() const { return View().row_width(); }
std::vector<int64_t> KeyedTensor::offset_per_key() const { return View().offset_per_key(); }

absl::StatusOr<std::vector<float>> KeyedTensor::Get(const std::string& key) const {
  const std::vector<int64_t> off = offset_per_key();
  const int64_t width = row_width();
  for (size_t k = 0; k < keys.size(); ++k) {
    if (keys[k] != key) continue;
    std::vector<float> out;
    out.reserve(batch_size * length_per_key[k]);
    for (int64_t b = 0; b < batch_size; ++b) {
      const float* row = values.data() + b * width + off[k];
      out.insert(out.end(), row, row + length_per_key[k]);
    }
    return out;
  }
  return absl::NotFoundError(absl::StrCat("no key '", key, "' in the KeyedTensor"));
}

absl::Status CheckFeatureIds(absl::Span<const int64_t> ids, int64_t rows,
                             const std::string& feature, const std::string& table) {
  const int64_t j = FirstIdOutside(ids, rows);
  if (j < 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("feature '", feature, "': id ", ids[j],
                                                 " is outside [0, ", rows, ") of table '", table,
                                                 "'"));
}

absl::Status CheckGradientLayout(const KeyedTensorView& grads,
                                 const std::vector<std::string>& keys,
                                 const std::vector<int64_t>& dims, int64_t batch) {
  const size_t n = keys.size();
  if (grads.keys.size() != n || grads.length_per_key.size() != n || grads.batch_size != batch ||
      static_cast<int64_t>(grads.values.size()) != grads.batch_size * grads.row_width()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gradients must have the lookup's layout: ", n, " keys, batch ", batch,
        ", values [batch, sum of dims]; got ", grads.keys.size(), " keys, batch ",
        grads.batch_size, ", ", grads.values.size(), " values"));
  }
  for (size_t k = 0; k < n; ++k) {
    if (grads.keys[k] != keys[k] || grads.length_per_key[k] != dims[k]) {
      return absl::InvalidArgumentError(
          absl::StrCat("gradient key ", k, " is '", grads.keys[k], "' of width ",
                       grads.length_per_key[k], "; the lookup's is '", keys[k], "' of width ",
                       dims[k]));
    }
  }
  // Refused here, before any worker sees the call, so that no worker applies
  // its part while another refuses.
  if (const int64_t i = FirstNonFinite(grads.values); i >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gradient value [", i, "] is ", grads.values[i], " (NaN/Inf is refused)"));
  }
  return absl::OkStatus();
}

}  // namespace client
}  // namespace ember
