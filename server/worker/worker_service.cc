// WorkerService's data plane: channels (shared memory, id buffers, links),
// the lease and fence, and the Lookup and ApplyGradients handlers over the
// backend. Shard bookkeeping is worker_shards.cc; rows in and out (export,
// import, checkpoints) are worker_rows.cc.
#include "server/worker/worker_service.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "server/backend/overflow_guard.h"
#include "server/backend/table_spec.h"
#include "server/common/grpc_util.h"
#include "server/common/thread_reused.h"
#include "server/common/wire.h"
#include "server/worker/shard_names.h"

namespace ember {
namespace worker {

using ember::v1::ShardFeature;
using ember::v1::ShardRef;

// One feature's arrays, viewed in place in the request's bytes (copied into
// the vectors only when misaligned).
struct WorkerService::Decoded {
  std::vector<int64_t> lengths, ids;
  std::vector<float> weights, grad;
  backend::FeatureRequest request;
  absl::Span<const float> grad_view;
};

namespace {

// A client's shared buffer's header (SharedBuffer in proto/service.proto):
// no placement or id slice lies there.
constexpr uint64_t kSharedBufferHeaderBytes = 4096;

}  // namespace

// Leaves out of a gradient request what NaN/Inf touches (see
// WorkerServiceOptions::skip_nonfinite); the kept arrays are owned by *d.
absl::Status DropNonFinite(int64_t cols, const std::string& what, WorkerService::Decoded* d,
                           int64_t* skipped) {
  backend::FeatureRequest& r = d->request;
  if (backend::FirstNonFinite(d->grad_view) < 0 && backend::FirstNonFinite(r.weights) < 0) {
    return absl::OkStatus();
  }
  // The arrays must be consistent before they can be filtered.
  if (absl::Status s = backend::CheckLengths(r.lengths, static_cast<int64_t>(r.ids.size()), what);
      !s.ok()) {
    return s;
  }
  const bool seq = r.pooling == backend::Pooling::kNone;
  const int64_t grad_rows = seq ? static_cast<int64_t>(r.ids.size())
                                : static_cast<int64_t>(r.lengths.size());
  if (static_cast<int64_t>(d->grad_view.size()) != grad_rows * cols ||
      (!r.weights.empty() && r.weights.size() != r.ids.size())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": gradient or weights of the wrong size"));
  }
  auto row = [&](int64_t i) { return d->grad_view.data() + i * cols; };
  auto row_ok = [&](int64_t i) {
    return backend::FirstNonFinite(absl::MakeConstSpan(row(i), cols)) < 0;
  };
  std::vector<int64_t> lengths, ids;
  std::vector<float> weights, grad;
  int64_t k = 0, dropped = 0;
  for (size_t b = 0; b < r.lengths.size(); ++b) {
    const bool bag_ok = seq || row_ok(static_cast<int64_t>(b));
    int64_t kept = 0;
    for (const int64_t end = k + r.lengths[b]; k < end; ++k) {
      const bool ok = bag_ok && (r.weights.empty() || std::isfinite(r.weights[k])) &&
                      (!seq || row_ok(k));
      if (!ok) {
        ++dropped;
        continue;
      }
      ids.push_back(r.ids[k]);
      if (!r.weights.empty()) weights.push_back(r.weights[k]);
      if (seq) grad.insert(grad.end(), row(k), row(k) + cols);
      ++kept;
    }
    lengths.push_back(kept);
    if (!seq) {  // the row stays (the output's shape), zeroed when left out
      if (bag_ok) {
        grad.insert(grad.end(), row(b), row(b) + cols);
      } else {
        grad.insert(grad.end(), cols, 0.0f);
      }
    }
  }
  d->lengths = std::move(lengths);
  d->ids = std::move(ids);
  d->weights = std::move(weights);
  d->grad = std::move(grad);
  r.lengths = d->lengths;
  r.ids = d->ids;
  r.weights = d->weights;
  d->grad_view = d->grad;
  *skipped += dropped;
  return absl::OkStatus();
}

WorkerService::WorkerService(std::unique_ptr<backend::EmbeddingBackend> backend,
                             const WorkerServiceOptions& options)
    : backend_(std::move(backend)),
      options_(options),
      channels_(options.channel_idle_timeout, kMaxMessageBytes, options.max_channels,
                options.shm_dir, options.links) {}

