// The gradient update call (data_calls.h): one request per worker rank
// holding every shard's part (every shard gets one, ids or not), sent as
// built, or all at once after every device gradient's host copy was made.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/data_calls.h"
#include "server/common/wire.h"

namespace ember {
namespace client {

using ember::v1::TableConfig;

absl::Status RunGradients(const Client::Routing& r, std::vector<FeatureJob>* jobs,
                          const std::string& request_id, uint64_t digest, absl::Time deadline,
                          const StubFor& stub_for, const ChannelFor& channel_for,
                          const StepTag& tag) {
  // A stepped collection's update goes to every worker holding a shard of
  // it (gradients or none), so that every worker's step counts this rank.
  std::vector<bool> holds(r.info.worker_addresses_size(), false);
  const bool stepped = r.info.spec().training().mode() != ember::v1::TrainingSpec::ASYNC;
  if (stepped) {
    for (const Client::Routing::Table& t : r.tables) {
      for (const auto* list : {&t.shards, &t.replicas}) {
        for (const auto& shard : *list) holds[shard.rank] = true;
      }
    }
  }
  using GradCall = Call<ember::v1::WorkerApplyGradientsRequest, ember::v1::WorkerApplyGradientsResponse>;
  std::vector<std::unique_ptr<Transport>> transports(r.info.worker_addresses_size());
  Fanout<GradCall> fan(r, r.info.worker_addresses_size(), deadline, stub_for);
  auto targets_of = [](const FeatureJob& j) -> const std::vector<Client::Routing::Shard>& {
    return j.table->replicas.empty() ? j.table->shards : j.table->replicas;
  };
  // Rank by rank: build the rank's request and send it.
  absl::Status link_failure;  // a link channel's bytes could not be sent
  absl::Status device_failure;  // a device array could not be copied
  const bool defer = std::any_of(jobs->begin(), jobs->end(),
                                 [](const FeatureJob& j) { return j.device_grad != nullptr; });
  // Sends rank's call (its link bytes first) if its request carries anything.
  auto send = [&](int rank) {
    GradCall& call = fan[rank];
    Transport* t = transports[rank].get();
    if (call.used) {
      call.request.set_channel_id(t->channel_id());
      call.request.set_channel_seq(t->channel_seq());
      if (absl::Status s =
              t->Linked() ? t->Sending(call.request.mutable_link_sent(), nullptr) : absl::OkStatus();
          !s.ok()) {
        t->Failed();
        call.used = false;  // not sent: the update fails and is retried
        if (link_failure.ok()) link_failure = s;
      }
    }
    fan.Start(rank, [](ember::v1::Worker::Stub* stub, GradCall* c, auto done) {
      stub->async()->ApplyGradients(&c->ctx, &c->request, &c->response, done);
    });
  };
  for (int rank = 0; rank < fan.size(); ++rank) {
    GradCall& call = fan[rank];
    call.request.set_collection(r.info.plan().collection());
    call.request.set_epoch(r.info.plan().epoch());
    call.request.set_request_id(request_id);
    call.request.set_request_digest(digest);
    if (tag.step >= 0) call.request.set_step(tag.step);
    if (tag.rank >= 0) call.request.set_rank(tag.rank);
    if (holds[rank]) call.used = true;  // the worker's step counts this rank
    uint64_t most = 0;
    for (const FeatureJob& j : *jobs) {
      for (const auto& shard : targets_of(j)) {
        if (shard.rank == rank) most += MostBytes(j, shard.cols);
      }
    }
    transports[rank] = TransportFor(r.info.worker_addresses(rank), most, channel_for);
    Transport* t = transports[rank].get();
    for (FeatureJob& j : *jobs) {
      const std::vector<Client::Routing::Shard>& targets = targets_of(j);
      const bool row_split = j.table->row_split;
      const bool mean = j.table->config->pooling() == TableConfig::MEAN;
      for (const auto& shard : targets) {
        if (shard.rank != rank) continue;
        // Every shard gets a request, ids or not, so its optimizer step
        // stays the table's (Adam's bias correction counts calls).
        auto* g = call.request.add_gradients();
        call.used = true;
        std::vector<int64_t> positions;
        int64_t local = 0;
        Bucketize(j, shard, mean && !row_split, t, g->mutable_feature(),
                  j.sequence ? &positions : nullptr, &local);
        const bool all_rows = shard.rows == j.table->config->num_embeddings();
        const int64_t grad_rows = j.sequence ? local : j.batch;
        if (j.device_grad != nullptr) {
          if (t->Linked() && !(mean && row_split)) {  // device to link, no host copy
            t->KeepOnDevice(g->mutable_grad(), [&] { return g->mutable_shm_grad(); },
                            j.device_grad + shard.col_offset, j.grad_stride * sizeof(float),
                            shard.cols * sizeof(float), j.batch);
            continue;
          }
          if (j.grad == nullptr) {  // their host copy (scaled below, or sent inline)
            auto host = j.stage->Grads();
            if (!host.ok()) {
              if (device_failure.ok()) device_failure = host.status();
              continue;
            }
            j.grad = *host + (j.device_grad - j.stage->grads_base());
          }
        }
        auto dst = t->TakeArray<float>(g->mutable_grad(), grad_rows * shard.cols);
        if (j.sequence) {
          for (int64_t i = 0; i < local; ++i) {
            const int64_t src_row = all_rows ? i : positions[i];
            std::memcpy(dst.data() + i * shard.cols,
                        j.grad + src_row * j.grad_stride + shard.col_offset,
                        shard.cols * sizeof(float));
          }
        } else {
          for (int64_t b = 0; b < j.batch; ++b) {
            const float* src = j.grad + b * j.grad_stride + shard.col_offset;
            float* out = dst.data() + b * shard.cols;
            if (mean && row_split && stepped) {  // the worker scales, after its division
              std::memcpy(out, src, shard.cols * sizeof(float));
            } else if (mean && row_split) {  // d(sum/len)/d(row) = 1/len, the bag's total length
              const float inv = j.lengths[b] > 0 ? 1.0f / static_cast<float>(j.lengths[b]) : 0.0f;
              for (int64_t c = 0; c < shard.cols; ++c) out[c] = src[c] * inv;
            } else {
              std::memcpy(out, src, shard.cols * sizeof(float));
            }
          }
        }
        t->KeepArray<float>(g->mutable_grad(), [&] { return g->mutable_shm_grad(); }, dst);
        if (mean && row_split && stepped && !j.sequence) {
          g->set_mean_lengths(wire::Encode<int64_t>(absl::MakeConstSpan(j.lengths, j.batch)));
        }
      }
    }
    if (!defer) send(rank);
  }
  // Device gradients: every request built (their host copies made where
  // needed) before any worker is sent anything, so that a failed copy
  // leaves the update unapplied everywhere, not applied in part.
  if (defer && device_failure.ok()) {
    for (int rank = 0; rank < fan.size(); ++rank) send(rank);
  }
  absl::Status s = fan.WaitAll();
  // Link channels: each exchange that was answered waited for (its region
  // is then free, and its link in step, whatever the other ranks' calls
  // did).
  for (int rank = 0; rank < fan.size(); ++rank) {
    if (!fan[rank].started || !fan[rank].status.ok()) continue;
    if (absl::Status st = transports[rank]->Received(deadline); !st.ok() && s.ok()) {
      s = absl::UnavailableError(absl::StrCat("worker ", rank, ": ", st.message()));
    }
  }
  if (s.ok()) s = link_failure;
  if (s.ok()) s = device_failure;
  if (!s.ok()) (void)EndCalls(fan, &transports, deadline);
  return s;
}

}  // namespace client
}  // namespace ember
