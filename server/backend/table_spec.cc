#include "server/backend/table_spec.h"

#include <algorithm>
#include <cmath>

#include "math/embedding_math.h"

namespace ember {

using ember::v1::InitializerSpec;
using ember::v1::OptimizerSpec;
using ember::v1::TableConfig;

backend::Pooling PoolingFromProto(TableConfig::Pooling p) {
  switch (p) {
    case TableConfig::MEAN:
      return backend::Pooling::kMean;
    case TableConfig::NONE:
      return backend::Pooling::kNone;
    default:
      return backend::Pooling::kSum;
  }
}

backend::ShardSpec ShardSpecFromTable(const TableConfig& table, int64_t row_offset,
                                      int64_t col_offset, int64_t rows, int64_t cols) {
  backend::ShardSpec s;
  s.table = table.name();
  s.rows = rows;
  s.dim = cols;
  s.row_offset = row_offset;
  s.col_offset = col_offset;
  s.table_rows = table.num_embeddings();
  switch (table.data_type()) {
    case ember::v1::FP16:
      s.weight_type = backend::WeightType::kFp16;
      break;
    case ember::v1::BF16:
      s.weight_type = backend::WeightType::kBf16;
      break;
    case ember::v1::INT8:
      s.weight_type = backend::WeightType::kInt8;
      break;
    case ember::v1::INT4:
      s.weight_type = backend::WeightType::kInt4;
      break;
    default:
      s.weight_type = backend::WeightType::kFp32;
  }
  const OptimizerSpec& o = table.optimizer();
  switch (o.type()) {
    case OptimizerSpec::ADAGRAD:
      s.optimizer.type = backend::OptimizerType::kAdagrad;
      break;
    case OptimizerSpec::ROWWISE_ADAGRAD:
      s.optimizer.type = backend::OptimizerType::kRowwiseAdagrad;
      break;
    case OptimizerSpec::ADAM:
      s.optimizer.type = backend::OptimizerType::kAdam;
      break;
    default:
      s.optimizer.type = backend::OptimizerType::kSgd;
  }
  // Unset: the documented default (FillOptimizerDefaults); set: the value,
  // 0 included.
  ember::v1::OptimizerSpec filled = o;
  FillOptimizerDefaults(&filled);
  s.optimizer.learning_rate = static_cast<float>(filled.learning_rate());
  s.optimizer.eps = static_cast<float>(filled.eps());
  s.optimizer.beta1 = static_cast<float>(filled.beta1());
  s.optimizer.beta2 = static_cast<float>(filled.beta2());
  s.optimizer.weight_decay = static_cast<float>(o.weight_decay());
  switch (o.weight_decay_mode()) {
    case OptimizerSpec::L2:
      s.optimizer.weight_decay_mode = backend::WeightDecayMode::kL2;
      break;
    case OptimizerSpec::DECOUPLE:
      s.optimizer.weight_decay_mode = backend::WeightDecayMode::kDecouple;
      break;
    default:
      s.optimizer.weight_decay_mode = backend::WeightDecayMode::kDefault;
  }
  s.optimizer.stochastic_rounding = !o.round_to_nearest();
  s.optimizer.initial_accumulator_value = static_cast<float>(o.initial_accumulator_value());
  const InitializerSpec& i = table.initializer();
  switch (i.type()) {
    case InitializerSpec::UNIFORM:
      s.initializer.type = backend::InitializerType::kUniform;
      break;
    case InitializerSpec::NORMAL:
      s.initializer.type = backend::InitializerType::kNormal;
      break;
    case InitializerSpec::CONSTANT:
      s.initializer.type = backend::InitializerType::kConstant;
      break;
    default:
      s.initializer.type = backend::InitializerType::kDefault;
  }
  s.initializer.low = static_cast<float>(i.low());
  s.initializer.high = static_cast<float>(i.high());
  s.initializer.mean = static_cast<float>(i.mean());
  s.initializer.std = static_cast<float>(i.std());
  s.initializer.value = static_cast<float>(i.value());
  s.initializer.seed = i.seed();
  if (table.has_dynamic()) {
    const ember::v1::DynamicTableSpec& d = table.dynamic();
    s.is_dynamic = true;
    s.table_rows = d.capacity();
    s.dynamic.admit_after = d.admit_after();
    s.dynamic.ttl_steps = d.ttl_steps();
    s.dynamic.eviction = d.eviction() == ember::v1::DynamicTableSpec::LFU
                             ? backend::Eviction::kLfu
                             : backend::Eviction::kLru;
  }
  return s;
}

void FillOptimizerDefaults(ember::v1::OptimizerSpec* o) {
  if (!o->has_learning_rate()) o->set_learning_rate(0.01);
  if (!o->has_eps()) o->set_eps(1e-8);
  if (!o->has_beta1()) o->set_beta1(0.9);
  if (!o->has_beta2()) o->set_beta2(0.999);
}

void FillOptimizerDefaults(ember::v1::CollectionSpec* spec) {
  for (ember::v1::TableConfig& t : *spec->mutable_tables()) {
    FillOptimizerDefaults(t.mutable_optimizer());
  }
}

void FillTrainingDefaults(ember::v1::CollectionSpec* spec) {
  ember::v1::TrainingSpec* t = spec->mutable_training();
  if (t->step_timeout_s() == 0) t->set_step_timeout_s(kDefaultStepTimeoutS);
  if (t->trainers() == 0) t->set_trainers(1);
}

}  // namespace ember

namespace ember {

int64_t CacheRowsFor(int64_t rows, double load_factor, int64_t min_cache_rows) {
  if (rows <= 0) return 0;
  if (!(load_factor > 0)) load_factor = 0.2;
  const double want = std::ceil(static_cast<double>(rows) * std::min(load_factor, 1.0));
  return std::min(rows, std::max({static_cast<int64_t>(want), min_cache_rows, int64_t{1}}));
}

bool CachesRows(const ember::v1::ShardAssignment& a) {
  return backend::math::KernelCachesRows(a.compute_kernel());
}

backend::ShardSpec ShardSpecOf(const ember::v1::ShardAssignment& a, int64_t min_cache_rows) {
  backend::ShardSpec s =
      ShardSpecFromTable(a.table(), a.row_offset(), a.col_offset(), a.rows(), a.cols());
  const std::string& k = a.compute_kernel();
  if (CachesRows(a)) {
    s.cache_rows = CacheRowsFor(a.rows(), a.cache_load_factor(), min_cache_rows);
  }
  s.host_mapped = k == "fused_uvm" || k == "fused_uvm_caching";
  return s;
}

}  // namespace ember
