// A table's config (proto/collection.proto) as a backend shard spec, with
// the proto's documented defaults filled in.
//
// Thread-safe: pure functions.
#ifndef EMBER_SERVER_BACKEND_TABLE_SPEC_H_
#define EMBER_SERVER_BACKEND_TABLE_SPEC_H_

#include <cstdint>

#include "proto/collection.pb.h"
#include "proto/service.pb.h"
#include "server/backend/embedding_backend.h"

namespace ember {

// Rows [row_offset, row_offset + rows) and columns [col_offset, col_offset +
// cols) of `table`. The result still needs ValidateShardSpec.
backend::ShardSpec ShardSpecFromTable(const ember::v1::TableConfig& table, int64_t row_offset,
                                      int64_t col_offset, int64_t rows, int64_t cols);

// The spec of an assigned shard: ShardSpecFromTable, and for the
// key_value kernel its cache (ShardSpec::cache_rows: CacheRowsFor).
backend::ShardSpec ShardSpecOf(
    const ember::v1::ShardAssignment& a,
    int64_t min_cache_rows = backend::math::kKeyValueMinCacheRows);
// Whether an assigned shard's kernel caches its rows over a lower tier
// (math::KernelCachesRows: the key_value wrapper, with TierStats).
bool CachesRows(const ember::v1::ShardAssignment& a);
// ceil(rows * load_factor), at least min_cache_rows and at most rows
// (load_factor <= 0: 0.2, the planner's default).
int64_t CacheRowsFor(int64_t rows, double load_factor,
                     int64_t min_cache_rows = backend::math::kKeyValueMinCacheRows);

backend::Pooling PoolingFromProto(ember::v1::TableConfig::Pooling p);

// Sets every optimizer field a spec left unset to its documented default
// (proto/collection.proto: learning_rate 0.01, eps 1e-8, beta1 0.9, beta2
// 0.999); fields that are set, to 0 included, are kept.
void FillOptimizerDefaults(ember::v1::OptimizerSpec* o);
// The same for every table of `spec`.
void FillOptimizerDefaults(ember::v1::CollectionSpec* spec);

// The training spec's defaults written in: step_timeout_s 300 where 0, and
// trainers 1 where 0 (ASYNC too: it then says nothing but is shown).
inline constexpr double kDefaultStepTimeoutS = 300;
void FillTrainingDefaults(ember::v1::CollectionSpec* spec);

}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_TABLE_SPEC_H_
