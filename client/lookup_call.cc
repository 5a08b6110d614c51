// The lookup call (data_calls.h): requests built rank by rank and sent as
// soon as built, outputs merged into the caller's (or placed there by the
// workers, or copied into its device memory).
#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "client/data_calls.h"
#include "client/shared_buffer.h"

namespace ember {
namespace client {

using ember::v1::ShardFeature;
using ember::v1::TableConfig;

namespace {

// `b` as the request names it to a worker.
void SetSharedBuffer(const SharedBufferInfo& b, ember::v1::SharedBuffer* out) {
  out->set_id(b.id);
  out->set_pid(b.pid);
  out->set_fd(b.fd);
  out->set_size(b.size);
  out->set_nonce(b.nonce);
}

// Asks the worker of `request` (through a channel) to write the sinks whose
// job's output lies in a shared buffer straight there: the request's
// out_buffer and one placement per feature (row stride 0: not placed).
// Every sink keeps its channel slice, where a worker that cannot map the
// buffer writes instead. One buffer per request; `*placed_in` names it.
void Place(const std::vector<FeatureJob>& jobs,
           const std::vector<std::optional<SharedBufferInfo>>& shared,
           ember::v1::WorkerLookupRequest* request, std::vector<Sink>* sinks,
           std::optional<SharedBufferInfo>* placed_in) {
  const SharedBufferInfo* buffer = nullptr;
  for (Sink& sink : *sinks) {
    const std::optional<SharedBufferInfo>& b = shared[sink.job - jobs.data()];
    sink.placed = b.has_value() && (buffer == nullptr || b->id == buffer->id);
    if (sink.placed) buffer = &*b;
  }
  if (buffer == nullptr) return;
  SetSharedBuffer(*buffer, request->mutable_out_buffer());
  for (const Sink& sink : *sinks) {
    auto* p = request->add_placements();
    if (!sink.placed) continue;
    const float* first = sink.job->out + sink.col_offset;
    p->set_offset(reinterpret_cast<const char*>(first) - buffer->base);
    p->set_row_stride(sink.job->out_stride);
  }
  *placed_in = *buffer;
}

}  // namespace

absl::Status ReadPrimariesIfAsked(absl::Status s, uint64_t* pick) {
  if (HasSignal(s, kSignalReadPrimary)) *pick = kReadPrimaries;
  return s;
}

absl::Status RunLookup(const Client::Routing& r, std::vector<FeatureJob>* jobs,
                       uint64_t replica_pick, absl::Time deadline, const StubFor& stub_for,
                       const ChannelFor& channel_for, bool* poisoned, const StepTag& tag) {
  using LookupCall = Call<ember::v1::WorkerLookupRequest, ember::v1::WorkerLookupResponse>;
  // Transports (their channels) outlive the calls that use them (declared
  // first).
  std::vector<std::unique_ptr<Transport>> transports(r.info.worker_addresses_size());
  Fanout<LookupCall> fan(r, r.info.worker_addresses_size(), deadline, stub_for);
  // Each job's shards: every shard of a sharded table, one replica of a
  // data-parallel one.
  std::vector<std::vector<Client::Routing::Shard>> targets;
  for (const FeatureJob& j : *jobs) {
    targets.push_back(j.table->shards);
    if (!j.table->replicas.empty()) {
      targets.back() = {j.table->replicas[(replica_pick + j.order) % j.table->replicas.size()]};
    }
    // A replicated shard is read from any of its copies, spread as the
    // replicas are (from its primary after a backup asked for it).
    for (size_t s = 0; s < targets.back().size(); ++s) {
      Client::Routing::Shard& shard = targets.back()[s];
      if (shard.backups.empty() || replica_pick == kReadPrimaries) continue;
      const size_t pick = (replica_pick + j.order + s) % (shard.backups.size() + 1);
      if (pick > 0) shard.rank = shard.backups[pick - 1];
    }
  }
  // An output the caller did not clear: partial sums start from zero, and
  // a shard given no ids leaves its columns zero (below).
  for (FeatureJob& j : *jobs) {
    if (!j.out_zeroed && (j.table->row_split || j.sequence)) {
      ClearColumns(j.out, j.out_stride, j.sequence ? j.num_ids : j.batch, 0, j.dim);
    }
  }
  // The shared output buffer holding each job's output, if any: a pooled
  // shard's columns can go straight there (a row-split table's partial sums
  // and sequence rows cannot).
  std::vector<std::optional<SharedBufferInfo>> shared(jobs->size());
  for (size_t i = 0; i < jobs->size(); ++i) {
    const FeatureJob& j = (*jobs)[i];
    if (j.sequence || j.table->row_split || j.batch == 0 || j.out == nullptr) continue;
    shared[i] = SharedBuffers::Global().Find(
        j.out, ((j.batch - 1) * j.out_stride + j.dim) * sizeof(float));
  }
  std::optional<SharedBufferInfo> placed_in;  // the buffer any call was asked to write
  // The shared buffer holding the jobs' ids (the caller's KeyedJaggedTensor,
  // when its values are an IdBuffer large enough to be shared): a worker
  // reached through a channel reads those of all-rows shards there, in
  // place. One buffer per call: ids elsewhere are sent as arrays.
  std::optional<SharedBufferInfo> ids_in;
  std::vector<bool> ids_shared(jobs->size(), false);
  for (size_t i = 0; i < jobs->size(); ++i) {
    const FeatureJob& j = (*jobs)[i];
    if (j.num_ids == 0 || j.on_device) continue;
    auto b = SharedBuffers::Global().Find(j.ids, j.num_ids * sizeof(int64_t));
    if (!b.has_value() || (ids_in.has_value() && b->id != ids_in->id)) continue;
    ids_in = b;
    ids_shared[i] = true;
  }
  // Rank by rank: build the rank's request and send it.
  std::vector<std::vector<Sink>> sinks(fan.size());
  absl::Status link_failure;  // a link channel's bytes could not be sent
  absl::Status device_failure;  // a device array could not be copied
  DeviceStage* device_stage = nullptr;  // LookupOnDevice's, where it has device ids
  for (const FeatureJob& j : *jobs) {
    if (j.on_device) device_stage = j.stage;
  }
  for (int rank = 0; rank < fan.size(); ++rank) {
    LookupCall& c = fan[rank];
    c.request.set_collection(r.info.plan().collection());
    c.request.set_epoch(r.info.plan().epoch());
    if (tag.step >= 0) c.request.set_step(tag.step);
    uint64_t most = 0;
    for (size_t i = 0; i < jobs->size(); ++i) {
      for (const auto& shard : targets[i]) {
        if (shard.rank == rank) most += MostBytes((*jobs)[i], shard.cols);
      }
    }
    transports[rank] = TransportFor(r.info.worker_addresses(rank), most, channel_for);
    Transport* t = transports[rank].get();
    const bool name_ids = ids_in.has_value() && t->NamesBuffers();
    // Device ids for a worker reached without a link channel: from their
    // host copies (Bucketize), made once for the call.
    if (device_stage != nullptr && !t->Linked()) {
      if (auto ids = device_stage->Ids(); !ids.ok()) device_failure = ids.status();
      if (auto w = device_stage->Weights(); !w.ok()) device_failure = w.status();
      if (!device_failure.ok()) continue;  // nothing sent to this worker
    }
    for (size_t i = 0; i < jobs->size(); ++i) {
      FeatureJob& j = (*jobs)[i];
      const bool row_split = j.table->row_split;
      const bool send_mean = !row_split && j.table->config->pooling() == TableConfig::MEAN;
      for (const auto& shard : targets[i]) {
        if (shard.rank != rank) continue;
        Sink sink;
        sink.job = &j;
        sink.col_offset = shard.col_offset;
        sink.cols = shard.cols;
        ShardFeature f;
        int64_t local = 0;
        Bucketize(j, shard, send_mean, t, &f, j.sequence && row_split ? &sink.positions : nullptr,
                  &local, name_ids && ids_shared[i] ? &*ids_in : nullptr);
        if (f.has_buffer_ids() && !c.request.has_id_buffer()) {
          SetSharedBuffer(*ids_in, c.request.mutable_id_buffer());
        }
        if (local == 0) {  // nothing from this shard: its part is 0
          if (j.device_out != nullptr && !row_split) {
            absl::Status z = j.stage->ZeroRows(j.device_out + shard.col_offset, j.out_stride,
                                               shard.cols, j.batch);
            if (!z.ok() && device_failure.ok()) device_failure = z;
          } else if (!j.out_zeroed && !row_split && !j.sequence) {
            ClearColumns(j.out, j.out_stride, j.batch, shard.col_offset, shard.cols);
          }
          continue;
        }
        sink.rows = j.sequence ? local : j.batch;
        sink.index = c.request.features_size();
        *c.request.add_features() = std::move(f);
        c.used = true;
        sinks[rank].push_back(std::move(sink));
      }
    }
    if (c.used) {
      for (const Sink& sink : sinks[rank]) {
        t->AddOutput(&c.request, sink.rows * sink.cols * sizeof(float));
      }
      c.request.set_channel_id(t->channel_id());
      c.request.set_channel_seq(t->channel_seq());
      if (t->channel_id() != 0 && !t->Linked()) {
        Place(*jobs, shared, &c.request, &sinks[rank], &placed_in);
      }
      if (absl::Status s = t->Linked() ? t->Sending(c.request.mutable_link_sent(),
                                                    c.request.mutable_link_reply())
                                       : absl::OkStatus();
          !s.ok()) {
        t->Failed();
        c.used = false;  // not sent: the call fails below and is retried
        if (link_failure.ok()) link_failure = s;
      }
    }
    fan.Start(rank, [](ember::v1::Worker::Stub* stub, LookupCall* call, auto done) {
      stub->async()->Lookup(&call->ctx, &call->request, &call->response, done);
    });
  }
  // Rank by rank (rank 0's output merges while later ranks may still run),
  // each sink's rows land in its job's output: copied where the shard is the
  // only one for its columns, added (partial sums) where rows are split.
  // Any failure waits for every call first, then lets go of what a call
  // may have left unsafe (EndCalls).
  std::vector<bool> device_copies(fan.size(), false);  // queued on rank's link
  // Waits for the copies into the caller's device memory queued on the
  // links (a link that fails it is let go); the first failure.
  auto wait_copies = [&] {
    absl::Status first;
    for (int rank = 0; rank < fan.size(); ++rank) {
      if (!device_copies[rank]) continue;
      if (absl::Status s = transports[rank]->WaitCopies(deadline); !s.ok() && first.ok()) {
        first = absl::UnavailableError(absl::StrCat("worker ", rank, ": ", s.message()));
      }
    }
    return first;
  };
  auto failed = [&](absl::Status s) {
    (void)fan.WaitAll();
    // Queued copies finish before the caller hears of the failure (a retry,
    // or the caller, reuses that memory).
    (void)wait_copies();
    const CallEnds ends = EndCalls(fan, &transports, deadline);
    if (ends.unconfirmed && placed_in.has_value()) {
      // A worker whose call ended unconfirmed may still write into it.
      SharedBuffers::Global().Poison(placed_in->base + SharedBuffers::kHeaderBytes);
      if (poisoned != nullptr) *poisoned = true;
    }
    // A worker that could not map the ids' buffer: retried (UNAVAILABLE),
    // with ids as arrays.
    if (ends.id_buffer_refused) {
      return absl::UnavailableError(absl::StrCat(
          s.message(), "; sending the ids through the channel instead, and retrying"));
    }
    if (absl::IsInvalidArgument(s)) {
      if (absl::Status named = NameRefusedIds(*jobs); !named.ok()) return named;
    }
    return s;
  };
  if (!link_failure.ok()) return failed(link_failure);
  if (!device_failure.ok()) return failed(device_failure);
  std::vector<float> scratch;
  for (int rank = 0; rank < fan.size(); ++rank) {
    if (!fan.Wait(rank)) continue;  // failed or unused: WaitAll reports it
    const LookupCall& c = fan[rank];
    if (absl::Status st = transports[rank]->Received(deadline); !st.ok()) {  // link channels
      return failed(absl::UnavailableError(absl::StrCat("worker ", rank, ": ", st.message())));
    }
    for (const Sink& s : sinks[rank]) {
      if (s.placed && c.response.placed()) continue;  // already in place
      FeatureJob& dj = *s.job;
      if (dj.device_out != nullptr && !dj.table->row_split) {
        // Into the caller's device memory: over the link from its memory,
        // or from the answer's host bytes.
        const ember::v1::ShmSlice* slice =
            transports[rank]->Linked() && s.index < c.request.shm_outputs_size()
                ? &c.request.shm_outputs(s.index)
                : nullptr;
        absl::Status st;
        if (slice != nullptr) {
          if (slice->size() != static_cast<uint64_t>(dj.batch * s.cols * sizeof(float))) {
            return failed(
                absl::InternalError(absl::StrCat("worker ", rank, " returned a malformed output")));
          }
          st = transports[rank]->OutputToDevice(c.request, s.index, dj.device_out + s.col_offset,
                                                dj.out_stride * sizeof(float), s.cols);
          device_copies[rank] = true;
        } else {
          absl::Span<const float> host;
          st = transports[rank]->Output(c.request, c.response, s.index, &scratch, &host);
          if (st.ok() && host.size() != static_cast<size_t>(dj.batch * s.cols)) {
            return failed(
                absl::InternalError(absl::StrCat("worker ", rank, " returned a malformed output")));
          }
          if (st.ok()) {
            st = dj.stage->RowsToDevice(dj.device_out + s.col_offset, dj.out_stride, host.data(),
                                        s.cols, s.cols, dj.batch);
          }
        }
        if (!st.ok()) return failed(absl::UnavailableError(absl::StrCat("worker ", rank, ": ", st.message())));
        continue;
      }
      absl::Span<const float> buf;
      if (absl::Status st =
              transports[rank]->Output(c.request, c.response, s.index, &scratch, &buf);
          !st.ok()) {
        // UNAVAILABLE: a link lost while its outputs were copied out (the
        // call is retried); else the answer lacks the output.
        return failed(absl::Status(
            absl::IsUnavailable(st) ? absl::StatusCode::kUnavailable : absl::StatusCode::kInternal,
            absl::StrCat("worker ", rank, ": ", st.message())));
      }
      FeatureJob& j = *s.job;
      const int64_t rows = static_cast<int64_t>(buf.size()) / std::max<int64_t>(1, s.cols);
      if (rows * s.cols != static_cast<int64_t>(buf.size()) || (!j.sequence && rows != j.batch) ||
          (j.sequence && !s.positions.empty() &&
           rows != static_cast<int64_t>(s.positions.size()))) {
        return failed(
            absl::InternalError(absl::StrCat("worker ", rank, " returned a malformed output")));
      }
      const bool add = !j.sequence && j.table->row_split;
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t dst_row = j.sequence && !s.positions.empty() ? s.positions[i] : i;
        float* dst = j.out + dst_row * j.out_stride + s.col_offset;
        const float* src = buf.data() + i * s.cols;
        if (add) {
          for (int64_t col = 0; col < s.cols; ++col) dst[col] += src[col];
        } else {
          std::memcpy(dst, src, s.cols * sizeof(float));
        }
      }
    }
  }
  if (absl::Status s = fan.WaitAll(); !s.ok()) return failed(s);
  if (absl::Status s = wait_copies(); !s.ok()) return failed(s);
  // Row-split MEAN: the partial sums, divided by the bag's total length.
  for (FeatureJob& j : *jobs) {
    if (j.sequence || !j.table->row_split || j.table->config->pooling() != TableConfig::MEAN) continue;
    for (int64_t b = 0; b < j.batch; ++b) {
      if (j.lengths[b] == 0) continue;
      const float inv = 1.0f / static_cast<float>(j.lengths[b]);
      float* row = j.out + b * j.out_stride;
      for (int64_t c = 0; c < j.dim; ++c) row[c] *= inv;
    }
  }
  return absl::OkStatus();
}

}  // namespace client
}  // namespace ember
