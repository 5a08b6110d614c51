// A cache's hit-rate curve learned from its traffic: for every cache size
// at once (kLruCurveFractions of the shard's rows), the share of row
// accesses an LRU cache of that size would have hit.
//
// It follows SHARDS (Waldspurger et al., FAST '15): rows are sampled by a
// hash of the row at a fixed rate R (every row of a small shard; about
// `max_sampled` distinct rows of a large one), and each sampled access's
// reuse distance (distinct sampled rows since the row's last access) is
// computed exactly, with a Fenwick tree over access times. A distance d
// among sampled rows stands for d / R among all rows, so the access hits
// a cache of C rows when d < C * R. A row's first access misses at every
// size. With R = 1 the counts are exact (an LRU simulated at every size);
// with sampling they are an estimate whose error falls with max_sampled.
//
// Not thread-safe: the key_value backend calls it under its call lock.
#ifndef EMBER_SERVER_BACKEND_KEY_VALUE_LRU_CURVE_H_
#define EMBER_SERVER_BACKEND_KEY_VALUE_LRU_CURVE_H_

#include <array>
#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

class LruCurve {
 public:
  static constexpr int64_t kDefaultMaxSampled = 16384;
  using Hits = std::array<int64_t, kLruCurveFractions.size()>;

  // A shard of `rows` rows (>= 1).
  explicit LruCurve(int64_t rows, int64_t max_sampled = kDefaultMaxSampled);

  // One access of `row` (a call's distinct rows, each once).
  void Access(int64_t row);

  // Sampled accesses, and those that hit at each of kLruCurveFractions.
  int64_t sampled() const { return sampled_; }
  const Hits& hits() const { return hits_; }
  double rate() const { return rate_; }

 private:
  int64_t Prefix(int64_t t) const;  // live accesses at times <= t
  void Add(int64_t t, int delta);
  void Compact();  // times renumbered 0.., the tree rebuilt

  double rate_ = 1;
  uint64_t threshold_ = 0;  // sampled when the row's hash is <= it
  bool all_ = true;
  std::array<double, kLruCurveFractions.size()> limit_{};  // hit when distance < limit
  absl::flat_hash_map<int64_t, int64_t> last_;  // sampled row -> time of its last access
  std::vector<int32_t> tree_;                   // Fenwick: 1 at each row's last access
  int64_t now_ = 0;
  int64_t sampled_ = 0;
  Hits hits_{};
};

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_KEY_VALUE_LRU_CURVE_H_