namespace {

// Whose a shared-memory channel is: the call's credentials (empty without
// tokens, or in tests that call the service directly).
std::string OwnerOf(const grpc::ServerContext* ctx) {
  return std::string(AuthorizationOf(ctx).value_or(""));
}

bool InChannel(const ember::v1::ShardFeature& f) {
  return f.has_shm_lengths() || f.has_shm_ids() || f.has_shm_weights() || f.has_buffer_ids();
}

// Whether a feature's ids and weights are all in the channel (none inline,
// none in an id buffer): what leaves them in a link's device memory.
bool IdsAndWeightsInChannel(const ember::v1::ShardFeature& f) {
  return f.ids().empty() && f.weights().empty() && !f.has_buffer_ids();
}

// Which of a feature's arrays CopyIn copies out of the region: all; all but
// the ids (a lookup whose backend checks each id as it reads it views them
// in place); the lengths alone (the ids and weights stay in a link's device
// memory, where the backend reads them: DecodeFeature views them there).
enum class CopyOf { kAll, kAllButIds, kLengths };

// Copies a feature's arrays out of a channel's region into its bytes
// fields (`which` of them): inputs checked before use are never read in
// place, where the client could change them after they are checked.
absl::Status CopyIn(const ShmChannels::Region& region, const std::string& what,
                    ember::v1::ShardFeature* f, CopyOf which = CopyOf::kAll) {
  struct Array {
    const ember::v1::ShmSlice& slice;
    std::string* bytes;
    size_t align;
    const char* name;
  };
  for (const Array& a : {Array{f->shm_lengths(), f->mutable_lengths(), 8, "lengths"},
                         Array{f->shm_ids(), f->mutable_ids(), 8, "ids"},
                         Array{f->shm_weights(), f->mutable_weights(), 4, "weights"}}) {
    const bool is_lengths = a.bytes == f->mutable_lengths(), is_ids = a.bytes == f->mutable_ids();
    if (a.slice.size() == 0 || (which == CopyOf::kLengths && !is_lengths) ||
        (which == CopyOf::kAllButIds && is_ids)) {
      continue;
    }
    if (!a.bytes->empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": ", a.name, " given both inline and in the channel"));
    }
    auto bytes = region.Bytes(a.slice, a.align, absl::StrCat(what, " ", a.name));
    if (!bytes.ok()) return bytes.status();
    a.bytes->assign(bytes->data(), bytes->size());
  }
  f->clear_shm_lengths();
  if (which == CopyOf::kLengths) return absl::OkStatus();
  f->clear_shm_weights();
  if (which == CopyOf::kAll) f->clear_shm_ids();
  return absl::OkStatus();
}

// One of a call's arrays left in a link's device memory: its slice there
// (none: empty), which must lie in the link's memory at a multiple of
// sizeof(T). Never read here.
template <typename T>
absl::Status ViewInLink(const ShmChannels::Transfer& link, const ember::v1::ShmSlice& slice,
                        const char* name, absl::Span<const T>* out) {
  *out = {};
  if (slice.size() == 0) return absl::OkStatus();
  auto in = link.LinkBytes(slice, sizeof(T), name);
  if (!in.ok()) return in.status();
  *out = absl::Span<const T>(reinterpret_cast<const T*>(in->data()), in->size() / sizeof(T));
  return absl::OkStatus();
}

// One of a feature's arrays: its bytes field, or its slice of `region`
// (when given and the slice is set), viewed in place.
template <typename T>
absl::Status ViewArray(const std::string& bytes, const ember::v1::ShmSlice& slice,
                       const ShmChannels::Region* region, const char* name,
                       std::vector<T>* scratch, absl::Span<const T>* out) {
  if (region == nullptr || slice.size() == 0) return wire::View(bytes, name, scratch, out);
  if (!bytes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, " given both inline and in the channel"));
  }
  auto in = region->Bytes(slice, sizeof(T), name);
  if (!in.ok()) return in.status();
  if (in->size() % sizeof(T) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", in->size(), " bytes is not a whole number of ", sizeof(T),
                     "-byte values"));
  }
  *out = absl::Span<const T>(reinterpret_cast<const T*>(in->data()), in->size() / sizeof(T));
  return absl::OkStatus();
}

// The request a channel call's arrays are copied into (CopyIn): one per
// handler thread, kept between calls (ThreadReused), emptied after each and
// dropped above 64 MiB.
template <typename Request>
struct RequestCopyTraits {
  static constexpr size_t kKeptBytes = size_t{64} << 20;
  static size_t Bytes(const Request& r) { return r.SpaceUsedLong(); }
  static void Keep(Request* r) { r->Clear(); }
};
template <typename Request>
using ReusedCopy = ThreadReused<Request, RequestCopyTraits<Request>>;

}  // namespace

