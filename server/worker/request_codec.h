// The worker's request codec. A data call's arrays travel by one of several
// transports: inline in the request, in a shared-memory channel's region,
// in the client's id buffer (its KeyedJaggedTensor, mapped in place), or in
// a link channel's host or device memory; a lookup's outputs go back
// inline, into the channel, into the client's output buffer at its
// placements, or over the link. The codec owns all of that. It turns a
// WorkerLookupRequest or WorkerApplyGradientsRequest into the backend's
// requests, checked, and returns a lookup's outputs the way they came; the
// handlers (worker_service.cc) see backend requests and statuses only.
//
// A call is decoded in two steps:
//  - Receive (outside the worker's lock): the channel's transfer taken,
//    buffers mapped, and host copies made of every array that is checked
//    before use (inputs are never checked in place, where the client could
//    change them after the check). Refusals here are the transport's.
//  - Decode (under the worker's lock): each feature checked against the
//    shard it names (a ShardResolver), its arrays viewed for the backend,
//    and a lookup's outputs sized and placed.
// A LookupCall also finishes the call after the backend ran (Finish).
//
// The codec is thread-safe (ShmChannels is); a call object belongs to one
// handler thread and must not outlive the request it was received from.
#ifndef EMBER_SERVER_WORKER_REQUEST_CODEC_H_
#define EMBER_SERVER_WORKER_REQUEST_CODEC_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/service.pb.h"
#include "server/backend/embedding_backend.h"
#include "server/common/thread_reused.h"
#include "server/worker/shm_channels.h"

namespace ember {
namespace worker {

// What decoding needs of the shard a feature names: the backend's id for
// it and its assignment's rows and columns.
struct ShardShape {
  backend::ShardId id = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  bool dynamic = false;  // a hash-keyed shard: any int64 id (rows: its capacity)
};
// The shard a ShardRef names, or the status that refuses it (NOT_FOUND,
// FAILED_PRECONDITION: WorkerService::FindShard). Decode calls it once per
// feature, in the request's order, before anything else of that feature.
using ShardResolver = absl::FunctionRef<absl::StatusOr<ShardShape>(const ember::v1::ShardRef&)>;

// One feature's arrays, viewed in place (in the request's bytes, the
// channel's region, the id buffer or the link's device memory) or, where
// misaligned or filtered, copied into the vectors.
struct DecodedFeature {
  std::vector<int64_t> lengths, ids;
  std::vector<float> weights, grad;
  backend::FeatureRequest request;
  absl::Span<const float> grad_view;
};

// The request a channel call's arrays are copied into: one per handler
// thread, kept between calls, emptied after each and dropped above 64 MiB.
template <typename Request>
struct RequestCopyTraits {
  static constexpr size_t kKeptBytes = size_t{64} << 20;
  static size_t Bytes(const Request& r) { return r.SpaceUsedLong(); }
  static void Keep(Request* r) { r->Clear(); }
};
template <typename Request>
using ReusedCopy = ThreadReused<Request, RequestCopyTraits<Request>>;

// A lookup received by RequestCodec::ReceiveLookup.
class LookupCall {
 public:
  LookupCall() = default;
  LookupCall(const LookupCall&) = delete;
  LookupCall& operator=(const LookupCall&) = delete;

  // The request as decoded: the original, or its copy with the channel's
  // arrays copied in.
  const ember::v1::WorkerLookupRequest& request() const { return *req_; }
  // Checks every feature against its shard and sizes its output: inline in
  // *resp, or in the channel's region, the link's memory or the client's
  // output buffer. RESOURCE_EXHAUSTED past max_response_bytes.
  absl::Status Decode(ShardResolver shard, ember::v1::WorkerLookupResponse* resp);
  // A prefetch (request().prefetch()): every feature checked against its
  // shard as by Decode, no output sized; the backend's features, valid for
  // the call's life.
  absl::StatusOr<std::vector<backend::FeatureRequest>> DecodePrefetch(ShardResolver shard);
  // The backend's requests, valid after Decode.
  std::vector<backend::LookupRequest>& requests() { return requests_; }
  // After the backend succeeded: outputs a backend of packed outputs wrote
  // are copied to their placements, a link channel's outputs go back over
  // the link (UNAVAILABLE when it fails), and resp->placed is set.
  absl::Status Finish(ember::v1::WorkerLookupResponse* resp);

