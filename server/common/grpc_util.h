// gRPC glue shared by servers and clients: status conversion, channels with
// raised message limits, deadlines.
#ifndef EMBER_SERVER_COMMON_GRPC_UTIL_H_
#define EMBER_SERVER_COMMON_GRPC_UTIL_H_

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace ember {

// Largest message either side sends or accepts (gRPC's default is 4 MiB;
// a batch of 4096 x 8 features x dim 128 is 16 MiB of embeddings).
constexpr int kMaxMessageBytes = 1 << 30;
// HTTP/2 frame size and initial stream window both ends of a data channel
// advertise (MakeChannel, the worker's server).
constexpr int kMaxFrameBytes = 1 << 20;
constexpr int kStreamWindowBytes = 8 << 20;

// The start of a worker's RESOURCE_EXHAUSTED message when it refuses a data
// call because too many are already in progress (--max_queued_calls): a
// transient state clients retry with back-off, unlike the other
// RESOURCE_EXHAUSTED answers (no memory, an output too large).
constexpr char kWorkerBusy[] = "worker busy";
// What a worker's busy refusal of a link channel's call adds when it took
// the call's bytes off the link first: the link is still in step, and the
// client keeps the channel (instead of joining a new link).
constexpr char kLinkBytesTaken[] = "its link bytes were taken";
// How a worker's refusal of a lookup's id buffer (WorkerLookupRequest.
// id_buffer: it could not map it) begins; FAILED_PRECONDITION. The client
// then sends ids through the channel instead.
constexpr char kIdBufferRefused[] = "id buffer:";

// Control signals: what a refusal asks the client to do, named apart from
// the message (whose words are for people and may change). A signal rides
// in an absl::Status as the payload kSignalPayload and on the wire as the
// gRPC status's binary error details, "ember-signals:" followed by the
// names, space-separated; ToGrpc and FromGrpc carry it across.
//   kSignalWorkerBusy: the worker refused a data call as busy (its
//     RESOURCE_EXHAUSTED begins kWorkerBusy); retry with back-off.
//   kSignalLinkBytesTaken: a busy refusal of a link channel's call that
//     took the call's bytes first (kLinkBytesTaken): keep the channel.
//   kSignalIdBufferRefused: the worker cannot map the lookup's id buffer
//     (kIdBufferRefused): send ids through the channel instead.
//   kSignalReadPrimary: a backup copy of a SYNC collection cannot tell
//     which step it is at yet (no step forwarded since its epoch began):
//     read the shard's primary copy.
//   kSignalCollectionRecovering: the coordinator is moving or recovering
//     the collection (CollectionInfo.state RECOVERING; set by the client
//     on its own refusal): wait, up to the call's deadline, not counting
//     attempts (a live move's fence, a recovery's reload).
constexpr char kSignalWorkerBusy[] = "worker_busy";
constexpr char kSignalCollectionRecovering[] = "collection_recovering";
constexpr char kSignalLinkBytesTaken[] = "link_bytes_taken";
constexpr char kSignalIdBufferRefused[] = "id_buffer_refused";
constexpr char kSignalReadPrimary[] = "read_primary";
constexpr char kSignalPayload[] = "type.ember.dev/signals";
constexpr char kSignalDetailsPrefix[] = "ember-signals:";

// `s` with `signal` added to its signals.
inline absl::Status WithSignal(absl::Status s, absl::string_view signal) {
  std::string names(signal);
  if (auto old = s.GetPayload(kSignalPayload)) names = std::string(*old) + " " + names;
  s.SetPayload(kSignalPayload, absl::Cord(names));
  return s;
}

inline bool SignalsName(absl::string_view names, absl::string_view signal) {
  for (absl::string_view n : absl::StrSplit(names, ' ')) {
    if (n == signal) return true;
  }
  return false;
}

inline bool HasSignal(const absl::Status& s, absl::string_view signal) {
  auto names = s.GetPayload(kSignalPayload);
  return names.has_value() && SignalsName(std::string(*names), signal);
}

inline bool HasSignal(const grpc::Status& s, absl::string_view signal) {
  const std::string& details = s.error_details();
  return absl::StartsWith(details, kSignalDetailsPrefix) &&
         SignalsName(absl::string_view(details).substr(sizeof(kSignalDetailsPrefix) - 1), signal);
}

// Longest error message a server sends: messages echo input (names, ids,
// addresses), and a request must not be able to make its error arbitrarily
// large.
constexpr size_t kMaxErrorMessageBytes = 2048;

inline std::string BoundedMessage(absl::string_view message) {
  if (message.size() <= kMaxErrorMessageBytes) return std::string(message);
  return std::string(message.substr(0, kMaxErrorMessageBytes)) + "... (" +
         std::to_string(message.size() - kMaxErrorMessageBytes) + " more bytes)";
}

// Signals (above) travel as the error details.
inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(s.code());
  if (auto names = s.GetPayload(kSignalPayload)) {
    return grpc::Status(code, BoundedMessage(s.message()),
                        kSignalDetailsPrefix + std::string(*names));
  }
  return grpc::Status(code, BoundedMessage(s.message()));
}

