// The worker's request codec (request_codec.h): every transport's decoding
// of a data call's arrays, and a lookup's outputs back the way they came.
#include "server/worker/request_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/backend/table_spec.h"
#include "server/common/grpc_util.h"
#include "server/common/wire.h"
#include "server/worker/shard_names.h"

namespace ember {
namespace worker {

using ember::v1::ShardFeature;

namespace {

// A client's shared buffer's header (SharedBuffer in proto/service.proto):
// no placement or id slice lies there.
constexpr uint64_t kSharedBufferHeaderBytes = 4096;

// Whether the backend reads inputs in device memory (and writes outputs
// there): EmbeddingBackend::OutputMemory() is kCudaDevice.
bool ReadsDeviceMemory(const backend::EmbeddingBackend& backend) {
  return backend.OutputMemory() == backend::EmbeddingBackend::Memory::kCudaDevice;
}

// Leaves out of a gradient request what NaN/Inf touches (see
// CodecOptions::skip_nonfinite); the kept arrays are owned by *d.
absl::Status DropNonFinite(int64_t cols, const std::string& what, DecodedFeature* d,
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

// Views f's arrays (and, with `grad`, the gradient's) and checks them
// against the shard f names. With skip_nonfinite and a gradient, what
// NaN/Inf touches is left out first (counted in *skipped). With `region`,
// ids f names in it are viewed there, in place; with `id_buffer`, ids in
// that (buffer_ids) are too, or copied out for a backend that checks ids
// before it runs (lookups only). With `on_device`, the ids and weights (and
// the gradient, at `device_grad`) are viewed in that link's device memory,
// for a backend that reads and checks them there (FeatureRequest::on_device):
// only their shapes are checked here.
absl::Status DecodeFeature(const backend::EmbeddingBackend& backend, bool skip_nonfinite,
                           ShardResolver shard_of, const ShardFeature& f, const std::string* grad,
                           int64_t* cols, DecodedFeature* out, int64_t* skipped,
                           const ShmChannels::Region* region, const ShmChannels::Region* id_buffer,
                           const ShmChannels::Transfer* on_device,
                           const ember::v1::ShmSlice* device_grad) {
  auto shard = shard_of(f.shard());
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
    if (viewed.ok() && !backend.ChecksIdsWhileGathering()) {
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
  r.shard = shard->id;
  r.pooling = PoolingFromProto(f.pooling());
  *cols = shard->cols;
  if (grad != nullptr && skip_nonfinite) {
    if (absl::Status s = DropNonFinite(*cols, what, out, skipped); !s.ok()) return s;
  }
  // Shape checks before any buffer is sized from the request. A lookup's
  // ids are checked by the backend, before anything runs or as it gathers
  // them (embedding_backend.h): one pass over them, not two. An
  // update's are checked here too, as parts already applied never reach the
  // backend and the whole request is still refused when one is bad; but
  // not in device memory (`on_device`): the backend checks those, and the
  // parts already applied go unchecked (nothing of them is applied).
  // A dynamic shard takes any int64 id.
  return backend::ValidateFeature(out->request, shard->rows, what,
                                  grad == nullptr  ? backend::Checks::kShapesOnly
                                  : shard->dynamic ? backend::Checks::kAllButIds
                                                   : backend::Checks::kAll);
}

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

}  // namespace

absl::Status RequestCodec::ReceiveLookup(const ember::v1::WorkerLookupRequest& req,
                                         const std::string& owner, LookupCall* call) const {
  call->backend_ = backend_;
  call->max_response_bytes_ = options_.max_response_bytes;
  call->req_ = &req;
  // Through a channel: the outputs written into its region, the lengths
  // and weights copied out of it first, and the ids too unless the backend
  // checks each id as it gathers its row (then read in place: a client
  // that rewrites them during the call gets wrong rows of its own table
  // or a refusal, never a read outside the shard).
  call->ids_in_place_ = backend_->ChecksIdsWhileGathering();
  // Through an NCCL link, to a backend that reads device memory: only the
  // lengths come to the host; the ids and weights stay in the link's device
  // memory, where the backend checks and reads them.
  std::vector<ember::v1::ShmSlice> host_slices;
  const bool device_reads =
      ReadsDeviceMemory(*backend_) && !req.has_id_buffer() &&
      std::all_of(req.features().begin(), req.features().end(), IdsAndWeightsInChannel);
  if (req.channel_id() != 0) {
    if (device_reads) {
      for (const auto& f : req.features()) host_slices.push_back(f.shm_lengths());
    }
    auto r = channels_->Use(req.channel_id(), owner, req.channel_seq(), req.link_sent(),
                            device_reads ? &host_slices : nullptr);
    if (!r.ok()) return r.status();
    call->transfer_ = *std::move(r);
    call->inputs_on_device_ = device_reads && call->transfer_.link_memory_on_device();
    call->region_ = call->transfer_.region();
    if (absl::Status s = call->transfer_.CheckReply(req.link_reply(), req.shm_outputs());
        !s.ok()) {
      return s;
    }
    if (req.shm_outputs_size() != req.features_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          req.features_size(), " feature(s) but ", req.shm_outputs_size(), " output slice(s)"));
    }
    ember::v1::WorkerLookupRequest& copied = *call->copy_.get();
    copied = req;
    for (int i = 0; i < copied.features_size(); ++i) {
      const CopyOf which = call->inputs_on_device_ ? CopyOf::kLengths
                           : call->ids_in_place_   ? CopyOf::kAllButIds
                                                   : CopyOf::kAll;
      if (absl::Status s = CopyIn(*call->region_, absl::StrCat("feature ", i),
                                  copied.mutable_features(i), which);
          !s.ok()) {
        return s;
      }
    }
    call->req_ = &copied;
  } else if (req.shm_outputs_size() > 0 || req.has_link_sent() || req.has_link_reply() ||
             std::any_of(req.features().begin(), req.features().end(), InChannel)) {
    return absl::InvalidArgumentError("shared-memory slices without a channel");
  }
  // The client's id buffer (its KeyedJaggedTensor), when it names one:
  // features with buffer_ids take their ids there (DecodeFeature). One this
  // worker cannot map is refused (kIdBufferRefused): the client then sends
  // the ids through the channel.
  if (req.has_id_buffer()) {
    if (call->region_ == nullptr) {
      return absl::InvalidArgumentError("an id buffer without a channel");
    }
    auto mapped = channels_->MapBuffer(req.channel_id(), owner, req.id_buffer());
    if (absl::IsFailedPrecondition(mapped.status()) || absl::IsInvalidArgument(mapped.status())) {
      // Not a buffer this worker can map (another PID namespace, not the
      // client's, a size it does not take): the client's cue.
      return WithSignal(absl::FailedPreconditionError(
                            absl::StrCat(kIdBufferRefused, " ", mapped.status().message())),
                        kSignalIdBufferRefused);
    }
    if (!mapped.ok()) return mapped.status();  // the channel's, or no memory
    call->id_buffer_ = *std::move(mapped);
  }
  // The client's output buffer, when it names one this worker can map:
  // placed outputs go straight into it. Otherwise they go to the channel's
  // slices (the client copies them), as without one.
  if (req.has_out_buffer() || req.placements_size() > 0) {
    if (call->region_ == nullptr) {
      return absl::InvalidArgumentError("an output buffer without a channel");
    }
    if (req.placements_size() != req.features_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          req.features_size(), " feature(s) but ", req.placements_size(), " placement(s)"));
    }
    auto mapped = channels_->MapBuffer(req.channel_id(), owner, req.out_buffer());
    if (mapped.ok()) {
      call->out_region_ = *std::move(mapped);
    } else {
      VLOG(1) << "lookup outputs through the channel: " << mapped.status();
    }
  }
  return absl::OkStatus();
}

