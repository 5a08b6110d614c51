// Row change tracking over any backend, for incremental checkpoints:
// WithChangeTracking wraps a backend so that each of its shards keeps, per
// row, the generation in which an update or import last changed it
// (EmbeddingBackend::MarkChanges / ChangedRows).
//
//   generation  starts at 1; MarkChanges returns {lineage, g} and moves the
//               shard to g + 1, so a row changed after the mark carries a
//               larger generation than the mark's.
//   stamped     rows named by a successful ApplyGradients (ids in host
//               memory), ImportRows / ImportRowsAt (moves, restores, a
//               dynamic shard's admissions). An update whose ids are in
//               device memory (a link channel's) stamps the whole shard:
//               its ids never come to the host.
//   lineage     a random 64-bit name per shard created here: a mark of
//               another shard (another worker, an earlier incarnation) is
//               refused, and the caller writes the shard whole.
//
// Cost: 4 bytes of host memory per row (a uint32 generation) and one
// store per id an update names, after the wrapped backend's kernels.
// Lookups pass straight through.
//
// Thread-safe as the wrapped backend is; MarkChanges must not run while the
// shard is updated or imported (the worker holds its collection's update
// fence), or the mark may straddle an update.
#ifndef EMBER_SERVER_BACKEND_CHANGES_CHANGE_TRACKING_H_
#define EMBER_SERVER_BACKEND_CHANGES_CHANGE_TRACKING_H_

#include <memory>

#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

std::unique_ptr<EmbeddingBackend> WithChangeTracking(std::unique_ptr<EmbeddingBackend> inner);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CHANGES_CHANGE_TRACKING_H_
