// Control signals across the absl/gRPC boundary, and the bounded messages.
#include "server/common/grpc_util.h"

#include <string>

#include "gtest/gtest.h"

namespace ember {
namespace {

TEST(SignalTest, TravelFromServerToClientBesideTheMessage) {
  const absl::Status busy = WithSignal(
      WithSignal(absl::ResourceExhaustedError("worker busy: 1 data calls in progress"),
                 kSignalWorkerBusy),
      kSignalLinkBytesTaken);
  EXPECT_TRUE(HasSignal(busy, kSignalWorkerBusy));
  EXPECT_TRUE(HasSignal(busy, kSignalLinkBytesTaken));
  EXPECT_FALSE(HasSignal(busy, kSignalIdBufferRefused));
  const grpc::Status wire = ToGrpc(busy);
  EXPECT_EQ(wire.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(wire.error_message(), "worker busy: 1 data calls in progress");  // unchanged
  EXPECT_EQ(wire.error_details(), "ember-signals:worker_busy link_bytes_taken");
  EXPECT_TRUE(HasSignal(wire, kSignalWorkerBusy));
  EXPECT_TRUE(HasSignal(wire, kSignalLinkBytesTaken));
  const absl::Status back = FromGrpc(wire, "worker 0 (127.0.0.1:1)");
  EXPECT_EQ(back.message(), "worker 0 (127.0.0.1:1): worker busy: 1 data calls in progress");
  EXPECT_TRUE(HasSignal(back, kSignalWorkerBusy));
  EXPECT_TRUE(HasSignal(back, kSignalLinkBytesTaken));
}

TEST(SignalTest, NamesAreWholeWordsAndOtherDetailsAreNotSignals) {
  // A message that quotes a signal's words is not the signal.
  const absl::Status quoted = absl::ResourceExhaustedError("worker busy link_bytes_taken");
  EXPECT_FALSE(HasSignal(quoted, kSignalWorkerBusy));
  EXPECT_FALSE(HasSignal(ToGrpc(quoted), kSignalWorkerBusy));
  EXPECT_TRUE(ToGrpc(quoted).error_details().empty());
  // A prefix of a name is not the name.
  const absl::Status part = WithSignal(absl::UnavailableError("x"), "worker_bus");
  EXPECT_FALSE(HasSignal(part, kSignalWorkerBusy));
  // Details that are not ours (a google.rpc.Status, say) carry none.
  const grpc::Status other(grpc::StatusCode::INTERNAL, "m", "\x08\x0d\x12\x01m");
  EXPECT_FALSE(HasSignal(other, kSignalWorkerBusy));
  EXPECT_FALSE(FromGrpc(other).GetPayload(kSignalPayload).has_value());
  EXPECT_TRUE(FromGrpc(grpc::Status::OK).ok());
}

TEST(BoundedMessageTest, LongMessagesAreCutAndSaySo) {
  const std::string longer(kMaxErrorMessageBytes + 10, 'x');
  const grpc::Status s = ToGrpc(absl::InvalidArgumentError(longer));
  EXPECT_EQ(s.error_message(),
            std::string(kMaxErrorMessageBytes, 'x') + "... (10 more bytes)");
}

}  // namespace
}  // namespace ember