grpc::Status WorkerService::OpenChannel(grpc::ServerContext* ctx,
                                        const ember::v1::OpenChannelRequest* req,
                                        ember::v1::OpenChannelResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  if (!options_.shared_memory && req->link().empty()) {
    return ToGrpc(absl::FailedPreconditionError(
        "this worker offers no shared-memory channels (--shared_memory=false)"));
  }
  std::string link_id;
  auto id = channels_.Open(*req, OwnerOf(ctx), &link_id);
  if (!id.ok()) return ToGrpc(id.status());
  resp->set_channel_id(*id);
  resp->set_link_id(std::move(link_id));
  resp->set_idle_timeout_ms(absl::ToInt64Milliseconds(channels_.idle_timeout()));
  // Opened through /proc/<pid>/fd: the client's id buffers can be too.
  resp->set_reads_id_buffers(req->pid() != 0);
  return grpc::Status::OK;
}

grpc::Status WorkerService::CloseChannel(grpc::ServerContext* ctx,
                                         const ember::v1::CloseChannelRequest* req,
                                         ember::v1::CloseChannelResponse*) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  return ToGrpc(channels_.Close(req->channel_id(), OwnerOf(ctx)));
}

WorkerService::~WorkerService() = default;

absl::Status WorkerService::DecodeFeature(const Collection& c, const ShardFeature& f,
                                          const std::string* grad, int64_t* cols, Decoded* out,
                                          int64_t* skipped, const ShmChannels::Region* region,
                                          const ShmChannels::Region* id_buffer,
                                          const ShmChannels::Transfer* on_device,
                                          const ember::v1::ShmSlice* device_grad) const {
  auto shard = FindShard(c, f.shard());
  if (!shard.ok()) return shard.status();
  const std::string what = absl::StrCat("feature '", f.feature(), "' (", RefString(f.shard()), ")");
  backend::FeatureRequest& r = out->request;
  if (absl::Status s = wire::View(f.lengths(), "lengths", &out->lengths, &r.lengths); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
  }
  absl::Status viewed;
  if (f.has_buffer_ids()) {
    // Ids in the caller's id buffer (Lookup mapped it): read in place by a
    // backend that checks each id as it gathers, else copied out here, once,
    // before anything checks them.
    if (id_buffer == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": ids in an id buffer, which only a lookup through a channel names"));
    }
    if (f.has_shm_ids() || !f.ids().empty()) {  // (a copy out of the channel is in ids)
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ids given twice, in the id buffer and inline or in the channel"));
    }
    if (f.buffer_ids().offset() < kSharedBufferHeaderBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ids at byte ", f.buffer_ids().offset(), " of the id buffer, in its header"));
    }
    viewed = ViewArray(f.ids(), f.buffer_ids(), id_buffer, "ids", &out->ids, &r.ids);
    if (viewed.ok() && !backend_->ChecksIdsWhileGathering()) {
      out->ids.assign(r.ids.begin(), r.ids.end());
      r.ids = out->ids;
    }
  } else if (on_device != nullptr) {
    viewed = ViewInLink(*on_device, f.shm_ids(), "ids", &r.ids);
  } else {
    viewed = ViewArray(f.ids(), f.shm_ids(), region, "ids", &out->ids, &r.ids);
  }
  if (!viewed.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", viewed.message()));
  if (absl::Status s = on_device != nullptr
                           ? ViewInLink(*on_device, f.shm_weights(), "weights", &r.weights)
                           : wire::View(f.weights(), "weights", &out->weights, &r.weights);
      !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
  }
  if (grad != nullptr) {
    if (absl::Status s = on_device != nullptr && device_grad != nullptr
                             ? ViewInLink(*on_device, *device_grad, "grad", &out->grad_view)
                             : wire::View(*grad, "grad", &out->grad, &out->grad_view);
        !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
    }
  }
  // Their values are the backend's to check, on the device (ValidateFeature
  // below checks the shapes alone).
  r.on_device = on_device != nullptr;
  r.shard = (*shard)->id;
  r.pooling = PoolingFromProto(f.pooling());
  *cols = (*shard)->assignment.cols();
  if (grad != nullptr && options_.skip_nonfinite) {
    if (absl::Status s = DropNonFinite(*cols, what, out, skipped); !s.ok()) return s;
  }
  // Shape checks before any buffer is sized from the request. A lookup's
  // ids are checked by the backend, before anything runs or as it gathers
  // them (embedding_backend.h): one pass over them, not two. An
  // update's are checked here too, as parts already applied never reach the
  // backend and the whole request is still refused when one is bad; but
  // not in device memory (`on_device`): the backend checks those, and the
  // parts already applied go unchecked (nothing of them is applied).
  return backend::ValidateFeature(out->request, (*shard)->assignment.rows(), what,
                                  grad == nullptr ? backend::Checks::kShapesOnly
                                                  : backend::Checks::kAll);
}

