// The client's two data calls over a collection's routing, one attempt
// each (Client::WithRetries retries them): a lookup (RunLookup,
// lookup_call.cc), a gradient update (RunGradients, gradient_call.cc) and a
// prefetch (RunPrefetch, prefetch_call.cc),
// both fanned out to the workers (fanout.h) with each job bucketized per
// shard (call_jobs.h). Private to //client:client.
#ifndef EMBER_CLIENT_DATA_CALLS_H_
#define EMBER_CLIENT_DATA_CALLS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/call_jobs.h"
#include "client/fanout.h"
#include "client/routing.h"

namespace ember {
namespace client {

// Lookup for pooled or sequence jobs into each job's `out`. Where the
// outputs lie in a shared output buffer (shared_buffer.h), workers reached
// through a channel are asked to write their pooled columns straight into
// it; on a failed call the buffer is poisoned (a worker may still write into
// it) and `*poisoned` set: the caller must not keep it. Ids the workers
// refused (PrepareJobs left them to their check) are named in the
// client's words (NameRefusedIds).
// `tag`'s step, where given, travels with every worker's request.
absl::Status RunLookup(const Client::Routing& r, std::vector<FeatureJob>* jobs,
                       uint64_t replica_pick, absl::Time deadline, const StubFor& stub_for,
                       const ChannelFor& channel_for, bool* poisoned = nullptr,
                       const StepTag& tag = {});

// The replica_pick that reads every replicated shard from its primary: a
// lookup's retry after a backup copy asked for it (kSignalReadPrimary).
constexpr uint64_t kReadPrimaries = ~uint64_t{0};
// `s`, having set *pick to kReadPrimaries if `s` asks for it.
absl::Status ReadPrimariesIfAsked(absl::Status s, uint64_t* pick);

// Gradients for pooled or sequence jobs (each job's grad/grad_stride set).
// `tag`'s step and rank, where given, travel with every worker's request;
// for a SYNC or BOUNDED collection every worker holding a shard of it gets
// one, with no gradients where this rank has none for it (its step counts
// the rank).
absl::Status RunGradients(const Client::Routing& r, std::vector<FeatureJob>* jobs,
                          const std::string& request_id, uint64_t digest, absl::Time deadline,
                          const StubFor& stub_for, const ChannelFor& channel_for,
                          const StepTag& tag = {});

// Prefetch for the jobs (pooled or sequence): each rank's shards of tables
// whose kernel caches rows (Routing::Table::caches_rows), every copy of a
// replicated one, get their ids in one prefetch request (inline: nothing
// comes back but a count); the rows the workers brought in.
absl::StatusOr<int64_t> RunPrefetch(const Client::Routing& r, std::vector<FeatureJob>* jobs,
                                    absl::Time deadline, const StubFor& stub_for);

}  // namespace client
}  // namespace ember

#endif  // EMBER_CLIENT_DATA_CALLS_H_
