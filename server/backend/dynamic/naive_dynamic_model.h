// A naive model of DynamicIndex's rules (dynamic_index.h): a map of rows
// and a map of counts, every decision by a full scan. The reference for the
// index's and the dynamic backend's tests.
#ifndef EMBER_SERVER_BACKEND_DYNAMIC_NAIVE_DYNAMIC_MODEL_H_
#define EMBER_SERVER_BACKEND_DYNAMIC_NAIVE_DYNAMIC_MODEL_H_

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

class NaiveDynamicModel {
 public:
  NaiveDynamicModel(int64_t capacity, const DynamicConfig& c) : cap_(capacity), c_(c) {}
  // One update with every occurrence of `ids`; the ids it created rows
  // for, in first-occurrence order.
  std::vector<int64_t> Update(const std::vector<int64_t>& ids) {
    const int64_t t = ++step_;
    if (c_.ttl_steps > 0) {
      for (auto it = rows_.begin(); it != rows_.end();) {
        it = t - it->second.last > c_.ttl_steps ? rows_.erase(it) : std::next(it);
      }
    }
    // Distinct ids in the order of their first occurrence.
    std::vector<int64_t> order;
    std::map<int64_t, int64_t> count;
    for (int64_t id : ids) {
      if (count[id]++ == 0) order.push_back(id);
    }
    const int64_t threshold = std::max<int64_t>(c_.admit_after, 1);
    std::vector<int64_t> admit;
    for (int64_t id : order) {
      auto it = rows_.find(id);
      if (it != rows_.end()) {
        it->second.last = t;
        ++it->second.updates;
      } else if ((pending_[id] += count[id]) >= threshold) {
        admit.push_back(id);
      }
    }
    std::vector<int64_t> written, created;
    for (int64_t id : order) {
      if (rows_.count(id)) written.push_back(id);
    }
    Written(written);  // the rows updated, then those created
    written.clear();
    for (int64_t id : admit) {
      if (static_cast<int64_t>(rows_.size()) >= cap_) {
        auto victim = rows_.end();
        for (auto it = rows_.begin(); it != rows_.end(); ++it) {
          if (it->second.last == t) continue;
          if (victim == rows_.end() || Key(*it) < Key(*victim)) victim = it;
        }
        if (victim == rows_.end()) continue;  // no room
        rows_.erase(victim);
      }
      rows_[id] = Row{t, 1};
      pending_.erase(id);
      created.push_back(id);
      written.push_back(id);
    }
    Written(written);
    for (auto it = pending_.begin(); it != pending_.end();) {
      it = rows_.count(it->first) ? pending_.erase(it) : std::next(it);
    }
    return created;
  }
  bool Holds(int64_t id) const { return rows_.count(id) > 0; }
  // An import of `ids` (distinct, at most the capacity): every one written
  // at the current step, the new ones created (evicting rows not of the
  // import by the policy).
  void Import(const std::vector<int64_t>& ids) {
    std::vector<int64_t> sorted = ids;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> held;
    for (int64_t id : sorted) {
      if (rows_.count(id)) {
        rows_[id].last = step_;
        held.push_back(id);
      }
    }
    Written(held);  // the rows held, then those created
    std::vector<int64_t> created;
    std::map<int64_t, bool> in_import;
    for (int64_t id : sorted) in_import[id] = true;
    for (int64_t id : sorted) {
      if (rows_.count(id)) continue;
      if (static_cast<int64_t>(rows_.size()) >= cap_) {
        auto victim = rows_.end();
        for (auto it = rows_.begin(); it != rows_.end(); ++it) {
          if (in_import.count(it->first)) continue;
          if (victim == rows_.end() || Key(*it) < Key(*victim)) victim = it;
        }
        rows_.erase(victim);
      }
      rows_[id] = Row{step_, 1};
      pending_.erase(id);
      created.push_back(id);
    }
    Written(created);
  }
  std::vector<int64_t> Held() const {
    std::vector<int64_t> ids;
    for (const auto& [id, r] : rows_) ids.push_back(id);
    return ids;
  }

 private:
  struct Row {
    int64_t last, updates;
    int64_t seq = 0;  // when it was last written (LRU), by the rules' order
  };
  // Gives rows written, in that order (an update's updated rows, then its
  // created ones, each by first occurrence; an import's by ascending id).
  void Written(const std::vector<int64_t>& ids) {
    for (int64_t id : ids) {
      auto it = rows_.find(id);
      if (it != rows_.end()) it->second.seq = ++seq_;
    }
  }
  int64_t seq_ = 0;
  std::tuple<int64_t, int64_t, int64_t> Key(const std::pair<const int64_t, Row>& r) const {
    if (c_.eviction == Eviction::kLfu) return {r.second.updates, r.second.seq, 0};
    return {0, r.second.seq, 0};
  }
  const int64_t cap_;
  const DynamicConfig c_;
  int64_t step_ = 0;
  std::map<int64_t, Row> rows_;
  std::map<int64_t, int64_t> pending_;
};

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_DYNAMIC_NAIVE_DYNAMIC_MODEL_H_
