// CoordinatorService::CallEach's and CallWorker's definitions, for the
// coordinator's files that call workers (member templates: each caller's
// file instantiates them). Private to //server/coordinator:coordinator_service.
#ifndef EMBER_SERVER_COORDINATOR_CALL_EACH_H_
#define EMBER_SERVER_COORDINATOR_CALL_EACH_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/blocking_counter.h"
#include "server/common/grpc_util.h"
#include "server/coordinator/coordinator_service.h"

namespace ember {
namespace coordinator {

// Calls `rpc` on every address at once (gRPC's async callback API) and waits
// for all; returns one status per address.
template <typename Request, typename Response, typename Rpc>
std::vector<grpc::Status> CoordinatorService::CallEach(const std::vector<std::string>& addresses,
                                                       const std::vector<Request>& requests,
                                                       Rpc rpc, absl::Duration timeout,
                                                       std::vector<Response>* responses_out) {
  const size_t n = addresses.size();
  std::vector<grpc::ClientContext> contexts(n);
  std::vector<Response> own;
  std::vector<Response>& responses = responses_out != nullptr ? *responses_out : own;
  responses.assign(n, Response());
  std::vector<grpc::Status> statuses(n);
  absl::BlockingCounter pending(static_cast<int>(n));
  for (size_t i = 0; i < n; ++i) {
    SetDeadline(&contexts[i], timeout == absl::ZeroDuration() ? options_.worker_rpc_timeout : timeout);
    AddToken(&contexts[i], CredentialFor(addresses[i]));
    rpc(StubFor(addresses[i])->async(), &contexts[i], &requests[i], &responses[i],
        [&statuses, &pending, i](grpc::Status s) {
          statuses[i] = std::move(s);
          pending.DecrementCount();
        });
  }
  pending.Wait();
  return statuses;
}

template <typename Request, typename Response>
absl::Status CoordinatorService::CallWorker(
    const std::string& address,
    grpc::Status (ember::v1::Worker::Stub::*rpc)(grpc::ClientContext*, const Request&, Response*),
    const Request& request, Response* response) {
  ember::v1::Worker::Stub* stub = StubFor(address);
  grpc::ClientContext ctx;
  SetDeadline(&ctx, options_.worker_rpc_timeout);
  AddToken(&ctx, CredentialFor(address));
  if (grpc::Status s = (stub->*rpc)(&ctx, request, response); !s.ok()) {
    return FromGrpc(s, address);
  }
  return absl::OkStatus();
}

}  // namespace coordinator
}  // namespace ember

#endif  // EMBER_SERVER_COORDINATOR_CALL_EACH_H_
