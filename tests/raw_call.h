// One unary call of any method by name with a raw payload (grpc::GenericStub),
// for tests that speak to services without their generated stubs (health
// checks, malformed messages).
#ifndef EMBER_TESTS_RAW_CALL_H_
#define EMBER_TESTS_RAW_CALL_H_

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/synchronization/notification.h"
#include "server/common/grpc_util.h"

namespace ember {
namespace testing_util {

// `credentials`: TLS (nullptr: plaintext); `token`: sent as a bearer token
// when not empty.
inline grpc::StatusCode RawCall(
    const std::string& address, const std::string& method, const std::string& payload,
    std::string* reply = nullptr,
    const std::shared_ptr<grpc::ChannelCredentials>& credentials = nullptr,
    const std::string& token = "") {
  grpc::GenericStub stub(MakeChannel(address, credentials));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, absl::Seconds(30));
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  grpc::Slice slice(payload);
  grpc::ByteBuffer request(&slice, 1), response;
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
    status = std::move(s);
    done.Notify();
  });
  done.WaitForNotification();
  if (reply != nullptr && status.ok()) {
    std::vector<grpc::Slice> slices;
    if (response.Dump(&slices).ok()) {
      reply->clear();
      for (const auto& sl : slices) reply->append(reinterpret_cast<const char*>(sl.begin()), sl.size());
    }
  }
  return status.error_code();
}

}  // namespace testing_util
}  // namespace ember

#endif  // EMBER_TESTS_RAW_CALL_H_
