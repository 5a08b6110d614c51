// The trainer of tests/multihost_test.cc, run in a network namespace of its
// own by that test (not alone): a host that reaches the coordinator and the
// workers over the network, with mutual TLS and tokens, as a trainer pod
// would. Its cases are the test's phases, chosen with --gtest_filter:
//
//   Trainer.TrainsAgainstTheReference        create (admin), train (trainer
//                                            token), compare with the
//                                            in-process reference
//   Trainer.EveryPortRefusesStrangers        no certificate, another CA's,
//                                            no token, a trainer's token for
//                                            an admin call: refused on the
//                                            coordinator's and every
//                                            worker's port; health ports
//                                            serve health only
//   Trainer.ACutWorkerIsUnavailableWithinTheDeadline
//                                            after the test cut a worker's
//                                            link: UNAVAILABLE within the
//                                            client's deadline, the lease
//                                            lapses, training goes on
//                                            with the recovered plan
//
// The deployment comes from the environment: EMBER_MH_COORDINATOR,
// EMBER_MH_WORKERS (comma-separated), EMBER_MH_HEALTH_PORT, EMBER_MH_DIR
// (ember.pem/.key, ember-ca.pem, other.pem/.key, other-ca.pem,
// trainer.token, admin.token) and EMBER_MH_CUT (the cut worker's address).
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/inprocess.h"
#include "gtest/gtest.h"
#include "server/common/auth.h"
#include "server/common/tls.h"
#include "tests/raw_call.h"
#include "tests/test_collection.h"

namespace ember {
namespace {

using client::Client;
using client::InProcessCollection;
using client::KeyedJaggedTensor;
using client::KeyedTensor;
using testing_util::RandomKjt;

constexpr char kCollection[] = "multihost";

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}
std::string Dir() { return Env("EMBER_MH_DIR"); }
TlsFiles Ours() { return {Dir() + "/ember.pem", Dir() + "/ember.key", Dir() + "/ember-ca.pem"}; }

absl::StatusOr<std::unique_ptr<Client>> Connect(const TlsFiles& tls, const std::string& token_file,
                                                absl::Duration timeout, int attempts = 4) {
  auto credentials = ChannelCredentialsFrom(tls);
  if (!credentials.ok()) return credentials.status();
  client::ClientOptions o;
  o.timeout = timeout;
  o.max_attempts = attempts;
  o.credentials = *credentials;
  if (!token_file.empty()) {
    auto token = LoadClientToken(token_file);
    if (!token.ok()) return token.status();
    o.auth_token = *token;
  }
  return Client::Connect(Env("EMBER_MH_COORDINATOR"), o);
}

class Trainer : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NE(Env("EMBER_MH_COORDINATOR"), "") << "run by tests/multihost_test, not alone";
    ASSERT_NE(Env("EMBER_MH_DIR"), "");
    workers_ = absl::StrSplit(Env("EMBER_MH_WORKERS"), ',', absl::SkipEmpty());
    ASSERT_FALSE(workers_.empty());
  }
  std::vector<std::string> workers_;
};

