// TLS end to end (server/common/tls.h): a cluster started with a server
// certificate and --tls_ca (mutual TLS) serves clients that present a
// certificate of that CA, and refuses plaintext clients, clients without a
// certificate and clients whose certificate another CA signed. Certificates
// are made here with openssl (IP SAN 127.0.0.1).
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "proto/service.grpc.pb.h"
#include "server/common/grpc_util.h"
#include "gtest/gtest.h"
#include "server/common/tls.h"
#include "tests/certificates.h"
#include "tests/local_cluster.h"
#include "tests/raw_call.h"
#include "tests/test_collection.h"

namespace ember {
namespace {

constexpr char kEmberctl[] = "cli/emberctl";

bool MakeCertificates(const std::string& dir, const std::string& name) {
  return testing_util::MakeCertificates(dir, name, "IP:127.0.0.1,DNS:localhost");
}

absl::StatusOr<std::unique_ptr<client::Client>> Connect(const std::string& address,
                                                        const TlsFiles& files) {
  auto credentials = ChannelCredentialsFrom(files);
  if (!credentials.ok()) return credentials.status();
  client::ClientOptions o;
  o.timeout = absl::Seconds(5);
  o.max_attempts = 1;
  o.credentials = *credentials;
  return client::Client::Connect(address, o);
}

TEST(TlsTest, MutualTlsServesItsClientsAndRefusesOthers) {
  const std::string dir = ::testing::TempDir();
  ASSERT_TRUE(MakeCertificates(dir, "ember")) << "openssl failed";
  ASSERT_TRUE(MakeCertificates(dir, "other"));
  const std::string cert = dir + "/ember.pem", key = dir + "/ember.key",
                    ca = dir + "/ember-ca.pem";
  const int health_port = 20000 + static_cast<int>(getpid() % 20000);
  testing_util::LocalCluster cluster(
      kEmberctl, 2,
      {"--tls_cert=" + cert, "--tls_key=" + key, "--tls_ca=" + ca,
       absl::StrCat("--health_port=", health_port)});
  ASSERT_TRUE(cluster.ok()) << "emberctl up with TLS did not come up";
  // Kubelet's view: health over plaintext on --health_port while the service
  // port wants mutual TLS.
  std::string reply;
  const std::string health = absl::StrCat("127.0.0.1:", health_port);
  EXPECT_EQ(testing_util::RawCall(health, "/grpc.health.v1.Health/Check", "", &reply),
            grpc::StatusCode::OK);
  EXPECT_EQ(reply, std::string("\x08\x01", 2));  // SERVING
  EXPECT_NE(testing_util::RawCall(cluster.coordinator(), "/grpc.health.v1.Health/Check", ""),
            grpc::StatusCode::OK);
  EXPECT_EQ(testing_util::RawCall(health, "/ember.v1.Coordinator/ListWorkers", ""),
            grpc::StatusCode::UNIMPLEMENTED);  // only health there

  // A client of the CA: the whole path (coordinator, and workers over TLS
  // from both the client and the coordinator).
  auto good = Connect(cluster.coordinator(), {cert, key, ca});
  ASSERT_TRUE(good.ok()) << good.status();
  const auto spec = testing_util::TestSpec("tls");
  ASSERT_TRUE((*good)->CreateCollection(spec, "row_wise").ok());
  std::mt19937 rng(1);
  const auto kjt = testing_util::RandomKjt(rng, {"f_sum", "f_mean"}, {301, 200}, 4, false);
  auto kt = (*good)->Lookup("tls", kjt);
  ASSERT_TRUE(kt.ok()) << kt.status();
  EXPECT_EQ(kt->batch_size, 4);

  // Plaintext, no client certificate, another CA's certificate: refused.
  EXPECT_FALSE(Connect(cluster.coordinator(), {}).ok());
  EXPECT_FALSE(Connect(cluster.coordinator(), {"", "", ca}).ok());
  EXPECT_FALSE(
      Connect(cluster.coordinator(), {dir + "/other.pem", dir + "/other.key", ca}).ok());
  // A client that does not trust the server's CA refuses the server.
  EXPECT_FALSE(Connect(cluster.coordinator(), {cert, key, dir + "/other-ca.pem"}).ok());
  EXPECT_TRUE((*good)->DropCollection("tls").ok());
}

// Mutual TLS without tokens: a worker id is bound to the certificate that
// registered it. Another certificate of the same CA may not heartbeat or
// drain it (40 forged heartbeats once kept a killed worker "live"); the
// worker's own certificate and an operator's may.
TEST(TlsTest, AWorkersCertificateIsItsIdentity) {
  const std::string dir = ::testing::TempDir() + "/identity";
  ASSERT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  ASSERT_TRUE(MakeCertificates(dir, "ember")) << "openssl failed";
  const std::string sans = "IP:127.0.0.1,DNS:localhost";
  ASSERT_TRUE(testing_util::IssueCertificate(dir, "ember", "intruder", sans));
  ASSERT_TRUE(testing_util::IssueCertificate(dir, "ember", "operator", sans));
  const std::string ca = dir + "/ember-ca.pem";
  const TlsFiles worker = {dir + "/ember.pem", dir + "/ember.key", ca};
  testing_util::LocalCluster cluster(
      kEmberctl, 1, {"--tls_cert=" + worker.cert, "--tls_key=" + worker.key, "--tls_ca=" + ca});
  ASSERT_TRUE(cluster.ok()) << "emberctl up with TLS did not come up";
  // The worker's certificate (the one `up` gives it) registers and heartbeats
  // a fake worker of its own; the intruder's registers another.
  auto stub_as = [&](const std::string& name) {
    const TlsFiles f = {dir + "/" + name + ".pem", dir + "/" + name + ".key", ca};
    return ember::v1::Coordinator::NewStub(MakeChannel(cluster.coordinator(), *ChannelCredentialsFrom(f)));
  };
  auto as_worker = stub_as("ember");
  auto as_intruder = stub_as("intruder");
  auto as_operator = stub_as("operator");
  auto register_with = [](ember::v1::Coordinator::Stub* stub, const std::string& address) {
    grpc::ClientContext ctx;
    ember::v1::RegisterWorkerRequest req;
    req.mutable_worker()->set_address(address);
    req.mutable_worker()->set_device(ember::v1::CPU);
    req.mutable_worker()->set_host("elsewhere");
    ember::v1::RegisterWorkerResponse resp;
    EXPECT_TRUE(stub->RegisterWorker(&ctx, req, &resp).ok());
    return resp.worker_id();
  };
  const std::string intruders = register_with(as_intruder.get(), "127.0.0.1:2");
  auto heartbeat = [](ember::v1::Coordinator::Stub* stub, const std::string& id) {
    grpc::ClientContext ctx;
    ember::v1::HeartbeatRequest req;
    req.set_worker_id(id);
    ember::v1::HeartbeatResponse resp;
    return stub->Heartbeat(&ctx, req, &resp).error_code();
  };
  auto drain = [](ember::v1::Coordinator::Stub* stub, const std::string& id) {
    grpc::ClientContext ctx;
    ember::v1::DrainWorkerRequest req;
    req.set_worker_id(id);
    ember::v1::DrainWorkerResponse resp;
    return stub->DrainWorker(&ctx, req, &resp).error_code();
  };
  auto workers = Connect(cluster.coordinator(), worker);
  ASSERT_TRUE(workers.ok()) << workers.status();
  auto listed = (*workers)->ListWorkers();
  ASSERT_TRUE(listed.ok());
  std::string real;
  for (const auto& w : listed->workers()) {
    if (w.worker_id() != intruders) real = w.worker_id();
  }
  ASSERT_FALSE(real.empty());
  EXPECT_EQ(heartbeat(as_intruder.get(), real), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(drain(as_intruder.get(), real), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(heartbeat(as_worker.get(), real), grpc::StatusCode::OK);
  EXPECT_EQ(heartbeat(as_intruder.get(), intruders), grpc::StatusCode::OK);  // its own
  EXPECT_EQ(heartbeat(as_worker.get(), intruders), grpc::StatusCode::PERMISSION_DENIED);
  // A certificate that registered no worker is an operator's.
  EXPECT_EQ(heartbeat(as_operator.get(), real), grpc::StatusCode::OK);
  EXPECT_EQ(drain(as_operator.get(), intruders), grpc::StatusCode::OK);
}

TEST(TlsTest, BadTlsFlagsAreRefused) {
  EXPECT_EQ(ServerCredentialsFrom({"cert.pem", "", ""}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ServerCredentialsFrom({"", "", "ca.pem"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ChannelCredentialsFrom({"", "", "/nonexistent/ca.pem"}).status().code(),
            absl::StatusCode::kNotFound);
  const std::string junk = ::testing::TempDir() + "/junk.pem";
  std::system(("echo hello > " + junk).c_str());
  EXPECT_EQ(ChannelCredentialsFrom({"", "", junk}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ChannelCredentialsFrom({}).ok());
  EXPECT_EQ(*ChannelCredentialsFrom({}), nullptr);  // plaintext
}

}  // namespace
}  // namespace ember
