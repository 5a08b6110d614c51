// One client call fanned out to its workers, one gRPC call per worker
// rank (Fanout), each over its own Transport; their statuses combined
// (Combine), and after a failure what each call's end means for its
// channel (EndCalls). Private to //client:client.
#ifndef EMBER_CLIENT_FANOUT_H_
#define EMBER_CLIENT_FANOUT_H_

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/routing.h"
#include "client/shm_channel.h"
#include "client/transport.h"
#include "proto/service.grpc.pb.h"
#include "server/common/auth.h"
#include "server/common/grpc_util.h"

namespace ember {
namespace client {

template <typename Request, typename Response>
struct Call {
  grpc::ClientContext ctx;
  Request request;
  Response response;
  grpc::Status status;
  bool used = false;     // the request carries something for this worker
  bool started = false;  // sent; `done` fires when it finishes
  absl::Notification done;
};

// Worst status of a set of calls, named by worker: FAILED_PRECONDITION (a
// stale plan, refresh) first, then any non-UNAVAILABLE error, then
// UNAVAILABLE / DEADLINE_EXCEEDED; with kSignalReadPrimary if any call
// carried it.
template <typename C, typename Addresses>
absl::Status Combine(const std::vector<std::unique_ptr<C>>& calls, const Addresses& addresses) {
  absl::Status worst;
  auto rank_of = [](absl::StatusCode c) {
    switch (c) {
      case absl::StatusCode::kOk:
        return 0;
      case absl::StatusCode::kUnavailable:
      case absl::StatusCode::kDeadlineExceeded:
        return 1;
      case absl::StatusCode::kFailedPrecondition:
        return 3;
      default:
        return 2;
    }
  };
  bool read_primary = false;  // any backup's ask goes with the answer, whichever it is
  for (size_t r = 0; r < calls.size(); ++r) {
    if (!calls[r]->started || calls[r]->status.ok()) continue;
    absl::Status s = FromGrpc(calls[r]->status, absl::StrCat("worker ", r, " (", addresses[r], ")"));
    read_primary |= HasSignal(s, kSignalReadPrimary);
    if (rank_of(s.code()) > rank_of(worst.code())) worst = s;
  }
  if (read_primary && !HasSignal(worst, kSignalReadPrimary)) {
    worst = WithSignal(std::move(worst), kSignalReadPrimary);
  }
  return worst;
}

using StubFor = std::function<ember::v1::Worker::Stub*(const std::string&)>;
// A shared-memory channel to a worker for one call, or an empty lease.
using ChannelFor = std::function<ChannelPool::Lease(const std::string&, uint64_t)>;

// The transport of one worker request: a channel to `address` when one is
// to be had for `bytes`, else inline.
inline std::unique_ptr<Transport> TransportFor(const std::string& address, uint64_t bytes,
                                        const ChannelFor& channel_for) {
  if (bytes > 0) {
    ChannelPool::Lease lease = channel_for(address, bytes);
    if (lease) return std::make_unique<ShmTransport>(std::move(lease));
  }
  return std::make_unique<InlineTransport>();
}

// The calls of one client call, one per worker rank, each sent as soon as
// its request is built (start(stub, call, done)), so that workers compute
// while the client still builds the other requests. The destructor waits
// for every started call: nothing outlives the buffers they use.
template <typename C>
class Fanout {
 public:
  Fanout(const Client::Routing& r, int world, absl::Time deadline, const StubFor& stub_for)
      : routing_(r), deadline_(deadline), stub_for_(stub_for) {
    calls_.reserve(world);
    for (int i = 0; i < world; ++i) calls_.push_back(std::make_unique<C>());
  }
  ~Fanout() {
    for (int rank = 0; rank < size(); ++rank) Wait(rank);
  }

  int size() const { return static_cast<int>(calls_.size()); }
  C& operator[](int rank) { return *calls_[rank]; }

  // Sends rank's call if its request carries anything.
  template <typename StartFn>
  void Start(int rank, StartFn start) {
    C* c = calls_[rank].get();
    if (!c->used || c->started) return;
    c->ctx.set_deadline(absl::ToChronoTime(deadline_));
    AddToken(&c->ctx, routing_.auth_token);
    c->started = true;
    start(stub_for_(routing_.info.worker_addresses(rank)), c, [c](grpc::Status s) {
      c->status = std::move(s);
      c->done.Notify();
    });
  }
  // Waits for rank's call (if sent); true if it succeeded.
  bool Wait(int rank) {
    C* c = calls_[rank].get();
    if (!c->started) return false;
    c->done.WaitForNotification();
    return c->status.ok();
  }
  // Waits for every call; the worst status (Combine).
  absl::Status WaitAll() {
    for (int rank = 0; rank < size(); ++rank) Wait(rank);
    return Combine(calls_, routing_.info.worker_addresses());
  }

 private:
  const Client::Routing& routing_;
  const absl::Time deadline_;
  const StubFor& stub_for_;
  std::vector<std::unique_ptr<C>> calls_;
};

// How the failed calls of a fan-out ended (EndCalls).
struct CallEnds {
  bool unconfirmed = false;        // a worker may still be running its call
  bool id_buffer_refused = false;  // a worker could not map the ids' buffer
};

// After calls of which some failed: a channel whose call ended without the
// worker's answer (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, UNKNOWN,
// INTERNAL: the connection, not the request; PERMISSION_DENIED) is not
// trusted again, and its worker may still be running the call
// (`unconfirmed`). A refusal (INVALID_ARGUMENT, NOT_FOUND,
// FAILED_PRECONDITION, ...) came from the worker's handler, done with the
// call, and leaves the channel as it was; one of the ids' buffer
// (kIdBufferRefused) makes that worker's channels send ids as arrays from
// then on.
template <typename F>
CallEnds EndCalls(F& fan, std::vector<std::unique_ptr<Transport>>* transports,
                  absl::Time deadline) {
  CallEnds ends;
  for (int rank = 0; rank < fan.size(); ++rank) {
    if (!fan[rank].started) continue;
    const grpc::Status& status = fan[rank].status;
    // A link channel whose exchange did not end as agreed (refused, failed,
    // outputs not taken): its link may be out of step, unless the worker
    // took its bytes before refusing the call as busy.
    if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
        HasSignal(status, kSignalLinkBytesTaken)) {
      (*transports)[rank]->Settled(std::min(deadline, absl::Now() + absl::Seconds(10)));
    }
    if ((*transports)[rank]->Unfinished()) (*transports)[rank]->Failed();
    switch (status.error_code()) {
      case grpc::StatusCode::OK:
        break;
      case grpc::StatusCode::UNAVAILABLE:
      case grpc::StatusCode::DEADLINE_EXCEEDED:
      case grpc::StatusCode::CANCELLED:
      case grpc::StatusCode::UNKNOWN:
      case grpc::StatusCode::INTERNAL:
        (*transports)[rank]->Failed();
        ends.unconfirmed = true;
        break;
      case grpc::StatusCode::PERMISSION_DENIED:  // perhaps the channel's owner
        (*transports)[rank]->Failed();
        break;
      case grpc::StatusCode::FAILED_PRECONDITION:
        if (HasSignal(status, kSignalIdBufferRefused)) {
          (*transports)[rank]->BuffersRefused();
          ends.id_buffer_refused = true;
        }
        break;
      default:
        break;
    }
  }
  return ends;
}

}  // namespace client
}  // namespace ember

#endif  // EMBER_CLIENT_FANOUT_H_
