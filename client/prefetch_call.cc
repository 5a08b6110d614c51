// The prefetch call (data_calls.h): the ids of the shards that cache rows,
// sent to their workers in one request each, nothing read back but counts.
#include <vector>

#include "client/data_calls.h"

namespace ember {
namespace client {

absl::StatusOr<int64_t> RunPrefetch(const Client::Routing& r, std::vector<FeatureJob>* jobs,
                                    absl::Time deadline, const StubFor& stub_for) {
  using PrefetchCall = Call<ember::v1::WorkerLookupRequest, ember::v1::WorkerLookupResponse>;
  const int world = r.info.worker_addresses_size();
  // Each job's shards: every copy, since any of them may serve the batch's
  // lookup and every one applies its update.
  std::vector<std::vector<Client::Routing::Shard>> copies(jobs->size());
  for (size_t i = 0; i < jobs->size(); ++i) {
    if ((*jobs)[i].table->caches_rows) copies[i] = WithEveryCopy((*jobs)[i].table->shards);
  }
  InlineTransport inline_arrays;  // the ids travel in the message
  Fanout<PrefetchCall> fan(r, world, deadline, stub_for);
  for (int rank = 0; rank < world; ++rank) {
    PrefetchCall& c = fan[rank];
    c.request.set_collection(r.info.plan().collection());
    c.request.set_epoch(r.info.plan().epoch());
    c.request.set_prefetch(true);
    for (size_t i = 0; i < jobs->size(); ++i) {
      for (const Client::Routing::Shard& shard : copies[i]) {
        if (shard.rank != rank) continue;
        ember::v1::ShardFeature f;
        int64_t local = 0;
        Bucketize((*jobs)[i], shard, /*send_mean=*/false, &inline_arrays, &f, nullptr, &local);
        if (local == 0) continue;
        *c.request.add_features() = std::move(f);
        c.used = true;
      }
    }
    fan.Start(rank, [](ember::v1::Worker::Stub* stub, PrefetchCall* call, auto done) {
      stub->async()->Lookup(&call->ctx, &call->request, &call->response, done);
    });
  }
  if (absl::Status s = fan.WaitAll(); !s.ok()) return s;
  int64_t brought = 0;
  for (int rank = 0; rank < world; ++rank) {
    if (fan[rank].used) brought += fan[rank].response.prefetched_rows();
  }
  return brought;
}

}  // namespace client
}  // namespace ember
