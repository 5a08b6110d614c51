#include "server/backend/key_value/lru_curve.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "math/embedding_math.h"

namespace ember {
namespace backend {
namespace {

constexpr uint64_t kSampleSalt = 0x5d1c3a2b9e7f4c61ull;

}  // namespace

LruCurve::LruCurve(int64_t rows, int64_t max_sampled) {
  rows = std::max<int64_t>(rows, 1);
  max_sampled = std::max<int64_t>(max_sampled, 1);
  all_ = rows <= max_sampled;
  rate_ = all_ ? 1.0 : static_cast<double>(max_sampled) / static_cast<double>(rows);
  threshold_ = all_ ? ~uint64_t{0} : static_cast<uint64_t>(std::ldexp(rate_, 64));
  for (size_t i = 0; i < limit_.size(); ++i) {
    // The cache a key_value shard would have: ceil(fraction * rows) rows.
    const double cache = std::ceil(kLruCurveFractions[i] * static_cast<double>(rows));
    limit_[i] = cache * rate_;
  }
  tree_.assign(static_cast<size_t>(std::min<int64_t>(rows, max_sampled) * 2 + 1024), 0);
}

int64_t LruCurve::Prefix(int64_t t) const {
  int64_t sum = 0;
  for (int64_t i = t + 1; i > 0; i -= i & -i) sum += tree_[static_cast<size_t>(i - 1)];
  return sum;
}

void LruCurve::Add(int64_t t, int delta) {
  const int64_t n = static_cast<int64_t>(tree_.size());
  for (int64_t i = t + 1; i <= n; i += i & -i) tree_[static_cast<size_t>(i - 1)] += delta;
}

void LruCurve::Compact() {
  std::vector<std::pair<int64_t, int64_t>> by_time;  // (time, row)
  by_time.reserve(last_.size());
  for (const auto& [row, t] : last_) by_time.emplace_back(t, row);
  std::sort(by_time.begin(), by_time.end());
  const size_t size = std::max(tree_.size(), by_time.size() * 2 + 1024);
  tree_.assign(size, 0);
  for (size_t k = 0; k < by_time.size(); ++k) {
    last_[by_time[k].second] = static_cast<int64_t>(k);
    tree_[k] = 1;
  }
  // The tree built in O(size): each node adds its sum to its parent's.
  for (size_t i = 1; i <= size; ++i) {
    const size_t parent = i + (i & (~i + 1));
    if (parent <= size) tree_[parent - 1] += tree_[i - 1];
  }
  now_ = static_cast<int64_t>(by_time.size());
}

void LruCurve::Access(int64_t row) {
  if (!all_ && math::Mix64(static_cast<uint64_t>(row) ^ kSampleSalt) > threshold_) return;
  if (now_ == static_cast<int64_t>(tree_.size())) Compact();
  ++sampled_;
  auto [it, fresh] = last_.try_emplace(row, now_);
  if (!fresh) {
    // Distinct rows accessed since this one's last access.
    const int64_t live = static_cast<int64_t>(last_.size());
    const double distance = static_cast<double>(live - Prefix(it->second));
    for (size_t i = 0; i < limit_.size(); ++i) hits_[i] += distance < limit_[i];
    Add(it->second, -1);
    it->second = now_;
  }
  Add(now_, +1);
  ++now_;
}

}  // namespace backend
}  // namespace ember