namespace {

// The floats of output `index` ([size / cols, cols]) placed in `buffer` by
// `p`: from its offset to the last row's end. INVALID_ARGUMENT unless every
// row lies inside the buffer at a stride of at least cols.
absl::StatusOr<absl::Span<float>> Placement(const ShmChannels::Region& buffer,
                                            const ember::v1::OutputPlacement& p, int64_t size,
                                            int64_t cols, int index) {
  const std::string what = absl::StrCat("output ", index, "'s placement");
  const uint64_t stride = p.row_stride();
  const uint64_t floats = buffer.size() / 4;
  if (cols <= 0 || stride < static_cast<uint64_t>(cols) || stride > floats) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": row stride ", stride,
                                                   " floats for rows of ", cols, " in a buffer of ",
                                                   buffer.size(), " bytes"));
  }
  if (p.offset() < kSharedBufferHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", p.offset(),
                                                   " lies in the buffer's ", kSharedBufferHeaderBytes,
                                                   "-byte header"));
  }
  const uint64_t rows = static_cast<uint64_t>(size / cols);
  // The last row must start inside the buffer (checked by division, so
  // that no product overflows); Bytes checks its end.
  if (rows > 0 && rows - 1 > (floats - cols) / stride) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", rows, " rows at stride ", stride,
                                                   " lie outside the buffer's ", buffer.size(),
                                                   " bytes"));
  }
  ember::v1::ShmSlice extent;
  extent.set_offset(p.offset());
  extent.set_size(rows == 0 ? 0 : ((rows - 1) * stride + cols) * 4);
  auto bytes = buffer.Bytes(extent, 4, what);
  if (!bytes.ok()) return bytes.status();
  return absl::MakeSpan(reinterpret_cast<float*>(bytes->data()), bytes->size() / 4);
}

int64_t SteadyNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void WorkerService::SetLease(absl::Duration lease) {
  last_tick_ns_.store(SteadyNanos());
  lease_ns_.store(absl::ToInt64Nanoseconds(lease));
}

absl::Duration WorkerService::Tick() {
  const int64_t now = SteadyNanos();
  return absl::Nanoseconds(now - last_tick_ns_.exchange(now));
}

void WorkerService::Fence() { fenced_.store(true); }

void WorkerService::Unfence(const std::map<std::string, int64_t>& keep) {
  {
    absl::MutexLock lock(&mu_);
    for (auto it = collections_.begin(); it != collections_.end();) {
      auto k = keep.find(it->first);
      // A newer copy than the coordinator named is a create that raced
      // this answer: kept.
      if (k != keep.end() && it->second->epoch >= k->second) {
        ++it;
        continue;
      }
      LOG(WARNING) << "collection '" << it->first << "' epoch " << it->second->epoch
                   << ": moved elsewhere while this worker was paused; dropped";
      it = EraseCollection(it);
    }
  }
  (void)Tick();
  fenced_.store(false);
}

absl::StatusOr<WorkerService::DataCall> WorkerService::EnterDataCall(const char* what) {
  const int64_t lease = lease_ns_.load();
  if (lease > 0 && (fenced_.load() || SteadyNanos() - last_tick_ns_.load() > lease)) {
    return absl::UnavailableError(absl::StrCat(
        "this worker was paused past its lease (the coordinator may have moved its shards); ",
        what, " refused until the coordinator confirms what it holds: retry, refreshing the "
              "plan"));
  }
  const int64_t n = calls_in_progress_.fetch_add(1) + 1;
  DataCall call(&calls_in_progress_);
  if (options_.max_queued_calls > 0 && n > options_.max_queued_calls) {
    busy_refused_.fetch_add(1, std::memory_order_relaxed);
    return WithSignal(absl::ResourceExhaustedError(absl::StrCat(
                          kWorkerBusy, ": ", options_.max_queued_calls,
                          " data calls in progress (--max_queued_calls); ", what,
                          " refused, retry with back-off")),
                      kSignalWorkerBusy);
  }
  return call;
}

