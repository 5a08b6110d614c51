#include "server/backend/cuda/call_split.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"

namespace ember {
namespace backend {


bool Scratch::FitsLookup(const CallSize& size) const {
  const LookupLayout l = LayOutLookup(size, lookup_temp(size));
  return l.device_bytes <= device_bytes && l.host_bytes <= host_bytes;
}

bool Scratch::FitsGradients(const CallSize& size) const {
  const GradientLayout l = LayOutGradients(size, gradient_temp(size));
  return l.device_bytes <= device_bytes && l.in_bytes <= host_bytes;
}

namespace {

// The largest e in [lo, hi] with fits(e), given fits(lo) (and fits
// non-increasing in e).
template <typename Fits>
int64_t LargestFitting(int64_t lo, int64_t hi, Fits&& fits) {
  if (fits(hi)) return hi;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

std::string ScratchBytes(const Scratch& s) {
  return absl::StrCat(s.device_bytes, " bytes of device scratch and ", s.host_bytes,
                      " of staging");
}

}  // namespace

absl::Status ForEachLookupPiece(absl::Span<const LookupRequest> requests, const LookupPlan& plan,
                                const ShardResolver& shards, const Scratch& scratch,
                                const LookupRun& run, const CheckWhole& check_whole) {
  if (scratch.FitsLookup(SizeOf(plan))) return run(requests);
  if (check_whole) {
    if (absl::Status s = check_whole(); !s.ok()) return s;
  }
  std::vector<std::vector<LookupRequest>> pieces(1);
  CallSize cur;  // of pieces.back()
  // A piece is cut between units: the bags of a pooled request, the ids of
  // a NONE one (its output is per id, so a long sequence can be cut inside
  // a bag: those pieces see it as bags of one id).
  int64_t most_none_ids = 0;
  for (const LookupRequest& r : requests) {
    if (r.feature.pooling == Pooling::kNone) {
      most_none_ids = std::max(most_none_ids, static_cast<int64_t>(r.feature.ids.size()));
    }
  }
  const std::vector<int64_t> ones(most_none_ids, 1);
  std::vector<int64_t> id_at;  // a request's ids before each unit
  for (size_t i = 0; i < requests.size(); ++i) {
    const LookupRequest& r = requests[i];
    const FeatureRequest& f = r.feature;
    const backend::ShardSpec& spec = *shards(f.shard).spec;
    const bool per_id = f.pooling == Pooling::kNone;
    const int64_t units = static_cast<int64_t>(per_id ? f.ids.size() : f.lengths.size());
    id_at.assign(1, 0);
    for (int64_t u = 0; u < units; ++u) id_at.push_back(id_at.back() + (per_id ? 1 : f.lengths[u]));
    // The current piece with units [b, e) of this request added.
    auto with = [&](int64_t b, int64_t e) {
      CallSize s = cur;
      const int64_t ids = id_at[e] - id_at[b];
      s.requests += 1;
      s.bags += e - b;
      s.ids += ids;
      s.dense += (e - b) * spec.dim;
      s.weighted |= !f.weights.empty();
      return s;
    };
    int64_t b = 0;
    for (;;) {
      const int64_t e = LargestFitting(b, units, [&](int64_t e) {
        return scratch.FitsLookup(with(b, e));
      });
      const bool took_all = e == units && scratch.FitsLookup(with(b, e));
      if (e > b || took_all) {
        // The request whole (its stride, where its outputs go, whatever it
        // carries), then its piece's arrays.
        LookupRequest sub = r;
        sub.feature.lengths = per_id ? absl::MakeConstSpan(ones).subspan(0, e - b)
                                     : f.lengths.subspan(b, e - b);
        sub.feature.ids = f.ids.subspan(id_at[b], id_at[e] - id_at[b]);
        if (!f.weights.empty()) {
          sub.feature.weights = f.weights.subspan(id_at[b], id_at[e] - id_at[b]);
        }
        // The piece's output rows, at the request's stride.
        const int64_t stride = r.output_stride == 0 ? spec.dim : r.output_stride;
        sub.output = r.output.subspan(b * stride, e == b ? 0 : (e - b - 1) * stride + spec.dim);
        pieces.back().push_back(sub);
        cur = with(b, e);
        b = e;
        if (took_all) break;
      } else if (pieces.back().empty()) {
        const int64_t ids = b < units ? id_at[b + 1] - id_at[b] : 0;
        return absl::ResourceExhaustedError(absl::StrCat(
            backend::RequestWhat("lookup", i, spec), ": bag ", b, " has ", ids,
            " ids, more than fit in the backend's ", ScratchBytes(scratch),
            "; send fewer ids in one bag"));
      }
      // The piece is full: the rest of this request starts the next one.
      pieces.emplace_back();
      cur = CallSize{};
    }
  }
  for (const std::vector<LookupRequest>& piece : pieces) {
    if (piece.empty()) continue;
    if (absl::Status s = run(piece); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ForEachGradientPiece(absl::Span<const GradientRequest> requests,
                                  const GradientPlan& plan, const ShardResolver& shards,
                                  const Scratch& scratch, const GradientRun& run,
                                  const CheckWhole& check_whole) {
  if (scratch.FitsGradients(SizeOf(plan))) return run(requests);
  if (check_whole) {
    if (absl::Status s = check_whole(); !s.ok()) return s;
  }
  const int64_t n = static_cast<int64_t>(requests.size());
  const int64_t total = plan.total_ids;
  // Every id's sort key (as ExpandOne makes it), the factor on its gradient
  // row and where that row starts.
  std::vector<uint64_t> keys(total);
  std::vector<float> factor(total);
  std::vector<const float*> src(total);
  for (int64_t i = 0, p = 0; i < n; ++i) {
    const FeatureRequest& f = requests[i].feature;
    const cuda::GradDesc& d = plan.descs[i];
    int64_t k = 0;
    for (size_t bag = 0; bag < f.lengths.size(); ++bag) {
      const int64_t len = f.lengths[bag];
      const float mean = f.pooling == Pooling::kMean ? backend::math::MeanScale(len) : 1.0f;
      for (int64_t j = 0; j < len; ++j, ++k, ++p) {
        keys[p] = d.key_base + static_cast<uint64_t>(f.ids[k]);
        if (f.pooling == Pooling::kNone) {
          factor[p] = 1.0f;
          src[p] = requests[i].grad.data() + k * d.dim;
        } else {
          const bool weighted = !f.weights.empty();
          factor[p] = backend::math::IdScale(weighted, weighted ? f.weights[k] : 1.0f, mean);
          src[p] = requests[i].grad.data() + bag * d.dim;
        }
      }
    }
  }
  // The distinct keys in order, with prefix counts of their ids and
  // gradient floats; a key's slot (its shard) from the key bases.
  std::vector<uint64_t> sorted = keys;
  std::sort(sorted.begin(), sorted.end());
  auto slot_of = [&](uint64_t key) {
    return static_cast<int64_t>(
        std::upper_bound(plan.key_base.begin(), plan.key_base.end(), key) -
        plan.key_base.begin() - 1);
  };
  std::vector<uint64_t> unique;
  std::vector<int64_t> slot, ids_before{0}, dense_before{0};
  for (int64_t a = 0; a < total;) {
    int64_t e = a;
    while (e < total && sorted[e] == sorted[a]) ++e;
    unique.push_back(sorted[a]);
    slot.push_back(slot_of(sorted[a]));
    ids_before.push_back(ids_before.back() + (e - a));
    dense_before.push_back(dense_before.back() + (e - a) * plan.updates[slot.back()].dim);
    a = e;
  }
  const int64_t num_unique = static_cast<int64_t>(unique.size());
  // A piece of distinct keys [a, e): every id its own bag, weighted, at
  // most one request for each of the call's.
  auto size_of = [&](int64_t a, int64_t e) {
    CallSize s;
    s.requests = n;
    s.bags = s.ids = ids_before[e] - ids_before[a];
    s.dense = dense_before[e] - dense_before[a];
    s.shards = slot[e - 1] - slot[a] + 1;
    s.max_dim = plan.max_dim;
    s.end_bit = plan.end_bit;
    s.weighted = true;
    return s;
  };
  // Each piece's first key, and where its ids start among all the call's
  // (a piece holds every occurrence of its distinct keys).
  std::vector<uint64_t> first_key;
  std::vector<int64_t> piece_begin = {0};
  for (int64_t a = 0; a < num_unique;) {
    if (!scratch.FitsGradients(size_of(a, a + 1))) {
      const backend::ShardSpec& spec = *shards(plan.slots[slot[a]]).spec;
      return absl::ResourceExhaustedError(absl::StrCat(
          "row ", unique[a] - plan.key_base[slot[a]], " of table '", spec.table, "' occurs ",
          ids_before[a + 1] - ids_before[a], " times in one gradient call, more than fit in the ",
          "backend's ", ScratchBytes(scratch), "; split the batch"));
    }
    first_key.push_back(unique[a]);
    a = LargestFitting(a + 1, num_unique,
                       [&](int64_t e) { return scratch.FitsGradients(size_of(a, e)); });
    piece_begin.push_back(ids_before[a]);
  }
  // The ids of each piece, in call order.
  const int64_t num_pieces = static_cast<int64_t>(first_key.size());
  std::vector<int64_t> by_piece(total);
  {
    std::vector<int64_t> next(piece_begin.begin(), piece_begin.end() - 1);
    for (int64_t p = 0; p < total; ++p) {
      const int64_t k =
          std::upper_bound(first_key.begin(), first_key.end(), keys[p]) - first_key.begin() - 1;
      by_piece[next[k]++] = p;
    }
  }
  std::vector<int64_t> lengths, ids;
  std::vector<float> weights, grads;
  std::vector<GradientRequest> piece_requests;
  for (int64_t k = 0; k < num_pieces; ++k) {
    const int64_t b = piece_begin[k], e = piece_begin[k + 1];
    lengths.assign(e - b, 1);
    ids.resize(e - b);
    weights.resize(e - b);
    grads.clear();
    piece_requests.clear();
    std::vector<int64_t> counts;  // ids of each piece request
    int64_t r = -1;
    for (int64_t q = b; q < e; ++q) {
      const int64_t p = by_piece[q];
      // Positions grow within a piece, so requests come in order.
      const int64_t req = std::upper_bound(plan.id_begin.begin(), plan.id_begin.end(), p) -
                          plan.id_begin.begin() - 1;
      const cuda::GradDesc& d = plan.descs[req];
      if (req != r) {
        GradientRequest g;
        g.feature.shard = requests[req].feature.shard;
        g.feature.pooling = Pooling::kSum;
        piece_requests.push_back(g);
        counts.push_back(0);
        r = req;
      }
      ++counts.back();
      ids[q - b] = static_cast<int64_t>(keys[p] - d.key_base);
      weights[q - b] = factor[p];
      grads.insert(grads.end(), src[p], src[p] + d.dim);
    }
    // Spans into the piece's arrays, now that they are complete.
    int64_t id_at = 0, grad_at = 0;
    for (size_t j = 0; j < piece_requests.size(); ++j) {
      GradientRequest& g = piece_requests[j];
      const int64_t count = counts[j];
      const int64_t floats = count * shards(g.feature.shard).spec->dim;
      g.feature.lengths = absl::MakeConstSpan(lengths).subspan(id_at, count);
      g.feature.ids = absl::MakeConstSpan(ids).subspan(id_at, count);
      g.feature.weights = absl::MakeConstSpan(weights).subspan(id_at, count);
      g.grad = absl::MakeConstSpan(grads).subspan(grad_at, floats);
      id_at += count;
      grad_at += floats;
    }
    if (absl::Status s = run(piece_requests); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace backend
}  // namespace ember