TEST_F(Trainer, TrainsAgainstTheReference) {
  auto admin = Connect(Ours(), Dir() + "/admin.token", absl::Seconds(30));
  ASSERT_TRUE(admin.ok()) << admin.status();
  // Every worker registered under its advertised address.
  const absl::Time until = absl::Now() + absl::Seconds(30);
  std::vector<std::string> registered;
  do {
    registered.clear();
    auto list = (*admin)->ListWorkers();
    ASSERT_TRUE(list.ok()) << list.status();
    for (const auto& w : list->workers()) {
      if (w.live()) registered.push_back(w.info().address());
    }
    if (registered.size() == workers_.size()) break;
    absl::SleepFor(absl::Milliseconds(200));
  } while (absl::Now() < until);
  std::sort(registered.begin(), registered.end());
  ASSERT_EQ(registered, workers_);

  const auto spec = testing_util::TestSpec(kCollection);
  auto info = (*admin)->CreateCollection(spec, "row_wise");
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->worker_addresses_size(), static_cast<int>(workers_.size()));
  auto ref = InProcessCollection::Create(spec, &info->plan());
  ASSERT_TRUE(ref.ok()) << ref.status();

  auto trainer = Connect(Ours(), Dir() + "/trainer.token", absl::Seconds(30));
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  Client* c = trainer->get();
  std::mt19937 rng(7);
  for (int step = 0; step < 6; ++step) {
    SCOPED_TRACE(absl::StrCat("step ", step));
    testing_util::StepAgainstReference(c, ref->get(), kCollection, rng, 16, step % 2 == 1, true,
                                       "multi-host");
  }
  testing_util::ExpectTablesMatch(c, ref->get(), kCollection, spec, "multi-host");
  // The trainer's token does not change the deployment.
  EXPECT_EQ(c->DropCollection(kCollection).code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(Trainer, EveryPortRefusesStrangers) {
  const std::string d = Dir();
  auto ours = ChannelCredentialsFrom(Ours());
  ASSERT_TRUE(ours.ok()) << ours.status();
  auto no_certificate = ChannelCredentialsFrom({"", "", d + "/ember-ca.pem"});
  ASSERT_TRUE(no_certificate.ok());
  auto other_ca = ChannelCredentialsFrom({d + "/other.pem", d + "/other.key", d + "/ember-ca.pem"});
  ASSERT_TRUE(other_ca.ok());
  auto token = [&](const std::string& role) {
    auto t = LoadClientToken(d + "/" + role + ".token");
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *t : "";
  };
  const std::string trainer = token("trainer"), admin = token("admin");

  // Each port with a read a trainer may make and a change only an admin may.
  struct Port {
    std::string address, read, change;
  };
  std::vector<Port> ports = {{Env("EMBER_MH_COORDINATOR"), "/ember.v1.Coordinator/ListWorkers",
                              "/ember.v1.Coordinator/CreateCollection"}};
  for (const std::string& w : workers_) {
    ports.push_back({w, "/ember.v1.Worker/ShardStatus", "/ember.v1.Worker/DropShards"});
  }
  for (const Port& p : ports) {
    SCOPED_TRACE(p.address);
    // Plaintext, no client certificate, a certificate of another CA: the
    // connection is refused before any call.
    for (const auto& creds : {std::shared_ptr<grpc::ChannelCredentials>(), *no_certificate,
                              *other_ca}) {
      const grpc::StatusCode code = testing_util::RawCall(p.address, p.read, "", nullptr, creds, admin);
      EXPECT_EQ(code, grpc::StatusCode::UNAVAILABLE);
    }
    // Our certificate, but no token or a wrong one; a trainer's token for a
    // change.
    EXPECT_EQ(testing_util::RawCall(p.address, p.read, "", nullptr, *ours, ""),
              grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(testing_util::RawCall(p.address, p.read, "", nullptr, *ours, "mh-not-a-token-123456"),
              grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(testing_util::RawCall(p.address, p.change, "", nullptr, *ours, trainer),
              grpc::StatusCode::PERMISSION_DENIED);
    // The right certificate and token are served.
    EXPECT_EQ(testing_util::RawCall(p.address, p.read, "", nullptr, *ours, trainer),
              grpc::StatusCode::OK);
  }
  // The plaintext health ports serve grpc.health.v1 and nothing else.
  std::vector<std::string> hosts = {Env("EMBER_MH_COORDINATOR")};
  hosts.insert(hosts.end(), workers_.begin(), workers_.end());
  for (const std::string& a : hosts) {
    const std::string health =
        absl::StrCat(a.substr(0, a.rfind(':')), ":", Env("EMBER_MH_HEALTH_PORT"));
    SCOPED_TRACE(health);
    std::string reply;
    EXPECT_EQ(testing_util::RawCall(health, "/grpc.health.v1.Health/Check", "", &reply),
              grpc::StatusCode::OK);
    EXPECT_EQ(reply, std::string("\x08\x01", 2));  // SERVING
    EXPECT_EQ(testing_util::RawCall(health, "/ember.v1.Worker/ShardStatus", "", nullptr, nullptr, admin),
              grpc::StatusCode::UNIMPLEMENTED);
    EXPECT_EQ(testing_util::RawCall(health, "/ember.v1.Coordinator/ListWorkers", "", nullptr, nullptr,
                                    admin),
              grpc::StatusCode::UNIMPLEMENTED);
  }
}

TEST_F(Trainer, ACutWorkerIsUnavailableWithinTheDeadline) {
  const std::string cut = Env("EMBER_MH_CUT");
  ASSERT_NE(cut, "") << "the test did not cut a worker's link";
  const absl::Duration deadline = absl::Seconds(4);
  auto trainer = Connect(Ours(), Dir() + "/trainer.token", deadline);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  std::mt19937 rng(9);
  // Row-wise: every worker holds rows of every table, so any batch needs
  // the cut one.
  for (int i = 0; i < 2; ++i) {
    const KeyedJaggedTensor kjt =
        RandomKjt(rng, {"f_sum", "f_mean", "f_rw", "f_sum2"}, {301, 200, 150, 301}, 64, false);
    const absl::Time start = absl::Now();
    auto got = (*trainer)->Lookup(kCollection, kjt);
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
    EXPECT_LE(took, deadline + absl::Milliseconds(500)) << "the deadline was " << deadline;
    std::cout << "lookup " << i << ": " << got.status() << " after " << took << std::endl;
  }
  // The coordinator stops hearing the worker: its lease lapses.
  auto admin = Connect(Ours(), Dir() + "/admin.token", absl::Seconds(10));
  ASSERT_TRUE(admin.ok()) << admin.status();
  const absl::Time until = absl::Now() + absl::Seconds(30);
  bool lapsed = false;
  while (!lapsed && absl::Now() < until) {
    auto list = (*admin)->ListWorkers();
    ASSERT_TRUE(list.ok()) << list.status();
    for (const auto& w : list->workers()) {
      if (w.info().address() == cut && !w.live()) lapsed = true;
    }
    if (!lapsed) absl::SleepFor(absl::Milliseconds(250));
  }
  ASSERT_TRUE(lapsed) << cut << " still holds its lease";

  // The coordinator moves the lost rank's shards to the live workers (no
  // checkpoint here: they come back freshly initialised), and the trainer
  // goes on with the new plan.
  const absl::Time recovered_by = absl::Now() + absl::Seconds(30);
  // Shards on the cut worker's rank in the current plan.
  int on_cut = -1;
  while (absl::Now() < recovered_by) {
    auto info = (*admin)->GetCollection(kCollection);
    ASSERT_TRUE(info.ok()) << info.status();
    on_cut = 0;
    for (const auto& t : info->plan().tables()) {
      for (const auto& shard : t.shards()) {
        on_cut += info->worker_addresses(shard.rank()) == cut ? 1 : 0;
      }
    }
    if (info->plan().epoch() > 1 && on_cut == 0) break;
    absl::SleepFor(absl::Milliseconds(250));
  }
  ASSERT_EQ(on_cut, 0) << "the plan still places shards on " << cut;
  auto after = Connect(Ours(), Dir() + "/trainer.token", absl::Seconds(20));
  ASSERT_TRUE(after.ok()) << after.status();
  const KeyedJaggedTensor kjt =
      RandomKjt(rng, {"f_sum", "f_mean", "f_rw", "f_sum2"}, {301, 200, 150, 301}, 64, false);
  auto got = (*after)->Lookup(kCollection, kjt);
  ASSERT_TRUE(got.ok()) << got.status();
  KeyedTensor grads = *got;
  for (float& g : grads.values) g = 0.25f;
  EXPECT_TRUE((*after)->ApplyGradients(kCollection, kjt, grads).ok());
}

}  // namespace
}  // namespace ember
