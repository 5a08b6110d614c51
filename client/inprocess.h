// InProcessCollection: a whole collection held in this process, in one CPU
// backend, behind the Client's data-plane API (Lookup, ApplyGradients,
// LookupSequence, ApplySequenceGradients, ExportTable). It is what the
// service must equal: the demo and the multi-process tests check the cluster
// against it, and service_bench measures the service against it.
//
// Independent of the client's routing: every table is one shard holding all
// of its rows (no bucketising, no partial sums, MEAN pooled by the backend).
// The one layout it copies from a plan is column blocks: given a plan, a
// column-wise table is held as the plan's column blocks, each its own table
// to the optimizer (ROWWISE_ADAGRAD keeps an accumulator per row per block),
// as the service and TorchRec do.
//
// Errors as the Client's: unknown feature/table NOT_FOUND; a malformed KJT,
// ids out of range, a pooled feature in a sequence call (or the reverse) or
// gradients not of the lookup's layout INVALID_ARGUMENT, nothing applied.
//
// Thread-safe as the backend is: lookups may run concurrently; a gradient
// call must not overlap other calls.
#ifndef EMBER_CLIENT_INPROCESS_H_
#define EMBER_CLIENT_INPROCESS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/kjt.h"
#include "proto/collection.pb.h"
#include "proto/plan.pb.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace client {

class InProcessCollection {
 public:
  // `plan` may be null (every table whole). `threads`: the backend's threads
  // per call.
  static absl::StatusOr<std::unique_ptr<InProcessCollection>> Create(
      const ember::v1::CollectionSpec& spec, const ember::v1::ShardingPlan* plan = nullptr,
      int threads = 1);

  absl::StatusOr<KeyedTensor> Lookup(const KeyedJaggedTensor& kjt);
  // The same into *out: its keys, dims and batch are set, and its values
  // kept when already of the size needed, so a caller that keeps one
  // KeyedTensor across steps allocates and clears nothing (every element is
  // written). On an error *out is unspecified.
  absl::Status Lookup(const KeyedJaggedTensor& kjt, KeyedTensor* out);
  absl::Status ApplyGradients(const KeyedJaggedTensor& kjt, const KeyedTensor& grads);
  absl::StatusOr<std::vector<SequenceEmbedding>> LookupSequence(const KeyedJaggedTensor& kjt);
  absl::Status ApplySequenceGradients(const KeyedJaggedTensor& kjt,
                                      const std::vector<SequenceEmbedding>& grads);
  absl::StatusOr<std::vector<float>> ExportTable(const std::string& table, int64_t* rows,
                                                 int64_t* dim);

 private:
  struct Block {
    backend::ShardId id;
    int64_t col_offset, cols;
  };
  struct Table {
    const ember::v1::TableConfig* config;
    std::vector<Block> blocks;
  };
  // One KJT key in a call, in the collection's feature order.
  struct Feature {
    std::string key;
    const Table* table;
    int order;
    backend::FeatureRequest request;  // shard unset: one request per block
    int64_t rows_out;                 // batch (pooled) or ids (sequence)
  };

  InProcessCollection() = default;
  // The KJT's features, their ids not yet checked: the backend checks them
  // once, in the call, so the ids are read once.
  absl::StatusOr<std::vector<Feature>> Features(const KeyedJaggedTensor& kjt, bool sequence) const;
  // A failed backend call's status; for ids out of range, the Client's
  // message (feature, table, position) instead of the backend's.
  static absl::Status Explained(const std::vector<Feature>& features, absl::Status backend_status);
  // One fused backend call that pools feature i's rows straight into
  // out[i] + r * strides[i], each column block at its column offset (the
  // CPU backend's strided outputs): no intermediate copy.
  absl::Status PoolInto(const std::vector<Feature>& features, const std::vector<float*>& out,
                        const std::vector<int64_t>& strides);
  // grads[f]: feature f's gradient, row r at grads[f] + r * strides[f].
  absl::Status ApplyFrom(const std::vector<Feature>& features,
                         const std::vector<const float*>& grads,
                         const std::vector<int64_t>& strides);

  ember::v1::CollectionSpec spec_;
  std::unique_ptr<backend::EmbeddingBackend> backend_;
  std::vector<Table> tables_;
  std::map<std::string, std::pair<int, int>> features_;  // -> (table, order)
};

}  // namespace client
}  // namespace ember

#endif  // EMBER_CLIENT_INPROCESS_H_
