// A table's config (proto/collection.proto) as a backend shard spec, with
// the proto's documented defaults filled in.
//
// Thread-safe: pure functions.
#ifndef EMBER_SERVER_BACKEND_TABLE_SPEC_H_
#define EMBER_SERVER_BACKEND_TABLE_SPEC_H_

#include <cstdint>

#include "proto/collection.pb.h"
#include "server/backend/embedding_backend.h"

namespace ember {

// Rows [row_offset, row_offset + rows) and columns [col_offset, col_offset +
// cols) of `table`. The result still needs ValidateShardSpec.
backend::ShardSpec ShardSpecFromTable(const ember::v1::TableConfig& table, int64_t row_offset,
                                      int64_t col_offset, int64_t rows, int64_t cols);

backend::Pooling PoolingFromProto(ember::v1::TableConfig::Pooling p);

}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_TABLE_SPEC_H_
