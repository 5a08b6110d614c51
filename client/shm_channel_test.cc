#include "client/shm_channel.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "gtest/gtest.h"
#include "proto/service.grpc.pb.h"

namespace ember {
namespace client {
namespace {

// A worker that answers only OpenChannel: refuses a memfd handover with
// `memfd_refusal` (as one in another PID namespace, or an older one, does)
// and takes a POSIX name, checking the nonce as the real one does.
class NamesOnlyWorker final : public ember::v1::Worker::Service {
 public:
  explicit NamesOnlyWorker(grpc::StatusCode memfd_refusal) : memfd_refusal_(memfd_refusal) {}
  grpc::Status OpenChannel(grpc::ServerContext*, const ember::v1::OpenChannelRequest* req,
                           ember::v1::OpenChannelResponse* resp) override {
    requests.push_back(*req);
    if (req->pid() != 0) return grpc::Status(memfd_refusal_, "no such memfd here");
    const int fd = shm_open(req->shm_name().c_str(), O_RDWR, 0);
    if (fd < 0) return grpc::Status(grpc::StatusCode::NOT_FOUND, "no such name");
    void* base = mmap(nullptr, req->size(), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "size");
    uint64_t nonce;
    std::memcpy(&nonce, base, sizeof(nonce));
    munmap(base, req->size());
    if (nonce != req->nonce()) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "nonce");
    resp->set_channel_id(7);
    return grpc::Status::OK;
  }
  std::vector<ember::v1::OpenChannelRequest> requests;

 private:
  const grpc::StatusCode memfd_refusal_;
};

struct Server {
  explicit Server(NamesOnlyWorker* worker) {
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(worker);
    server = b.BuildAndStart();
    stub = ember::v1::Worker::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  }
  ~Server() { server->Shutdown(); }
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<ember::v1::Worker::Stub> stub;
};

const auto kNoDeadline = [](grpc::ClientContext*) {};

// On the worker's host the region goes over as a sealed memfd; a worker
// that cannot open it gets a POSIX name instead (unlinked once answered).
TEST(ShmChannelTest, AWorkerThatCannotOpenTheMemfdGetsAName) {
  for (grpc::StatusCode refusal : {grpc::StatusCode::FAILED_PRECONDITION,
                                   grpc::StatusCode::NOT_FOUND,
                                   grpc::StatusCode::INVALID_ARGUMENT}) {
    NamesOnlyWorker worker(refusal);
    Server server(&worker);
    auto ch = ShmChannel::Open(server.stub.get(), 1 << 20, "", kNoDeadline);
    ASSERT_TRUE(ch.ok()) << ch.status();
    EXPECT_EQ((*ch)->id(), 7u);
    ASSERT_EQ(worker.requests.size(), 2u);
    EXPECT_EQ(worker.requests[0].pid(), getpid());
    EXPECT_TRUE(worker.requests[0].shm_name().empty());
    EXPECT_EQ(worker.requests[1].pid(), 0);
    const std::string name = worker.requests[1].shm_name();
    EXPECT_EQ(name.rfind("/ember-", 0), 0u) << name;
    EXPECT_LT(shm_open(name.c_str(), O_RDONLY, 0), 0) << name << " was left named";
  }
}

// A worker that is down, or refuses for another reason than the memfd,
// gets no second try.
TEST(ShmChannelTest, OtherRefusalsAreNotRetriedWithAName) {
  NamesOnlyWorker worker(grpc::StatusCode::RESOURCE_EXHAUSTED);
  Server server(&worker);
  auto ch = ShmChannel::Open(server.stub.get(), 1 << 20, "", kNoDeadline);
  EXPECT_EQ(ch.status().code(), absl::StatusCode::kResourceExhausted) << ch.status();
  EXPECT_EQ(worker.requests.size(), 1u);
}

}  // namespace
}  // namespace client
}  // namespace ember
