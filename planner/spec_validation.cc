#include "planner/spec_validation.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "planner/sharding_types.h"

namespace ember {
namespace planner {
namespace {

using ember::v1::CollectionSpec;
using ember::v1::ParameterConstraints;
using ember::v1::TableConfig;

// Collects violations; one status for all of them.
class Problems {
 public:
  template <typename... Args>
  void Add(const Args&... args) {
    lines_.push_back(absl::StrCat(args...));
  }
  absl::Status ToStatus(absl::string_view what) const {
    if (lines_.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid ", what, " (", lines_.size(), " problem",
        lines_.size() == 1 ? "" : "s", "):\n  ", absl::StrJoin(lines_, "\n  ")));
  }

 private:
  std::vector<std::string> lines_;
};

void CheckTraining(const ember::v1::TrainingSpec& t, Problems* p) {
  using ember::v1::TrainingSpec;
  if (!TrainingSpec::Mode_IsValid(t.mode())) {
    p->Add("training.mode ", static_cast<int>(t.mode()), " is not ASYNC, SYNC or BOUNDED");
    return;
  }
  const bool stepped = t.mode() != TrainingSpec::ASYNC;
  if (t.trainers() < 0 || t.trainers() > kMaxTrainingRanks) {
    p->Add("training.trainers must be in [1, ", kMaxTrainingRanks, "], got ", t.trainers());
  } else if (stepped && t.trainers() == 0) {
    p->Add("training.trainers must be given (>= 1) for ", TrainingSpec::Mode_Name(t.mode()));
  }
  if (t.mode() == TrainingSpec::BOUNDED) {
    if (t.max_staleness() < 1 || t.max_staleness() > kMaxStaleness) {
      p->Add("training.max_staleness must be in [1, ", kMaxStaleness, "] for BOUNDED, got ",
             t.max_staleness());
    }
  } else if (t.max_staleness() != 0) {
    p->Add("training.max_staleness is for BOUNDED; ", TrainingSpec::Mode_Name(t.mode()),
           " takes none, got ", t.max_staleness());
  }
  if (!(t.step_timeout_s() >= 0 && t.step_timeout_s() <= kMaxStepTimeoutS)) {
    p->Add("training.step_timeout_s must be in [0, ", kMaxStepTimeoutS, "] (0: 300), got ",
           t.step_timeout_s());
  }
  if (!TrainingSpec::Reduction_IsValid(t.gradient_reduction())) {
    p->Add("training.gradient_reduction ", static_cast<int>(t.gradient_reduction()),
           " is not MEAN or SUM");
  }
}

std::string TableLabel(const TableConfig& t, int index) {
  if (t.name().empty()) return absl::StrCat("table #", index);
  return absl::StrCat("table '", t.name(), "'");
}

void CheckOptimizer(const TableConfig& t, const std::string& label,
                    Problems* p) {
  const auto& o = t.optimizer();
  const double nonneg[] = {o.learning_rate(), o.eps(), o.weight_decay(),
                           o.initial_accumulator_value()};
  const char* names[] = {"learning_rate", "eps", "weight_decay",
                         "initial_accumulator_value"};
  for (int i = 0; i < 4; ++i) {
    if (!std::isfinite(nonneg[i]) || nonneg[i] < 0) {
      p->Add(label, ": optimizer.", names[i], " must be a finite value >= 0, got ",
             nonneg[i]);
    }
  }
  if (o.has_eps() && o.eps() == 0) {
    p->Add(label, ": optimizer.eps must be > 0, got 0 (leave it unset for the default, 1e-8)");
  }
  if (o.weight_decay() > 0 && o.type() == ember::v1::OptimizerSpec::SGD) {
    p->Add(label, ": optimizer.weight_decay is not supported with SGD (FBGEMM's exact SGD has none)");
  }
  if (o.weight_decay() > 0 && o.type() == ember::v1::OptimizerSpec::ADAGRAD &&
      o.weight_decay_mode() == ember::v1::OptimizerSpec::DEFAULT_DECAY) {
    p->Add(label, ": ADAGRAD has no weight decay in FBGEMM (EXACT_ADAGRAD); set "
           "optimizer.weight_decay_mode to L2 or DECOUPLE to apply weight_decay");
  }
  const double betas[] = {o.beta1(), o.beta2()};
  for (int i = 0; i < 2; ++i) {
    if (!(betas[i] >= 0 && betas[i] < 1)) {
      p->Add(label, ": optimizer.beta", i + 1, " must be in [0, 1), got ",
             betas[i]);
    }
  }
}

void CheckInitializer(const TableConfig& t, const std::string& label,
                      Problems* p) {
  const auto& init = t.initializer();
  if (init.type() == ember::v1::InitializerSpec::UNIFORM &&
      !(init.low() <= init.high())) {
    p->Add(label, ": initializer uniform needs low <= high, got [", init.low(),
           ", ", init.high(), "]");
  }
  if (init.type() == ember::v1::InitializerSpec::NORMAL &&
      !(init.std() >= 0 && std::isfinite(init.std()))) {
    p->Add(label, ": initializer normal needs a finite std >= 0, got ",
           init.std());
  }
}

void CheckPerFeature(const std::string& label, const char* field, int count,
                     int num_features, Problems* p) {
  if (count != 0 && count != num_features) {
    p->Add(label, ": constraints.", field, " has ", count,
           " values but the table has ", num_features,
           " feature(s); give one per feature or none");
  }
}

bool IsQuantized(const TableConfig& t) {
  return t.data_type() == ember::v1::INT8 || t.data_type() == ember::v1::INT4;
}

void CheckConstraints(const std::string& name, const ParameterConstraints& c,
                      const TableConfig* table, Problems* p) {
  const std::string label = absl::StrCat("constraints for '", name, "'");
  if (table == nullptr) {
    p->Add(label, ": no table named '", name, "' in the collection");
    return;
  }
  for (const std::string& s : c.sharding_types()) {
    auto parsed = ParseShardingType(s);
    if (!parsed.ok()) p->Add(label, ": ", parsed.status().message());
  }
  for (const std::string& k : c.compute_kernels()) {
    auto parsed = ParseComputeKernel(k);
    if (!parsed.ok()) p->Add(label, ": ", parsed.status().message());
    if (k == "key_value" && IsQuantized(*table)) {
      p->Add(label, ": key_value holds fp32 rows; ",
             ember::v1::DataType_Name(table->data_type()), " tables are held in memory");
    }
  }
  if (c.min_partition() < 0) {
    p->Add(label, ": min_partition must be >= 0, got ", c.min_partition());
  } else if (c.min_partition() > 0 && c.min_partition() % 4 != 0) {
    p->Add(label, ": min_partition must be a multiple of 4, got ",
           c.min_partition());
  }
  const int nf = table->feature_names_size();
  CheckPerFeature(label, "pooling_factors", c.pooling_factors_size(), nf, p);
  CheckPerFeature(label, "num_poolings", c.num_poolings_size(), nf, p);
  CheckPerFeature(label, "batch_sizes", c.batch_sizes_size(), nf, p);
  for (double v : c.pooling_factors()) {
    if (!std::isfinite(v) || v < 0) {
      p->Add(label, ": pooling_factors must be finite and >= 0, got ", v);
    }
  }
  for (double v : c.num_poolings()) {
    if (!std::isfinite(v) || v < 0) {
      p->Add(label, ": num_poolings must be finite and >= 0, got ", v);
    }
  }
  for (int v : c.batch_sizes()) {
    if (v <= 0) p->Add(label, ": batch_sizes must be > 0, got ", v);
  }
  if (!(c.cache_load_factor() >= 0 && c.cache_load_factor() <= 1)) {
    p->Add(label, ": cache_load_factor must be in [0, 1], got ",
           c.cache_load_factor());
  }
}

// INT8 / INT4 tables are row-wise quantized for serving: fixed, no
// optimizer state, held in memory.
void CheckDataType(const TableConfig& t, const std::string& label, Problems* p) {
  if (!ember::v1::DataType_IsValid(t.data_type())) {
    p->Add(label, ": data_type ", static_cast<int>(t.data_type()),
           " is not FP32, FP16, BF16, INT8 or INT4");
    return;
  }
  if (!IsQuantized(t)) return;
  const std::string type = ember::v1::DataType_Name(t.data_type());
  if (t.has_dynamic()) {
    p->Add(label, ": ", type, " tables are fixed (a dynamic table's rows are made by updates, "
           "which ", type, " rows do not take)");
  }
  if (t.optimizer().type() != ember::v1::OptimizerSpec::SGD) {
    p->Add(label, ": ", type, " tables are for serving and take no updates: leave "
           "optimizer.type unset (SGD), got ",
           ember::v1::OptimizerSpec::Type_Name(t.optimizer().type()));
  }
}

void CheckDynamic(const TableConfig& t, const std::string& label, Problems* p) {
  const ember::v1::DynamicTableSpec& d = t.dynamic();
  if (d.capacity() <= 0 || d.capacity() > kMaxRows) {
    p->Add(label, ": dynamic.capacity must be in [1, ", kMaxRows, "], got ", d.capacity());
  } else if (t.num_embeddings() != 0 && t.num_embeddings() != d.capacity()) {
    p->Add(label, ": num_embeddings is unused by a dynamic table: give 0 (or the capacity, ",
           d.capacity(), "), got ", t.num_embeddings());
  }
  if (d.admit_after() < 0) p->Add(label, ": dynamic.admit_after must be >= 0, got ", d.admit_after());
  if (d.ttl_steps() < 0) p->Add(label, ": dynamic.ttl_steps must be >= 0, got ", d.ttl_steps());
  if (!ember::v1::DynamicTableSpec::Eviction_IsValid(d.eviction())) {
    p->Add(label, ": dynamic.eviction ", static_cast<int>(d.eviction()), " is not LRU or LFU");
  }
}

}  // namespace

CollectionSpec WithDynamicRows(const CollectionSpec& spec) {
  CollectionSpec out = spec;
  for (TableConfig& t : *out.mutable_tables()) {
    if (t.has_dynamic() && t.num_embeddings() == 0) t.set_num_embeddings(t.dynamic().capacity());
  }
  return out;
}

absl::Status ValidateCollectionSpec(const CollectionSpec& spec) {
  Problems p;
  if (spec.tables_size() == 0) p.Add("the collection has no tables");
  if (spec.tables_size() > kMaxTables) {
    // Nothing more is read of a spec this large.
    p.Add("the collection has ", spec.tables_size(), " tables; at most ", kMaxTables);
    return p.ToStatus("collection spec");
  }
  absl::flat_hash_map<std::string, const TableConfig*> tables;
  absl::flat_hash_map<std::string, std::string> feature_owner;
  for (int i = 0; i < spec.tables_size(); ++i) {
    const TableConfig& t = spec.tables(i);
    const std::string label = TableLabel(t, i);
    if (t.name().empty()) {
      p.Add(label, ": name is empty");
    } else if (!tables.emplace(t.name(), &t).second) {
      p.Add(label, ": duplicate table name");
    }
    if (t.has_dynamic()) {
      CheckDynamic(t, label, &p);
    } else if (t.num_embeddings() <= 0) {
      p.Add(label, ": num_embeddings must be > 0, got ", t.num_embeddings());
    } else if (t.num_embeddings() > kMaxRows) {
      p.Add(label, ": num_embeddings must be at most ", kMaxRows, ", got ", t.num_embeddings());
    }
    if (t.embedding_dim() <= 0) {
      p.Add(label, ": embedding_dim must be > 0, got ", t.embedding_dim());
    } else if (t.embedding_dim() > kMaxEmbeddingDim) {
      p.Add(label, ": embedding_dim must be at most ", kMaxEmbeddingDim, ", got ",
            t.embedding_dim());
    }
    if (t.feature_names_size() == 0) p.Add(label, ": no feature_names");
    if (t.feature_names_size() > kMaxFeaturesPerTable) {
      p.Add(label, ": ", t.feature_names_size(), " feature_names; at most ",
            kMaxFeaturesPerTable);
    }
    for (const std::string& f : t.feature_names()) {
      if (f.empty()) {
        p.Add(label, ": empty feature name");
        continue;
      }
      auto [it, inserted] = feature_owner.emplace(f, t.name());
      if (!inserted) {
        p.Add(label, ": duplicate feature name '", f, "' (also in table '",
              it->second, "')");
      }
    }
    CheckOptimizer(t, label, &p);
    CheckInitializer(t, label, &p);
    CheckDataType(t, label, &p);
  }
  // Sorted for a deterministic message.
  std::vector<std::string> keys;
  for (const auto& [name, unused] : spec.constraints()) keys.push_back(name);
  std::sort(keys.begin(), keys.end());
  for (const std::string& name : keys) {
    auto it = tables.find(name);
    CheckConstraints(name, spec.constraints().at(name),
                     it == tables.end() ? nullptr : it->second, &p);
  }
  CheckTraining(spec.training(), &p);
  if (spec.replicas() < 0 || spec.replicas() > kMaxReplicas) {
    p.Add("replicas must be in [0, ", kMaxReplicas, "] (0 and 1: one copy), got ",
          spec.replicas());
  }
  return p.ToStatus("collection spec");
}

absl::Status ValidateTopology(const ember::v1::Topology& t) {
  Problems p;
  if (t.world_size() < 1) {
    p.Add("world_size must be >= 1, got ", t.world_size());
  } else if (t.world_size() > kMaxWorldSize) {
    p.Add("world_size must be at most ", kMaxWorldSize, ", got ", t.world_size());
    return p.ToStatus("topology");  // nothing more is read of a topology this large
  }
  if (t.local_world_size() < 0 ||
      (t.world_size() >= 1 && t.local_world_size() > t.world_size())) {
    p.Add("local_world_size must be in [1, world_size], got ",
          t.local_world_size());
  } else if (t.local_world_size() > 0 && t.world_size() >= 1 &&
             t.world_size() % t.local_world_size() != 0) {
    p.Add("world_size ", t.world_size(),
          " is not a multiple of local_world_size ", t.local_world_size());
  }
  if (t.hbm_cap_bytes() < 0) p.Add("hbm_cap_bytes must be >= 0");
  if (t.ddr_cap_bytes() < 0) p.Add("ddr_cap_bytes must be >= 0");
  if (t.batch_size() < 0 || t.batch_size() > kMaxBatchSize) {
    p.Add("batch_size must be in [0, ", kMaxBatchSize, "], got ", t.batch_size());
  }
  if (t.num_trainers() < 0 || t.num_trainers() > kMaxTrainers) {
    p.Add("num_trainers must be in [0, ", kMaxTrainers, "], got ", t.num_trainers());
  }
  for (const std::string& k : t.compute_kernels()) {
    auto parsed = ParseComputeKernel(k);
    if (!parsed.ok()) p.Add("compute_kernels: ", parsed.status().message());
  }
  if (t.devices_size() > t.world_size()) {
    p.Add(t.devices_size(), " device overrides for ", t.world_size(), " ranks");
    return p.ToStatus("topology");
  }
  absl::flat_hash_set<int> seen;
  for (const auto& d : t.devices()) {
    if (d.rank() < 0 || d.rank() >= t.world_size()) {
      p.Add("device override for rank ", d.rank(), " is outside [0, ",
            t.world_size(), ")");
    } else if (!seen.insert(d.rank()).second) {
      p.Add("two device overrides for rank ", d.rank());
    }
    if (d.hbm_bytes() < 0 || d.ddr_bytes() < 0) {
      p.Add("device override for rank ", d.rank(), " has a negative capacity");
    }
  }
  return p.ToStatus("topology");
}

absl::Status ValidatePlanInputs(const ember::v1::CollectionSpec& spec,
                                const ember::v1::Topology& topology) {
  if (absl::Status s = ValidateCollectionSpec(spec); !s.ok()) return s;
  if (absl::Status s = ValidateTopology(topology); !s.ok()) return s;
  if (topology.compute_device() == ember::v1::CUDA) {
    Problems p;
    for (int i = 0; i < spec.tables_size(); ++i) {
      const TableConfig& t = spec.tables(i);
      if (IsQuantized(t)) {
        p.Add(TableLabel(t, i), ": ", ember::v1::DataType_Name(t.data_type()),
              " tables are served by CPU workers (the CUDA kernels have no quantized rows yet)");
      }
      if (t.embedding_dim() % kCudaColumnMultiple != 0) {
        p.Add(TableLabel(t, i), ": embedding_dim ", t.embedding_dim(), " is not a multiple of ",
              kCudaColumnMultiple, ", which CUDA workers need (CPU workers take any dim)");
      }
    }
    if (absl::Status s = p.ToStatus("collection spec for CUDA workers"); !s.ok()) return s;
  }
  const int64_t table_ranks = int64_t{spec.tables_size()} * topology.world_size();
  if (table_ranks > kMaxTableRanks) {
    return absl::InvalidArgumentError(absl::StrCat(
        spec.tables_size(), " tables on ", topology.world_size(), " workers: a plan of at most ",
        kMaxTableRanks, " tables x workers (plan fewer tables at a time, or on fewer workers)"));
  }
  return absl::OkStatus();
}

}  // namespace planner
}  // namespace ember