absl::Status LookupCall::DecodeFeatures(ShardResolver shard, std::vector<int64_t>* cols) {
  const ember::v1::WorkerLookupRequest& req = *req_;
  const int n = req.features_size();
  decoded_.resize(n);
  cols->assign(n, 0);
  for (int i = 0; i < n; ++i) {
    if (absl::Status s = DecodeFeature(*backend_, /*skip_nonfinite=*/false, shard,
                                       req.features(i), nullptr, &(*cols)[i], &decoded_[i],
                                       nullptr, ids_in_place_ ? region_.get() : nullptr,
                                       id_buffer_.get(), inputs_on_device_ ? &transfer_ : nullptr,
                                       nullptr);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<backend::FeatureRequest>> LookupCall::DecodePrefetch(
    ShardResolver shard) {
  std::vector<int64_t> cols;
  if (absl::Status s = DecodeFeatures(shard, &cols); !s.ok()) return s;
  std::vector<backend::FeatureRequest> features;
  features.reserve(decoded_.size());
  for (const DecodedFeature& d : decoded_) features.push_back(d.request);
  return features;
}

absl::Status LookupCall::Decode(ShardResolver shard, ember::v1::WorkerLookupResponse* resp) {
  const ember::v1::WorkerLookupRequest& req = *req_;
  const int n = req.features_size();
  std::vector<int64_t> cols, sizes(n);  // each output's columns and floats
  if (absl::Status s = DecodeFeatures(shard, &cols); !s.ok()) return s;
  output_bytes_ = 0;
  for (int i = 0; i < n; ++i) {
    sizes[i] = backend::OutputSize(decoded_[i].request, cols[i]);
    output_bytes_ += sizes[i] * 4;
  }
  if (output_bytes_ > max_response_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("lookup output would be ", output_bytes_, " bytes, over the limit of ",
                     max_response_bytes_, "; split the batch"));
  }
  requests_.resize(n);
  // A link channel whose memory the backend writes (host memory of a socket
  // link for the CPU backend, device memory of an NCCL link for the CUDA
  // backend): the outputs go there and back over the link without a copy.
  const bool outputs_in_link =
      transfer_.linked() && transfer_.link_memory_on_device() == ReadsDeviceMemory(*backend_);
  for (int i = 0; i < n; ++i) {
    requests_[i].feature = decoded_[i].request;
    const int64_t size = sizes[i];
    if (region_ == nullptr) {
      requests_[i].output = wire::Resize<float>(resp->add_outputs(), size);
      continue;
    }
    // Straight into the link's memory, sent from there, or into the region.
    const std::string what = absl::StrCat("output ", i);
    auto bytes = outputs_in_link ? transfer_.LinkBytes(req.shm_outputs(i), 4, what)
                                 : region_->Bytes(req.shm_outputs(i), 4, what);
    if (!bytes.ok()) return bytes.status();
    if (static_cast<int64_t>(bytes->size()) != size * 4) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": its slice holds ", bytes->size(), " bytes; the output is ", size * 4));
    }
    requests_[i].output = absl::MakeSpan(reinterpret_cast<float*>(bytes->data()), size);
    requests_[i].output_on_device = outputs_in_link && transfer_.link_memory_on_device();
    if (outputs_in_link || out_region_ == nullptr || req.placements(i).row_stride() == 0) continue;
    auto placed = Placement(*out_region_, req.placements(i), size, cols[i], i);
    if (!placed.ok()) return placed.status();
    if (backend_->WritesStridedOutputs()) {
      requests_[i].output = *placed;
      requests_[i].output_stride = static_cast<int64_t>(req.placements(i).row_stride());
    } else {
      moves_.push_back(Move{requests_[i].output.data(), placed->data(), size / cols[i], cols[i],
                            static_cast<int64_t>(req.placements(i).row_stride())});
    }
  }
  outputs_in_link_ = outputs_in_link;
  return absl::OkStatus();
}