absl::Status WorkerService::RefuseBusy(const std::string& owner, uint64_t channel, uint64_t seq,
                                      const ember::v1::ShmSlice& sent, const absl::Status& busy) {
  if (channel == 0 || !channels_.IsLink(channel, owner)) return busy;
  // At most kMaxBusyReceives at once (they run outside max_queued_calls);
  // past that the channel is given up, its bytes not received.
  struct Held {
    std::atomic<int>* n;
    ~Held() { n->fetch_sub(1); }
  } held{&busy_receives_};
  if (busy_receives_.fetch_add(1) >= kMaxBusyReceives) {
    channels_.Abandon(channel, owner);
    return busy;
  }
  // Received, and nothing of it copied to the host (none of it is read).
  const std::vector<ember::v1::ShmSlice> none;
  auto taken = channels_.Use(channel, owner, seq, sent, &none);
  if (!taken.ok()) return taken.status();
  link_busy_kept_.fetch_add(1, std::memory_order_relaxed);
  return WithSignal(
      WithSignal(absl::ResourceExhaustedError(absl::StrCat(busy.message(), "; ", kLinkBytesTaken)),
                 kSignalWorkerBusy),
      kSignalLinkBytesTaken);
}

grpc::Status WorkerService::Lookup(grpc::ServerContext* ctx, const ember::v1::WorkerLookupRequest* req,
                                   ember::v1::WorkerLookupResponse* resp) {
  const absl::Time handler_start = absl::Now();
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  auto call = EnterDataCall("lookup");
  if (!call.ok()) {
    return ToGrpc(RefuseBusy(OwnerOf(ctx), req->channel_id(), req->channel_seq(),
                             req->link_sent(), call.status()));
  }
  // Through a channel: the outputs written into its region, the lengths
  // and weights copied out of it first, and the ids too unless the backend
  // checks each id as it gathers its row (then read in place: a client
  // that rewrites them during the call gets wrong rows of its own table
  // or a refusal, never a read outside the shard).
  const bool ids_in_place = backend_->ChecksIdsWhileGathering();
  // Through an NCCL link, to a backend that reads device memory: only the
  // lengths come to the host; the ids and weights stay in the link's device
  // memory, where the backend checks and reads them.
  std::vector<ember::v1::ShmSlice> host_slices;
  const bool device_reads =
      ReadsDeviceMemory() && !req->has_id_buffer() &&
      std::all_of(req->features().begin(), req->features().end(), IdsAndWeightsInChannel);
  bool inputs_on_device = false;
  std::shared_ptr<const ShmChannels::Region> region;
  ShmChannels::Transfer transfer;  // a link channel's: held to the end of the call
  ReusedCopy<ember::v1::WorkerLookupRequest> reused;
  ember::v1::WorkerLookupRequest& copied = *reused.get();
  if (req->channel_id() != 0) {
    if (device_reads) {
      for (const auto& f : req->features()) host_slices.push_back(f.shm_lengths());
    }
    auto r = channels_.Use(req->channel_id(), OwnerOf(ctx), req->channel_seq(), req->link_sent(),
                           device_reads ? &host_slices : nullptr);
    if (!r.ok()) return ToGrpc(r.status());
    transfer = *std::move(r);
    inputs_on_device = device_reads && transfer.link_memory_on_device();
    region = transfer.region();
    if (absl::Status s = transfer.CheckReply(req->link_reply(), req->shm_outputs()); !s.ok()) {
      return ToGrpc(s);
    }
    if (req->shm_outputs_size() != req->features_size()) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
          req->features_size(), " feature(s) but ", req->shm_outputs_size(), " output slice(s)")));
    }
    copied = *req;
    for (int i = 0; i < copied.features_size(); ++i) {
      const CopyOf which = inputs_on_device ? CopyOf::kLengths
                           : ids_in_place   ? CopyOf::kAllButIds
                                            : CopyOf::kAll;
      if (absl::Status s = CopyIn(*region, absl::StrCat("feature ", i), copied.mutable_features(i),
                                  which);
          !s.ok()) {
        return ToGrpc(s);
      }
    }
    req = &copied;
  } else if (req->shm_outputs_size() > 0 || req->has_link_sent() || req->has_link_reply() ||
             std::any_of(req->features().begin(), req->features().end(), InChannel)) {
    return ToGrpc(absl::InvalidArgumentError("shared-memory slices without a channel"));
  }
  // The client's id buffer (its KeyedJaggedTensor), when it names one:
  // features with buffer_ids take their ids there (DecodeFeature). One this
  // worker cannot map is refused (kIdBufferRefused): the client then sends
  // the ids through the channel.
  std::shared_ptr<const ShmChannels::Region> id_buffer;
  if (req->has_id_buffer()) {
    if (region == nullptr) {
      return ToGrpc(absl::InvalidArgumentError("an id buffer without a channel"));
    }
    auto mapped = channels_.MapBuffer(req->channel_id(), OwnerOf(ctx), req->id_buffer());
    if (absl::IsFailedPrecondition(mapped.status()) || absl::IsInvalidArgument(mapped.status())) {
      // Not a buffer this worker can map (another PID namespace, not the
      // client's, a size it does not take): the client's cue.
      return ToGrpc(WithSignal(absl::FailedPreconditionError(absl::StrCat(
                                   kIdBufferRefused, " ", mapped.status().message())),
                               kSignalIdBufferRefused));
    }
    if (!mapped.ok()) return ToGrpc(mapped.status());  // the channel's, or no memory
    id_buffer = *std::move(mapped);
  }
  // The client's output buffer, when it names one this worker can map:
  // placed outputs go straight into it. Otherwise they go to the channel's
  // slices (the client copies them), as without one.
  std::shared_ptr<const ShmChannels::Region> out_region;
  if (req->has_out_buffer() || req->placements_size() > 0) {
    if (region == nullptr) {
      return ToGrpc(absl::InvalidArgumentError("an output buffer without a channel"));
    }
    if (req->placements_size() != req->features_size()) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
          req->features_size(), " feature(s) but ", req->placements_size(), " placement(s)")));
    }
    auto mapped = channels_.MapBuffer(req->channel_id(), OwnerOf(ctx), req->out_buffer());
    if (mapped.ok()) {
      out_region = *std::move(mapped);
    } else {
      VLOG(1) << "lookup outputs through the channel: " << mapped.status();
    }
  }
  absl::ReaderMutexLock lock(&mu_);
  auto c = FindCollection(req->collection(), req->epoch());
  if (!c.ok()) return ToGrpc(c.status());
  const int n = req->features_size();
  std::vector<Decoded> decoded(n);
  std::vector<int64_t> cols(n);
  int64_t total_bytes = 0;
  for (int i = 0; i < n; ++i) {
    if (absl::Status s = DecodeFeature(**c, req->features(i), nullptr, &cols[i], &decoded[i],
                                       nullptr, ids_in_place ? region.get() : nullptr,
                                       id_buffer.get(), inputs_on_device ? &transfer : nullptr);
        !s.ok()) {
      return ToGrpc(s);
    }
    total_bytes += backend::OutputSize(decoded[i].request, cols[i]) * 4;
  }
  if (total_bytes > options_.max_response_bytes) {
    return ToGrpc(absl::ResourceExhaustedError(
        absl::StrCat("lookup output would be ", total_bytes, " bytes, over the limit of ",
                     options_.max_response_bytes, "; split the batch")));
  }
  std::vector<backend::LookupRequest> requests(n);
  // A link channel whose memory the backend writes (host memory of a socket
  // link for the CPU backend, device memory of an NCCL link for the CUDA
  // backend): the outputs go there and back over the link without a copy.
  const bool outputs_in_link =
      transfer.linked() && transfer.link_memory_on_device() == ReadsDeviceMemory();
  // Placed outputs a backend of packed outputs wrote into their slices:
  // copied into the placement afterwards.
  struct Move {
    const float* from;
    float* to;
    int64_t rows, cols, stride;
  };
  std::vector<Move> moves;
  for (int i = 0; i < n; ++i) {
    requests[i].feature = decoded[i].request;
    const int64_t size = backend::OutputSize(decoded[i].request, cols[i]);
    if (region == nullptr) {
      requests[i].output = wire::Resize<float>(resp->add_outputs(), size);
      continue;
    }
    // Straight into the link's memory, sent from there, or into the region.
    const std::string what = absl::StrCat("output ", i);
    auto bytes = outputs_in_link ? transfer.LinkBytes(req->shm_outputs(i), 4, what)
                                 : region->Bytes(req->shm_outputs(i), 4, what);
    if (!bytes.ok()) return ToGrpc(bytes.status());
    if (static_cast<int64_t>(bytes->size()) != size * 4) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
          what, ": its slice holds ", bytes->size(), " bytes; the output is ", size * 4)));
    }
    requests[i].output = absl::MakeSpan(reinterpret_cast<float*>(bytes->data()), size);
    requests[i].output_on_device = outputs_in_link && transfer.link_memory_on_device();
    if (outputs_in_link || out_region == nullptr || req->placements(i).row_stride() == 0) continue;
    auto placed = Placement(*out_region, req->placements(i), size, cols[i], i);
    if (!placed.ok()) return ToGrpc(placed.status());
    if (backend_->WritesStridedOutputs()) {
      requests[i].output = *placed;
      requests[i].output_stride = static_cast<int64_t>(req->placements(i).row_stride());
    } else {
      moves.push_back(Move{requests[i].output.data(), placed->data(), size / cols[i], cols[i],
                           static_cast<int64_t>(req->placements(i).row_stride())});
    }
  }
  const absl::Time lookup_start = absl::Now();
  const absl::Status looked_up = backend_->Lookup(requests);
  backend_lookup_ns_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - lookup_start),
                               std::memory_order_relaxed);
  if (const absl::Status& s = looked_up; !s.ok()) {
    resp->clear_outputs();
    return ToGrpc(s);
  }
  for (const Move& m : moves) {
    for (int64_t r = 0; r < m.rows; ++r) {
      std::memcpy(m.to + r * m.stride, m.from + r * m.cols, m.cols * sizeof(float));
    }
  }
  // A link channel's outputs go back over its link.
  if (absl::Status s = transfer.Reply(req->link_reply(), outputs_in_link); !s.ok()) {
    return ToGrpc(absl::UnavailableError(absl::StrCat("link channel: ", s.message())));
  }
  resp->set_placed(out_region != nullptr);
  int64_t ids = 0;
  for (const backend::LookupRequest& r : requests) ids += static_cast<int64_t>(r.feature.ids.size());
  lookups_.fetch_add(1, std::memory_order_relaxed);
  if (out_region != nullptr) placed_lookups_.fetch_add(1, std::memory_order_relaxed);
  if (id_buffer != nullptr) id_buffer_lookups_.fetch_add(1, std::memory_order_relaxed);
  if (transfer.linked()) link_lookups_.fetch_add(1, std::memory_order_relaxed);
  lookup_ids_.fetch_add(ids, std::memory_order_relaxed);
  lookup_bytes_.fetch_add(total_bytes + ids * 8, std::memory_order_relaxed);
  lookup_handler_ns_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - handler_start),
                               std::memory_order_relaxed);
  return grpc::Status::OK;
}