// FromGrpc with the peer named: "worker 127.0.0.1:5001: <message>".
inline absl::Status FromGrpc(const grpc::Status& s, const std::string& peer) {
  if (s.ok()) return absl::OkStatus();
  absl::Status out(static_cast<absl::StatusCode>(s.error_code()),
                   peer.empty() ? s.error_message() : peer + ": " + s.error_message());
  const std::string& details = s.error_details();
  if (absl::StartsWith(details, kSignalDetailsPrefix)) {
    out.SetPayload(kSignalPayload, absl::Cord(details.substr(sizeof(kSignalDetailsPrefix) - 1)));
  }
  return out;
}

inline absl::Status FromGrpc(const grpc::Status& s) { return FromGrpc(s, ""); }

// A channel with Ember's message limits; plaintext unless `credentials`
// (server/common/tls.h) are given.
// `max_reconnect_backoff`: the longest wait between reconnection attempts
// after the peer went away (gRPC's default grows to 120 s); zero: gRPC's.
inline std::shared_ptr<grpc::Channel> MakeChannel(
    const std::string& address,
    const std::shared_ptr<grpc::ChannelCredentials>& credentials = nullptr,
    absl::Duration max_reconnect_backoff = absl::ZeroDuration()) {
  grpc::ChannelArguments args;
  if (max_reconnect_backoff > absl::ZeroDuration()) {
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(max_reconnect_backoff));
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, ms);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, std::min(ms, 100));
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, std::min(ms, 100));
  }
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // Bulk payloads of megabytes in HTTP/2 frames of up to 1 MiB (16 KiB by
  // default) and a stream window that starts at 8 MiB rather than growing
  // from 64 KiB: service_bench over gRPC +3-8% (docs/lab-notes/2026-11-benchmarks.md).
  // Workers advertise the same (worker_server.cc).
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kMaxFrameBytes);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kStreamWindowBytes);
  return grpc::CreateCustomChannel(
      address, credentials != nullptr ? credentials : grpc::InsecureChannelCredentials(), args);
}

// A plaintext server on `bind` (HOST:PORT) that serves only grpc.health.v1,
// for kubelet probes (which cannot present client certificates). nullptr
// when `bind` is empty; UNAVAILABLE when it cannot listen.
inline absl::StatusOr<std::unique_ptr<grpc::Server>> StartHealthServer(const std::string& bind) {
  if (bind.empty()) return std::unique_ptr<grpc::Server>();
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort(bind, grpc::InsecureServerCredentials(), &port);
  std::unique_ptr<grpc::Server> s = b.BuildAndStart();
  if (!s || port == 0) return absl::UnavailableError("cannot serve health checks on " + bind);
  return s;
}

inline void SetDeadline(grpc::ClientContext* ctx, absl::Duration timeout) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::microseconds(absl::ToInt64Microseconds(timeout)));
}

}  // namespace ember

#endif  // EMBER_SERVER_COMMON_GRPC_UTIL_H_
