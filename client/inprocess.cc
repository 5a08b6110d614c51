#include "client/inprocess.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "planner/plan_view.h"
#include "planner/spec_validation.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/dynamic/dynamic_backend.h"
#include "server/backend/table_spec.h"
#include "server/common/thread_reused.h"

namespace ember {
namespace client {

using ember::v1::TableConfig;

namespace {

// Per-block gradient buffers of one update, kept per thread between calls
// (ThreadReused) as they are, dropped above 64 MiB.
struct PartsTraits {
  static constexpr size_t kKeptBytes = size_t{64} << 20;
  static size_t Bytes(const std::vector<std::vector<float>>& parts) {
    size_t bytes = 0;
    for (const auto& p : parts) bytes += p.capacity() * sizeof(float);
    return bytes;
  }
  static void Keep(std::vector<std::vector<float>>*) {}
};
using ReusedParts = ThreadReused<std::vector<std::vector<float>>, PartsTraits>;

}  // namespace

absl::StatusOr<std::unique_ptr<InProcessCollection>> InProcessCollection::Create(
    const ember::v1::CollectionSpec& spec, const ember::v1::ShardingPlan* plan, int threads) {
  if (plan != nullptr && plan->tables_size() != spec.tables_size()) {
    return absl::InvalidArgumentError(absl::StrCat("the plan has ", plan->tables_size(),
                                                   " tables, the spec ", spec.tables_size()));
  }
  backend::CpuBackendOptions options;
  options.num_threads = threads;
  auto be = backend::CreateCpuBackend(options);
  if (!be.ok()) return be.status();
  std::unique_ptr<InProcessCollection> c(new InProcessCollection());
  c->spec_ = planner::WithDynamicRows(spec);
  c->backend_ = backend::WithDynamicShards(*std::move(be));
  int order = 0;
  for (int t = 0; t < c->spec_.tables_size(); ++t) {
    const TableConfig& config = c->spec_.tables(t);
    std::map<int64_t, int64_t> cols;  // col_offset -> cols: the plan's column blocks
    if (plan != nullptr) {
      for (const planner::PlacedBlock& b : planner::TableBlocks(
               plan->tables(t), config.num_embeddings(), config.embedding_dim())) {
        cols[b.col_offset] = b.cols;
      }
    }
    if (cols.empty()) cols[0] = config.embedding_dim();
    Table table{&config, {}};
    for (const auto& [offset, n] : cols) {
      auto id = c->backend_->CreateShard(
          ShardSpecFromTable(config, 0, offset, config.num_embeddings(), n));
      if (!id.ok()) return id.status();
      table.blocks.push_back({*id, offset, n});
    }
    c->tables_.push_back(std::move(table));
    for (const std::string& f : config.feature_names()) {
      if (!c->features_.emplace(f, std::make_pair(t, order++)).second) {
        return absl::InvalidArgumentError(absl::StrCat("feature '", f, "' is in two tables"));
      }
    }
  }
  return c;
}

absl::StatusOr<std::vector<InProcessCollection::Feature>> InProcessCollection::Features(
    const KeyedJaggedTensor& kjt, bool sequence) const {
  if (absl::Status s = kjt.Validate(); !s.ok()) return s;
  const int64_t batch = kjt.batch_size();
  const std::vector<int64_t> off = kjt.key_offsets();
  std::vector<Feature> out;
  for (size_t k = 0; k < kjt.keys.size(); ++k) {
    auto it = features_.find(kjt.keys[k]);
    if (it == features_.end()) {
      return absl::NotFoundError(absl::StrCat("feature '", kjt.keys[k], "' is not in collection '",
                                              spec_.name(), "'"));
    }
    Feature f;
    f.key = kjt.keys[k];
    f.table = &tables_[it->second.first];
    f.order = it->second.second;
    const TableConfig& config = *f.table->config;
    if ((config.pooling() == TableConfig::NONE) != sequence) {
      return absl::InvalidArgumentError(absl::StrCat(
          "feature '", f.key, "' is ", sequence ? "pooled" : "a sequence (NONE) feature",
          ": use ", sequence ? "Lookup/ApplyGradients" : "LookupSequence/ApplySequenceGradients"));
    }
    f.request.pooling = PoolingFromProto(config.pooling());
    f.request.lengths = absl::MakeConstSpan(kjt.lengths.data() + k * batch, batch);
    f.request.ids = absl::MakeConstSpan(kjt.values.data() + off[k], off[k + 1] - off[k]);
    if (!kjt.weights.empty()) {
      f.request.weights = absl::MakeConstSpan(kjt.weights.data() + off[k], off[k + 1] - off[k]);
    }
    f.rows_out = sequence ? static_cast<int64_t>(f.request.ids.size()) : batch;
    out.push_back(std::move(f));
  }
  std::sort(out.begin(), out.end(),
            [](const Feature& a, const Feature& b) { return a.order < b.order; });
  return out;
}

absl::Status InProcessCollection::Explained(const std::vector<Feature>& features,
                                            absl::Status backend_status) {
  if (backend_status.ok()) return backend_status;
  // The backend checked every id (each block holds all of its table's
  // rows), and refused the call before anything ran. Said again in the
  // feature's and the table's names, as the Client says it.
  for (const Feature& f : features) {
    const TableConfig& config = *f.table->config;
    if (config.has_dynamic()) continue;  // any int64 id
    if (absl::Status s =
            CheckFeatureIds(f.request.ids, config.num_embeddings(), f.key, config.name());
        !s.ok()) {
      return s;
    }
  }
  return backend_status;
}

absl::Status InProcessCollection::PoolInto(const std::vector<Feature>& features,
                                           const std::vector<float*>& out,
                                           const std::vector<int64_t>& strides) {
  // A request per (feature, column block), each writing its columns of the
  // destination rows. Pooling into buffers of its own and copying them over
  // measured 0.88-0.90 of the kernels' rate where this measured 0.93-0.95
  // (service_bench's kernel line, docs/lab-notes/2026-11-benchmarks.md).
  std::vector<backend::LookupRequest> requests;
  for (size_t i = 0; i < features.size(); ++i) {
    const Feature& f = features[i];
    for (const Block& b : f.table->blocks) {
      backend::LookupRequest r;
      r.feature = f.request;
      r.feature.shard = b.id;
      if (f.rows_out > 0) {
        r.output = absl::MakeSpan(out[i] + b.col_offset, (f.rows_out - 1) * strides[i] + b.cols);
      }
      r.output_stride = strides[i];
      requests.push_back(r);
    }
  }
  return Explained(features, backend_->Lookup(requests));
}

absl::Status InProcessCollection::ApplyFrom(const std::vector<Feature>& features,
                                            const std::vector<const float*>& grads,
                                            const std::vector<int64_t>& strides) {
  // Each block's gradient gathered into a part of its own, the parts kept
  // between calls (ReusedParts).
  ReusedParts reused;
  std::vector<std::vector<float>>& parts = *reused.get();
  size_t blocks = 0;
  for (const Feature& f : features) blocks += f.table->blocks.size();
  if (parts.size() < blocks) parts.resize(blocks);
  std::vector<backend::GradientRequest> requests;
  size_t p = 0;
  for (size_t i = 0; i < features.size(); ++i) {
    const Feature& f = features[i];
    for (const Block& b : f.table->blocks) {
      std::vector<float>& part = parts[p++];
      part.resize(f.rows_out * b.cols);  // every row is copied in below
      for (int64_t r = 0; r < f.rows_out; ++r) {
        std::memcpy(part.data() + r * b.cols, grads[i] + r * strides[i] + b.col_offset,
                    b.cols * sizeof(float));
      }
      backend::FeatureRequest req = f.request;
      req.shard = b.id;
      requests.push_back({req, part});
    }
  }
  return Explained(features, backend_->ApplyGradients(requests));
}

absl::StatusOr<KeyedTensor> InProcessCollection::Lookup(const KeyedJaggedTensor& kjt) {
  KeyedTensor kt;
  if (absl::Status s = Lookup(kjt, &kt); !s.ok()) return s;
  return kt;
}

absl::Status InProcessCollection::Lookup(const KeyedJaggedTensor& kjt, KeyedTensor* kt) {
  auto features = Features(kjt, /*sequence=*/false);
  if (!features.ok()) return features.status();
  kt->batch_size = kjt.batch_size();
  kt->keys.clear();
  kt->length_per_key.clear();
  for (const Feature& f : *features) {
    kt->keys.push_back(f.key);
    kt->length_per_key.push_back(f.table->config->embedding_dim());
  }
  // Pooled straight into the KeyedTensor's columns (a kept buffer of the
  // right size is neither reallocated nor cleared).
  kt->values.resize(kt->batch_size * kt->row_width());
  std::vector<float*> out;
  const std::vector<int64_t> offsets = kt->offset_per_key();
  for (size_t k = 0; k < kt->keys.size(); ++k) out.push_back(kt->values.data() + offsets[k]);
  return PoolInto(*features, out, std::vector<int64_t>(out.size(), kt->row_width()));
}

absl::Status InProcessCollection::ApplyGradients(const KeyedJaggedTensor& kjt,
                                                 const KeyedTensor& grads) {
  auto features = Features(kjt, /*sequence=*/false);
  if (!features.ok()) return features.status();
  std::vector<std::string> keys;
  std::vector<int64_t> dims;
  for (const Feature& f : *features) {
    keys.push_back(f.key);
    dims.push_back(f.table->config->embedding_dim());
  }
  if (absl::Status s = CheckGradientLayout(grads, keys, dims, kjt.batch_size()); !s.ok()) return s;
  const auto offsets = grads.offset_per_key();
  std::vector<const float*> ptrs;
  for (size_t k = 0; k < keys.size(); ++k) ptrs.push_back(grads.values.data() + offsets[k]);
  const std::vector<int64_t> strides(keys.size(), grads.row_width());
  return ApplyFrom(*features, ptrs, strides);
}

absl::StatusOr<std::vector<SequenceEmbedding>> InProcessCollection::LookupSequence(
    const KeyedJaggedTensor& kjt) {
  auto features = Features(kjt, /*sequence=*/true);
  if (!features.ok()) return features.status();
  std::vector<SequenceEmbedding> result;
  std::vector<float*> out;
  std::vector<int64_t> strides;
  for (const Feature& f : *features) {
    const int64_t dim = f.table->config->embedding_dim();
    result.push_back({f.key, dim, std::vector<float>(f.rows_out * dim)});
    strides.push_back(dim);
  }
  for (SequenceEmbedding& e : result) out.push_back(e.values.data());
  if (absl::Status s = PoolInto(*features, out, strides); !s.ok()) return s;
  return result;
}

absl::Status InProcessCollection::ApplySequenceGradients(
    const KeyedJaggedTensor& kjt, const std::vector<SequenceEmbedding>& grads) {
  auto features = Features(kjt, /*sequence=*/true);
  if (!features.ok()) return features.status();
  if (grads.size() != features->size()) {
    return absl::InvalidArgumentError(absl::StrCat(grads.size(), " gradient blocks for ",
                                                   features->size(), " sequence features"));
  }
  std::vector<const float*> ptrs;
  std::vector<int64_t> strides;
  for (const Feature& f : *features) {
    const int64_t dim = f.table->config->embedding_dim();
    auto g = std::find_if(grads.begin(), grads.end(),
                          [&](const SequenceEmbedding& e) { return e.key == f.key; });
    if (g == grads.end() || g->dim != dim ||
        static_cast<int64_t>(g->values.size()) != f.rows_out * dim) {
      return absl::InvalidArgumentError(absl::StrCat("feature '", f.key, "' needs a gradient of [",
                                                     f.rows_out, ", ", dim, "]"));
    }
    ptrs.push_back(g->values.data());
    strides.push_back(dim);
  }
  return ApplyFrom(*features, ptrs, strides);
}

absl::StatusOr<std::vector<float>> InProcessCollection::ExportTable(const std::string& table,
                                                                    int64_t* rows, int64_t* dim) {
  const Table* t = nullptr;
  for (const Table& candidate : tables_) {
    if (candidate.config->name() == table) t = &candidate;
  }
  if (t == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("no table '", table, "' in collection '", spec_.name(), "'"));
  }
  *rows = t->config->num_embeddings();
  *dim = t->config->embedding_dim();
  std::vector<float> out(*rows * *dim);
  for (const Block& b : t->blocks) {
    auto spec = backend_->GetShardSpec(b.id);
    if (!spec.ok()) return spec.status();
    std::vector<float> w(*rows * b.cols),
        state(*rows * backend::OptimizerStateWidth(spec->optimizer.type, b.cols));
    if (absl::Status s = backend_->ExportRows(b.id, 0, *rows, absl::MakeSpan(w),
                                              absl::MakeSpan(state));
        !s.ok()) {
      return s;
    }
    for (int64_t r = 0; r < *rows; ++r) {
      std::memcpy(out.data() + r * *dim + b.col_offset, w.data() + r * b.cols,
                  b.cols * sizeof(float));
    }
  }
  return out;
}

}  // namespace client
}  // namespace ember
