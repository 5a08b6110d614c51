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
