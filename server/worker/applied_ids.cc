#include "server/worker/applied_ids.h"

#include <algorithm>

namespace ember {
namespace worker {

uint64_t RequestIdHash(const std::string& request_id) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : request_id) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  h += 0x9e3779b97f4a7c15ULL;
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
  return h ^ (h >> 31);
}

bool AppliedIds::Conflicts(uint64_t id, uint64_t digest) const {
  auto it = ids_.find(id);
  return it != ids_.end() && digest != 0 && it->second != 0 && it->second != digest;
}

int64_t AppliedIds::Add(uint64_t id, absl::Time now, absl::Duration ttl, int window,
                        uint64_t digest) {
  auto [it, fresh] = ids_.emplace(id, digest);
  if (fresh) {
    order_.emplace_back(id, now);
  } else if (it->second == 0) {
    it->second = digest;
  }
  return Trim(now, ttl, window);
}

int64_t AppliedIds::Merge(const std::vector<std::pair<uint64_t, absl::Time>>& entries,
                          absl::Time now, absl::Duration ttl, int window) {
  std::deque<std::pair<uint64_t, absl::Time>> merged;
  std::merge(order_.begin(), order_.end(), entries.begin(), entries.end(),
             std::back_inserter(merged),
             [](const auto& a, const auto& b) { return a.second < b.second; });
  // One entry per id: the oldest.
  order_.clear();
  absl::flat_hash_map<uint64_t, uint64_t> digests;  // this record's own
  digests.swap(ids_);
  for (const auto& e : merged) {
    auto known = digests.find(e.first);
    if (ids_.emplace(e.first, known == digests.end() ? 0 : known->second).second) {
      order_.push_back(e);
    }
  }
  return Trim(now, ttl, window);
}

std::vector<std::pair<uint64_t, absl::Time>> AppliedIds::Entries() const {
  return std::vector<std::pair<uint64_t, absl::Time>>(order_.begin(), order_.end());
}

int64_t AppliedIds::Trim(absl::Time now, absl::Duration ttl, int window) {
  int64_t early = 0;
  while (!order_.empty() &&
         (static_cast<int64_t>(order_.size()) > window || order_.front().second < now - ttl)) {
    if (order_.front().second >= now - ttl) ++early;
    ids_.erase(order_.front().first);
    order_.pop_front();
  }
  return early;
}

}  // namespace worker
}  // namespace ember