  int64_t output_bytes() const { return output_bytes_; }
  bool placed() const { return out_region_ != nullptr; }
  bool from_id_buffer() const { return id_buffer_ != nullptr; }
  bool linked() const { return transfer_.linked(); }

 private:
  friend class RequestCodec;
  // Placed outputs a backend of packed outputs wrote into their slices,
  // copied into the placement by Finish.
  struct Move {
    const float* from;
    float* to;
    int64_t rows, cols, stride;
  };
  const backend::EmbeddingBackend* backend_ = nullptr;
  int64_t max_response_bytes_ = 0;
  const ember::v1::WorkerLookupRequest* req_ = nullptr;
  ReusedCopy<ember::v1::WorkerLookupRequest> copy_;
  ShmChannels::Transfer transfer_;  // a link channel's: held to the end of the call
  std::shared_ptr<const ShmChannels::Region> region_, id_buffer_, out_region_;
  bool ids_in_place_ = false, inputs_on_device_ = false, outputs_in_link_ = false;
  std::vector<DecodedFeature> decoded_;
  std::vector<backend::LookupRequest> requests_;
  std::vector<Move> moves_;
  int64_t output_bytes_ = 0;

  // Decodes feature i of the request into decoded_[i]; its output's columns
  // in *cols.
  absl::Status DecodeFeatures(ShardResolver shard, std::vector<int64_t>* cols);
};

// A gradient update received by RequestCodec::ReceiveGradients.
class GradientCall {
 public:
  GradientCall() = default;
  GradientCall(const GradientCall&) = delete;
  GradientCall& operator=(const GradientCall&) = delete;

  const ember::v1::WorkerApplyGradientsRequest& request() const { return *req_; }
  // Gradient i checked against its shard (ids, shapes, NaN/Inf: with
  // skip_nonfinite what they touch is left out first, counted in
  // skipped()); its backend request, valid for the call's life.
  absl::StatusOr<backend::GradientRequest> Decode(int i, ShardResolver shard);
  int64_t skipped() const { return skipped_; }

 private:
  friend class RequestCodec;
  const backend::EmbeddingBackend* backend_ = nullptr;
  bool skip_nonfinite_ = false;
  const ember::v1::WorkerApplyGradientsRequest* req_ = nullptr;
  ReusedCopy<ember::v1::WorkerApplyGradientsRequest> copy_;
  ShmChannels::Transfer transfer_;
  bool inputs_on_device_ = false;
  std::vector<DecodedFeature> decoded_;
  int64_t skipped_ = 0;
};

// What the codec takes of WorkerServiceOptions.
struct CodecOptions {
  // Largest lookup output in bytes (max_response_bytes).
  int64_t max_response_bytes = 0;
  // NaN/Inf in an update leave out what they touch instead of refusing it.
  bool skip_nonfinite = false;
};

class RequestCodec {
 public:
  // `channels` and `backend` outlive the codec.
  RequestCodec(ShmChannels* channels, const backend::EmbeddingBackend* backend,
               const CodecOptions& options)
      : channels_(channels), backend_(backend), options_(options) {}

  // Takes req's transfer through its channel (when it names one) for
  // `owner`, copies in what is checked before use, and maps the client's id
  // and output buffers. FAILED_PRECONDITION with kSignalIdBufferRefused for
  // an id buffer this worker cannot map (the client sends the ids through
  // the channel instead); an output buffer it cannot map leaves the outputs
  // in the channel's slices. `req` must outlive *call.
  absl::Status ReceiveLookup(const ember::v1::WorkerLookupRequest& req, const std::string& owner,
                             LookupCall* call) const;
  // The same for an update: through a channel every array is copied out of
  // its region, but through an NCCL link to a backend that reads device
  // memory only the lengths are (without skip_nonfinite, which reads the
  // gradients on the host, and without `to_host`: an update held for a
  // step outlives the link's memory, so it comes to the host whole).
  absl::Status ReceiveGradients(const ember::v1::WorkerApplyGradientsRequest& req,
                                const std::string& owner, GradientCall* call,
                                bool to_host = false) const;

 private:
  ShmChannels* const channels_;
  const backend::EmbeddingBackend* const backend_;
  const CodecOptions options_;
};

}  // namespace worker
}  // namespace ember

#endif  // EMBER_SERVER_WORKER_REQUEST_CODEC_H_
