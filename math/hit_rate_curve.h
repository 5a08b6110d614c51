// A cache's hit-rate curve: the share of a shard's row accesses an LRU
// cache of each size would hit, at cache sizes kLruCurveFractions of the
// shard's rows. Key_value shards learn one from their traffic
// (server/backend/key_value/lru_curve.h); the planner prices a cached
// table's reads by it where a calibration file has one (planner/cost_model.h).
#ifndef EMBER_MATH_HIT_RATE_CURVE_H_
#define EMBER_MATH_HIT_RATE_CURVE_H_

#include <array>
#include <cstddef>

namespace ember {
namespace backend {
namespace math {

inline constexpr std::array<double, 9> kLruCurveFractions = {0.01, 0.02, 0.05, 0.1, 0.2,
                                                             0.3,  0.5,  0.75, 1.0};

// The rate at `fraction` of a curve of kLruCurveFractions.size() points:
// linear between its points, from 0 at a cache of 0, its last point past 1.
inline double HitRateAt(const double* curve, double fraction) {
  const auto& f = kLruCurveFractions;
  if (!(fraction > 0)) return 0;
  if (fraction <= f[0]) return curve[0] * fraction / f[0];
  for (size_t i = 1; i < f.size(); ++i) {
    if (fraction <= f[i]) {
      return curve[i - 1] + (curve[i] - curve[i - 1]) * (fraction - f[i - 1]) / (f[i] - f[i - 1]);
    }
  }
  return curve[f.size() - 1];
}

}  // namespace math
}  // namespace backend
}  // namespace ember

#endif  // EMBER_MATH_HIT_RATE_CURVE_H_