grpc::Status WorkerService::ApplyGradients(grpc::ServerContext* ctx,
                                           const ember::v1::WorkerApplyGradientsRequest* req,
                                           ember::v1::WorkerApplyGradientsResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  auto call = EnterDataCall("gradient update");
  if (!call.ok()) {
    return ToGrpc(RefuseBusy(OwnerOf(ctx), req->channel_id(), req->channel_seq(),
                             req->link_sent(), call.status()));
  }
  if (req->request_id().empty()) {
    channels_.Abandon(req->channel_id(), OwnerOf(ctx));
    return ToGrpc(absl::InvalidArgumentError("request_id is empty (needed for exactly-once)"));
  }
  // Through a channel: every array copied out of its region first, but
  // through an NCCL link to a backend that reads device memory, the
  // lengths alone (the ids, weights and gradients stay in the link's device
  // memory, checked and read there by the backend). Not with
  // skip_nonfinite, which reads the gradients here. The parts of a retried
  // update that were applied before are then not checked again (nothing of
  // them is applied).
  const bool device_reads =
      ReadsDeviceMemory() && !options_.skip_nonfinite &&
      std::all_of(req->gradients().begin(), req->gradients().end(),
                  [](const ember::v1::ShardGradient& g) {
                    return IdsAndWeightsInChannel(g.feature()) && g.grad().empty();
                  });
  bool inputs_on_device = false;
  ShmChannels::Transfer transfer;  // a link channel's: held to the end of the call
  ReusedCopy<ember::v1::WorkerApplyGradientsRequest> reused;
  ember::v1::WorkerApplyGradientsRequest& copied = *reused.get();
  if (req->channel_id() != 0) {
    std::vector<ember::v1::ShmSlice> host_slices;
    if (device_reads) {
      for (const auto& g : req->gradients()) host_slices.push_back(g.feature().shm_lengths());
    }
    auto used = channels_.Use(req->channel_id(), OwnerOf(ctx), req->channel_seq(),
                              req->link_sent(), device_reads ? &host_slices : nullptr);
    if (!used.ok()) return ToGrpc(used.status());
    transfer = *std::move(used);
    inputs_on_device = device_reads && transfer.link_memory_on_device();
    const std::shared_ptr<const ShmChannels::Region>* region = &transfer.region();
    copied = *req;
    for (int i = 0; i < copied.gradients_size(); ++i) {
      auto* g = copied.mutable_gradients(i);
      const std::string what = absl::StrCat("gradient ", i);
      if (absl::Status s = CopyIn(**region, what, g->mutable_feature(),
                                  inputs_on_device ? CopyOf::kLengths : CopyOf::kAll);
          !s.ok()) {
        return ToGrpc(s);
      }
      if (g->shm_grad().size() > 0 && !inputs_on_device) {
        if (!g->grad().empty()) {
          return ToGrpc(absl::InvalidArgumentError(
              absl::StrCat(what, ": grad given both inline and in the channel")));
        }
        auto bytes = (*region)->Bytes(g->shm_grad(), 4, what + " grad");
        if (!bytes.ok()) return ToGrpc(bytes.status());
        g->set_grad(bytes->data(), bytes->size());
        g->clear_shm_grad();
      }
    }
    req = &copied;
  } else if (req->has_link_sent() ||
             std::any_of(req->gradients().begin(), req->gradients().end(),
                         [](const ember::v1::ShardGradient& g) {
                           return InChannel(g.feature()) || g.has_shm_grad();
                         })) {
    return ToGrpc(absl::InvalidArgumentError("shared-memory slices without a channel"));
  }
  absl::ReaderMutexLock lock(&mu_);
  auto c = FindCollection(req->collection(), req->epoch());
  if (!c.ok()) return ToGrpc(c.status());
  Collection& coll = **c;
  absl::MutexLock apply(coll.apply_mu.get());
  const uint64_t id = RequestIdHash(req->request_id());
  const int n = req->gradients_size();
  std::vector<Decoded> decoded(n);
  std::vector<backend::GradientRequest> requests;
  std::set<const ShardEntry*> touched;
  int64_t skipped = 0;
  bool seen = false;
  // Counts a refusal for NaN/Inf (the message says so) and passes it on.
  auto refuse = [this](const absl::Status& s) {
    if (backend::IsNonFiniteRefusal(s)) {
      nonfinite_refused_.fetch_add(1, std::memory_order_relaxed);
    }
    if (backend::IsOverflowRefusal(s)) overflow_refused_.fetch_add(1, std::memory_order_relaxed);
    return ToGrpc(s);
  };
  // The whole request is checked; then only the parts whose shards have not
  // applied this id run (a retry after a partial failure or a move).
  for (int i = 0; i < n; ++i) {
    const auto& g = req->gradients(i);
    int64_t cols = 0;
    if (absl::Status s = DecodeFeature(coll, g.feature(), &g.grad(), &cols, &decoded[i], &skipped,
                                       nullptr, nullptr, inputs_on_device ? &transfer : nullptr,
                                       &g.shm_grad());
        !s.ok()) {
      return refuse(s);
    }
    const ShardEntry* entry = *FindShard(coll, g.feature().shard());
    if (entry->applied->Conflicts(id, req->request_digest())) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
          "request id '", req->request_id().substr(0, 128),
          "' was applied before to other ids or gradients; a request id names one update "
          "(retry it unchanged, or use a new id)")));
    }
    if (entry->applied->Contains(id)) {
      seen = true;
      continue;
    }
    requests.push_back({decoded[i].request, decoded[i].grad_view});
    touched.insert(entry);
  }
  if (requests.empty() && seen) {
    resp->set_duplicate(true);
    duplicates_.fetch_add(1, std::memory_order_relaxed);
    return grpc::Status::OK;
  }
  const absl::Time update_start = absl::Now();
  const absl::Status applied = backend_->ApplyGradients(requests);
  backend_update_ns_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - update_start),
                               std::memory_order_relaxed);
  if (!applied.ok()) return refuse(applied);
  int64_t ids = 0;
  for (const backend::GradientRequest& r : requests) ids += static_cast<int64_t>(r.feature.ids.size());
  updates_.fetch_add(1, std::memory_order_relaxed);
  update_ids_.fetch_add(ids, std::memory_order_relaxed);
  if (skipped > 0) {
    nonfinite_skipped_ids_.fetch_add(skipped, std::memory_order_relaxed);
    LOG_EVERY_N(WARNING, 100) << "collection '" << req->collection() << "': " << skipped
                              << " id(s) with NaN/Inf gradients or weights left out of an update";
  }
  const absl::Time now = absl::Now();
  int64_t early = 0;
  for (const ShardEntry* e : touched) {
    early += e->applied->Add(id, now, options_.dedup_ttl, options_.dedup_window,
                             req->request_digest());
  }
  if (early > 0) {
    dedup_forgotten_early_.fetch_add(early, std::memory_order_relaxed);
    LOG_EVERY_N(WARNING, 1000) << "collection '" << req->collection() << "': more than "
                               << options_.dedup_window << " update ids within "
                               << options_.dedup_ttl << " on a shard; forgetting the oldest early";
  }
  return grpc::Status::OK;
}

}  // namespace worker
}  // namespace ember