absl::Status LookupCall::Finish(ember::v1::WorkerLookupResponse* resp) {
  for (const Move& m : moves_) {
    for (int64_t r = 0; r < m.rows; ++r) {
      std::memcpy(m.to + r * m.stride, m.from + r * m.cols, m.cols * sizeof(float));
    }
  }
  // A link channel's outputs go back over its link.
  if (absl::Status s = transfer_.Reply(req_->link_reply(), outputs_in_link_); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("link channel: ", s.message()));
  }
  resp->set_placed(out_region_ != nullptr);
  return absl::OkStatus();
}

absl::Status RequestCodec::ReceiveGradients(const ember::v1::WorkerApplyGradientsRequest& req,
                                            const std::string& owner, GradientCall* call,
                                            bool to_host) const {
  call->backend_ = backend_;
  call->skip_nonfinite_ = options_.skip_nonfinite;
  call->req_ = &req;
  // Through a channel: every array copied out of its region first, but
  // through an NCCL link to a backend that reads device memory, the
  // lengths alone (the ids, weights and gradients stay in the link's device
  // memory, checked and read there by the backend). Not with
  // skip_nonfinite, which reads the gradients here, nor `to_host`. The parts of a retried
  // update that were applied before are then not checked again (nothing of
  // them is applied).
  const bool device_reads =
      ReadsDeviceMemory(*backend_) && !options_.skip_nonfinite && !to_host &&
      std::all_of(req.gradients().begin(), req.gradients().end(),
                  [](const ember::v1::ShardGradient& g) {
                    return IdsAndWeightsInChannel(g.feature()) && g.grad().empty();
                  });
  if (req.channel_id() != 0) {
    std::vector<ember::v1::ShmSlice> host_slices;
    if (device_reads) {
      for (const auto& g : req.gradients()) host_slices.push_back(g.feature().shm_lengths());
    }
    auto used = channels_->Use(req.channel_id(), owner, req.channel_seq(), req.link_sent(),
                               device_reads ? &host_slices : nullptr);
    if (!used.ok()) return used.status();
    call->transfer_ = *std::move(used);
    call->inputs_on_device_ = device_reads && call->transfer_.link_memory_on_device();
    const std::shared_ptr<const ShmChannels::Region>& region = call->transfer_.region();
    ember::v1::WorkerApplyGradientsRequest& copied = *call->copy_.get();
    copied = req;
    for (int i = 0; i < copied.gradients_size(); ++i) {
      auto* g = copied.mutable_gradients(i);
      const std::string what = absl::StrCat("gradient ", i);
      if (absl::Status s = CopyIn(*region, what, g->mutable_feature(),
                                  call->inputs_on_device_ ? CopyOf::kLengths : CopyOf::kAll);
          !s.ok()) {
        return s;
      }
      if (g->shm_grad().size() > 0 && !call->inputs_on_device_) {
        if (!g->grad().empty()) {
          return absl::InvalidArgumentError(
              absl::StrCat(what, ": grad given both inline and in the channel"));
        }
        auto bytes = region->Bytes(g->shm_grad(), 4, what + " grad");
        if (!bytes.ok()) return bytes.status();
        g->set_grad(bytes->data(), bytes->size());
        g->clear_shm_grad();
      }
    }
    call->req_ = &copied;
  } else if (req.has_link_sent() ||
             std::any_of(req.gradients().begin(), req.gradients().end(),
                         [](const ember::v1::ShardGradient& g) {
                           return InChannel(g.feature()) || g.has_shm_grad();
                         })) {
    return absl::InvalidArgumentError("shared-memory slices without a channel");
  }
  call->decoded_.resize(call->req_->gradients_size());
  return absl::OkStatus();
}

absl::StatusOr<backend::GradientRequest> GradientCall::Decode(int i, ShardResolver shard) {
  const ember::v1::ShardGradient& g = req_->gradients(i);
  int64_t cols = 0;
  if (absl::Status s = DecodeFeature(*backend_, skip_nonfinite_, shard, g.feature(), &g.grad(),
                                     &cols, &decoded_[i], &skipped_, nullptr, nullptr,
                                     inputs_on_device_ ? &transfer_ : nullptr, &g.shm_grad());
      !s.ok()) {
    return s;
  }
  return backend::GradientRequest{decoded_[i].request, decoded_[i].grad_view};
}

}  // namespace worker
}  // namespace ember
