// A client call's jobs (call_jobs.h): preparing, checking and bucketizing.
#include "client/call_jobs.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/common/dynamic_route.h"
#include "server/common/wire.h"

namespace ember {
namespace client {

using ember::v1::ShardFeature;
using ember::v1::TableConfig;

void ClearColumns(float* out, int64_t stride, int64_t rows, int64_t col, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) std::fill_n(out + r * stride + col, cols, 0.0f);
}

void Bucketize(FeatureJob& job, const Client::Routing::Shard& shard, bool send_mean,
               Transport* t, ShardFeature* f, std::vector<int64_t>* positions,
               int64_t* num_local, const SharedBufferInfo* id_buffer) {
  f->mutable_shard()->set_table(job.table->config->name());
  f->mutable_shard()->set_shard_index(shard.index);
  f->set_feature(job.key);
  f->set_pooling(job.sequence ? TableConfig::NONE : send_mean ? TableConfig::MEAN : TableConfig::SUM);
  const bool all_rows = shard.rows == job.table->config->num_embeddings();
  const bool weighted = job.weights != nullptr;
  const bool ids_in_buffer = id_buffer != nullptr && all_rows && job.num_ids > 0;
  // A device KJT's ids and weights: straight from device memory over a
  // link channel, else from their host copies (loaded by the caller).
  const bool ids_on_device = job.on_device && t->Linked();
  const int64_t* src_ids = job.ids;
  const float* src_weights = job.weights;
  if (job.on_device && !ids_on_device) {
    const ptrdiff_t at = job.ids - job.stage->kjt().values;
    src_ids = *job.stage->Ids() + at;
    if (weighted) src_weights = *job.stage->Weights() + at;
  }
  auto lengths = t->TakeArray<int64_t>(f->mutable_lengths(), job.batch);
  absl::Span<int64_t> ids;
  absl::Span<float> weights;
  int64_t n = job.num_ids;
  if (ids_on_device) {  // all rows (LookupOnDevice keeps row-split ids on the host)
    if (job.batch > 0) std::memcpy(lengths.data(), job.lengths, job.batch * sizeof(int64_t));
    t->KeepArray<int64_t>(f->mutable_lengths(), [&] { return f->mutable_shm_lengths(); }, lengths);
    t->KeepOnDevice(f->mutable_ids(), [&] { return f->mutable_shm_ids(); }, job.ids,
                    n * sizeof(int64_t), n * sizeof(int64_t), 1);
    if (weighted) {
      t->KeepOnDevice(f->mutable_weights(), [&] { return f->mutable_shm_weights(); }, job.weights,
                      n * sizeof(float), n * sizeof(float), 1);
    }
    *num_local = n;
    return;
  }
  if (!ids_in_buffer) ids = t->TakeArray<int64_t>(f->mutable_ids(), job.num_ids);
  if (weighted) weights = t->TakeArray<float>(f->mutable_weights(), job.num_ids);
  if (all_rows) {
    if (job.batch > 0) std::memcpy(lengths.data(), job.lengths, job.batch * sizeof(int64_t));
    if (ids_in_buffer) {
      f->mutable_buffer_ids()->set_offset(reinterpret_cast<const char*>(job.ids) - id_buffer->base);
      f->mutable_buffer_ids()->set_size(n * sizeof(int64_t));
    } else if (n > 0) {
      std::memcpy(ids.data(), src_ids, n * sizeof(int64_t));
    }
    if (weighted && n > 0) std::memcpy(weights.data(), src_weights, n * sizeof(float));
  } else {
    // Sized for every id, cut to the ones in the shard's rows. Without a
    // branch per id (uniform ids miss a shard half the time, and every
    // mispredicted branch costs more than the id's copy): each id is
    // written at n (n <= k, inside the array), and n moves on when it is
    // the shard's.
    const uint64_t lo = static_cast<uint64_t>(shard.row_offset);
    const uint64_t rows = static_cast<uint64_t>(shard.rows);
    // route(id) = (the id's row relative to the shard's first, the id sent).
    auto cut = [&](auto route) {
      int64_t k = 0;
      n = 0;
      for (int64_t b = 0; b < job.batch; ++b) {
        const int64_t bag_start = n;
        for (const int64_t end = k + job.lengths[b]; k < end; ++k) {
          const auto [local, sent] = route(k);
          const bool in = local < rows;
          ids[n] = sent;
          if (weighted) weights[n] = src_weights[k];
          if (positions != nullptr && in) positions->push_back(k);
          n += in;
        }
        lengths[b] = n - bag_start;
      }
    };
    if (job.table->config->has_dynamic()) {
      // A dynamic table's ids go whole to the shard whose rows hold their
      // routing row (RouteRow: a fixed mix of the id, mod the capacity).
      std::vector<uint64_t>& routed = job.routing_rows;
      if (routed.size() != static_cast<size_t>(job.num_ids)) {
        const Router router(job.table->config->dynamic().capacity());
        routed.resize(job.num_ids);
        for (int64_t k = 0; k < job.num_ids; ++k) {
          routed[k] = static_cast<uint64_t>(router.Row(src_ids[k]));
        }
      }
      cut([&](int64_t k) { return std::make_pair(routed[k] - lo, src_ids[k]); });
    } else {
      cut([&](int64_t k) {
        const uint64_t local = static_cast<uint64_t>(src_ids[k]) - lo;
        return std::make_pair(local, static_cast<int64_t>(local));
      });
    }
  }
  t->KeepArray<int64_t>(f->mutable_lengths(), [&] { return f->mutable_shm_lengths(); }, lengths);
  if (!ids_in_buffer) {
    t->KeepArray<int64_t>(f->mutable_ids(), [&] { return f->mutable_shm_ids(); }, ids.first(n));
  }
  if (weighted) {
    t->KeepArray<float>(f->mutable_weights(), [&] { return f->mutable_shm_weights(); },
                        weights.first(n));
  }
  *num_local = n;
}

uint64_t MostBytes(const FeatureJob& job, int64_t cols) {
  using A = ShmTransport;
  const int64_t rows = job.sequence ? job.num_ids : job.batch;
  return A::Aligned(job.batch * sizeof(int64_t)) + A::Aligned(job.num_ids * sizeof(int64_t)) +
         (job.weights != nullptr ? A::Aligned(job.num_ids * sizeof(float)) : 0) +
         A::Aligned(rows * cols * sizeof(float));
}

// The job's ids against its table's rows (CheckFeatureIds); a dynamic
// table takes any int64 id.
absl::Status CheckJobIds(const FeatureJob& j) {
  if (j.table->config->has_dynamic()) return absl::OkStatus();
  return CheckFeatureIds(absl::MakeConstSpan(j.ids, j.num_ids), j.table->config->num_embeddings(),
                         j.key, j.table->config->name());
}

// The client's own message for the first id outside its table, if any.
absl::Status NameRefusedIds(const std::vector<FeatureJob>& jobs) {
  for (const FeatureJob& j : jobs) {
    FeatureJob host = j;
    if (j.on_device) {  // device ids: their host copy
      auto ids = j.stage->Ids();
      if (!ids.ok()) continue;
      host.ids = *ids + (j.ids - j.stage->kjt().values);
    }
    if (absl::Status s = CheckJobIds(host); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// Prepares one job per KJT key. `sequence`: the call is for NONE tables.
absl::Status PrepareJobs(const Client::Routing& r, const std::string& collection,
                         const KjtView& kjt, std::optional<bool> sequence,
                         std::vector<FeatureJob>* jobs,
                         IdCheck check) {
  if (absl::Status s = kjt.Validate(); !s.ok()) return s;
  const int64_t batch = kjt.batch_size();
  const std::vector<int64_t> off = kjt.key_offsets();
  jobs->clear();
  jobs->reserve(kjt.keys.size());
  for (size_t k = 0; k < kjt.keys.size(); ++k) {
    auto it = r.features.find(kjt.keys[k]);
    if (it == r.features.end()) {
      return absl::NotFoundError(
          absl::StrCat("feature '", kjt.keys[k], "' is not in collection '", collection, "'"));
    }
    FeatureJob j;
    j.key = kjt.keys[k];
    j.table = &r.tables[it->second.first];
    j.order = it->second.second;
    j.sequence = j.table->config->pooling() == TableConfig::NONE;
    if (sequence.has_value() && j.sequence != *sequence) {
      return absl::InvalidArgumentError(absl::StrCat(
          "feature '", j.key, "' is a ", j.sequence ? "sequence (NONE)" : "pooled",
          " feature: use ", j.sequence ? "LookupSequence/ApplySequenceGradients"
                                       : "Lookup/ApplyGradients"));
    }
    j.dim = j.table->config->embedding_dim();
    j.batch = batch;
    j.lengths = kjt.lengths.data() + k * batch;
    j.ids = kjt.values.data() + off[k];
    j.num_ids = off[k + 1] - off[k];
    if (!kjt.weights.empty()) {
      if (j.sequence) {
        return absl::InvalidArgumentError(
            absl::StrCat("feature '", j.key, "' is a sequence feature: per-id weights apply only to pooled features"));
      }
      j.weights = kjt.weights.data() + off[k];
    }
    if (check == IdCheck::kAll || (check == IdCheck::kRowSplit && j.table->row_split)) {
      if (absl::Status s = CheckJobIds(j); !s.ok()) return s;
    }
    jobs->push_back(std::move(j));
  }
  // The collection's order, whatever the KJT's.
  std::sort(jobs->begin(), jobs->end(),
            [](const FeatureJob& a, const FeatureJob& b) { return a.order < b.order; });
  return absl::OkStatus();
}

}  // namespace client
}  // namespace ember
