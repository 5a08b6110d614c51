// A client call's jobs, one per KeyedJaggedTensor key (FeatureJob): prepared
// and checked against the collection's routing (PrepareJobs), then cut into
// one ShardFeature per shard (Bucketize: the ids in a shard's rows, made
// shard-local) through a request's Transport. Private to //client:client.
#ifndef EMBER_CLIENT_CALL_JOBS_H_
#define EMBER_CLIENT_CALL_JOBS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/client.h"
#include "client/device_stage.h"
#include "client/kjt.h"
#include "client/routing.h"
#include "client/shared_buffer.h"
#include "client/transport.h"
#include "proto/service.pb.h"

namespace ember {
namespace client {

// One KJT feature's part in a call.
struct FeatureJob {
  std::string key;
  const Client::Routing::Table* table = nullptr;
  int order = 0;  // position in the collection's feature order
  bool sequence = false;
  int64_t dim = 0, batch = 0, num_ids = 0;
  const int64_t* lengths = nullptr;
  const int64_t* ids = nullptr;
  const float* weights = nullptr;  // nullptr: unweighted
  float* out = nullptr;            // lookup: [batch or num_ids, dim], rows
  int64_t out_stride = 0;          //   out_stride floats apart
  bool out_zeroed = true;          //   false: RunLookup clears what it does not overwrite
  const float* grad = nullptr;     // gradients: same shape, row stride grad_stride
  int64_t grad_stride = 0;
  // LookupOnDevice / ApplyGradientsOnDevice: `stage` copies the call's
  // device arrays to the host where needed. `on_device`: ids and weights
  // are device pointers (an all-rows table's lookup); `device_out`: the
  // pooled output's place in device memory (out_stride floats a row;
  // `out` is then null, or a host matrix for row-split partial sums);
  // `device_grad`: the gradients' (grad_stride a row).
  DeviceStage* stage = nullptr;
  bool on_device = false;
  float* device_out = nullptr;
  const float* device_grad = nullptr;
  // A dynamic table's ids' routing rows (RouteRow), worked out by the
  // first Bucketize of the call and read by the rest (one per shard):
  // the hash and the modulo once an id, not once an id and shard. Calls
  // build their requests on one thread.
  std::vector<uint64_t> routing_rows;
};

// Where a shard request's output lands (sinks are kept per rank).
struct Sink {
  FeatureJob* job = nullptr;
  int index = 0;  // in the rank's request
  int64_t col_offset = 0, cols = 0;
  int64_t rows = 0;                // of its output: bags, or (sequence) ids
  std::vector<int64_t> positions;  // sequence, row-split: id index in the feature
  bool placed = false;             // placed in the caller's output buffer
};

// Zeroes columns [col, col + cols) of `rows` rows `stride` floats apart.
void ClearColumns(float* out, int64_t stride, int64_t rows, int64_t col, int64_t cols);

// Builds the ShardFeature of `job` for `shard` through `t`: the ids in the
// shard's rows (shard-local), their weights, and (sequence) their
// positions. `id_buffer` (lookups through a channel): the shared buffer
// holding job.ids, where a shard of all rows has the worker read them in
// place (buffer_ids) instead of taking a copy.
void Bucketize(FeatureJob& job, const Client::Routing::Shard& shard, bool send_mean,
               Transport* t, ember::v1::ShardFeature* f, std::vector<int64_t>* positions,
               int64_t* num_local, const SharedBufferInfo* id_buffer = nullptr);

// The most bytes a shard request of `job` can take (every id in the shard,
// its output or gradient in `cols` columns): sizes a channel's region.
uint64_t MostBytes(const FeatureJob& job, int64_t cols);

// Which ids PrepareJobs checks against their table's rows. Lookups leave
// the ids of a table whose every shard holds all its rows to the workers,
// which check each id anyway (NameRefusedIds names one they refuse); a
// row-split table's ids are checked here, as routing would drop an id
// outside every shard. Updates check every id here: a worker refusing one
// would come after others applied their part.
enum class IdCheck { kAll, kRowSplit, kNone };

// The job's ids against its table's rows (CheckFeatureIds).
absl::Status CheckJobIds(const FeatureJob& j);

// The client's own message for the first id outside its table, if any.
absl::Status NameRefusedIds(const std::vector<FeatureJob>& jobs);

// Prepares one job per KJT key, in the collection's feature order.
// `sequence`: the call is for NONE tables (false: pooled ones; none: either,
// a prefetch). NOT_FOUND for a key the
// collection does not have; INVALID_ARGUMENT for a malformed KJT, a pooled
// key in a sequence call or the reverse, weights on a sequence feature, or
// (per `check`) an id outside its table.
absl::Status PrepareJobs(const Client::Routing& r, const std::string& collection,
                         const KjtView& kjt, std::optional<bool> sequence,
                         std::vector<FeatureJob>* jobs,
                         IdCheck check = IdCheck::kAll);

}  // namespace client
}  // namespace ember

#endif  // EMBER_CLIENT_CALL_JOBS_H_
