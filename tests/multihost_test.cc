// A real multi-host deployment on one machine: network namespaces joined by
// veth pairs on a bridge give the coordinator, three workers and a trainer
// each a host with its own address (10.99.0.0/24; nothing leaves the
// machine), and the servers run as the Kubernetes manifests run them: their
// arguments are read from deploy/base/*.yaml, with the mounted secrets and
// volumes mapped to files made here (a CA, one certificate naming every host,
// the token file with the roles and a line per worker) and the Service names to addresses.
//
// The trainer (tests/multihost_trainer.cc) runs in its own namespace, in
// phases: it trains against the in-process reference and shows that every
// port refuses clients without the right certificate or token; then this
// test cuts a worker's link, and the trainer checks that clients get
// UNAVAILABLE within their deadline and that the worker's lease lapses.
//
// Root only (network namespaces); skipped with a message elsewhere. Bounded
// in time: every child is killed when the test ends, and the namespaces
// (with their links) are deleted.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/certificates.h"
#include "tests/local_cluster.h"
#include "tests/netns.h"
#include "tests/test_collection.h"

namespace ember {
namespace {

using testing_util::Absolute;
using testing_util::Hosts;
using testing_util::IpBinary;
using testing_util::Process;

constexpr char kEmberctl[] = "cli/emberctl";
constexpr char kTrainer[] = "tests/multihost_trainer";
constexpr char kCoordinatorManifest[] = "deploy/base/coordinator.yaml";
constexpr char kWorkersManifest[] = "deploy/base/workers.yaml";
constexpr int kWorkers = 3;
constexpr int kCutWorker = 1;
constexpr char kSubnet[] = "10.99.0.";

std::string CoordinatorIp() { return absl::StrCat(kSubnet, 2); }
std::string WorkerIp(int i) { return absl::StrCat(kSubnet, 10 + i); }
std::string TrainerIp() { return absl::StrCat(kSubnet, 50); }

// The container's `args:` list of a manifest (the first one in the file).
std::vector<std::string> ManifestArgs(const std::string& file) {
  std::ifstream in(file);
  std::vector<std::string> args;
  bool in_args = false;
  for (std::string line; std::getline(in, line);) {
    absl::string_view l = absl::StripAsciiWhitespace(line);
    if (!in_args) {
      in_args = l == "args:";
      continue;
    }
    if (!absl::ConsumePrefix(&l, "- ")) break;
    args.emplace_back(absl::StripAsciiWhitespace(l));
  }
  return args;
}

// A manifest's arguments with the pod's mounts, Service names and pod
// fields replaced by what this test made; "" in `unmapped` names an argument
// that still refers to something only a cluster has.
std::vector<std::string> MapArgs(const std::vector<std::string>& args,
                                 const std::vector<std::pair<std::string, std::string>>& map,
                                 std::string* unmapped) {
  std::vector<std::string> out;
  for (const std::string& a : args) {
    out.push_back(absl::StrReplaceAll(a, map));
    const std::string& m = out.back();
    if (absl::StrContains(m, "/etc/ember") || absl::StrContains(m, "/var/lib/ember") ||
        absl::StrContains(m, "$(") || absl::StrContains(m, "svc.cluster.local") ||
        absl::StrContains(m, "ember-coordinator")) {
      *unmapped = m;
    }
  }
  return out;
}

// Streams a child's output to ours (prefixed) until it ends; its exit code.
int Follow(Process* p, const std::string& prefix, absl::Duration timeout) {
  for (std::string line; p->NextLine(&line);) std::cout << prefix << line << std::endl;
  return p->Wait(timeout);
}

TEST(MultiHostTest, TrainsOverTlsAndTokensAndSurvivesACutLink) {
  if (getuid() != 0) GTEST_SKIP() << "needs root to make network namespaces";
  Hosts hosts(absl::StrCat("ember-mh", getpid()));
  if (!hosts.Start()) {
    GTEST_SKIP() << "cannot make network namespaces with a bridge here (no `ip` command, or "
                    "ip netns add / ip link add type bridge failed)";
  }
  const std::string ip = IpBinary();
  ASSERT_TRUE(hosts.Add("coord", CoordinatorIp()));
  for (int i = 0; i < kWorkers; ++i) ASSERT_TRUE(hosts.Add(absl::StrCat("w", i), WorkerIp(i)));
  ASSERT_TRUE(hosts.Add("trainer", TrainerIp()));

  // The secrets and volumes: one CA and a certificate naming every host
  // (as one Kubernetes TLS secret serves every pod), another CA's
  // certificate for the refusals, the role tokens, each client's own token.
  const std::string dir = testing_util::TempDir();
  std::string sans = "DNS:localhost";
  for (const std::string& a : {CoordinatorIp(), WorkerIp(0), WorkerIp(1), WorkerIp(2), TrainerIp()}) {
    sans += ",IP:" + a;
  }
  ASSERT_TRUE(testing_util::MakeCertificates(dir, "ember", sans)) << "openssl failed";
  ASSERT_TRUE(testing_util::MakeCertificates(dir, "other", sans));
  std::ofstream(dir + "/tokens") << "worker ember-workers-0 mh-worker-token-0b6f3e21\n"
                                 << "worker ember-workers-1 mh-worker-token-1c7f4f32\n"
                                 << "worker ember-workers-2 mh-worker-token-2d805043\n"
                                 << "trainer mh-trainer-token-7d2c9a48\n"
                                 << "admin mh-admin-token-e5a17c90\n";
  std::ofstream(dir + "/trainer.token") << "mh-trainer-token-7d2c9a48\n";
  std::ofstream(dir + "/admin.token") << "mh-admin-token-e5a17c90\n";
  ASSERT_EQ(mkdir((dir + "/state").c_str(), 0700), 0);
  ASSERT_EQ(mkdir((dir + "/checkpoints").c_str(), 0700), 0);
  const std::vector<std::pair<std::string, std::string>> mounts = {
      {"/etc/ember/tls/tls.crt", dir + "/ember.pem"},
      {"/etc/ember/tls/tls.key", dir + "/ember.key"},
      {"/etc/ember/tls/ca.crt", dir + "/ember-ca.pem"},
      {"/etc/ember/tokens/tokens", dir + "/tokens"},
      {"/var/lib/ember/state", dir + "/state"},
      {"/var/lib/ember/checkpoints", dir + "/checkpoints"},
      {"ember-coordinator:", CoordinatorIp() + ":"},
  };

  const std::vector<std::string> coordinator_args = ManifestArgs(kCoordinatorManifest);
  const std::vector<std::string> worker_args = ManifestArgs(kWorkersManifest);
  ASSERT_FALSE(coordinator_args.empty()) << kCoordinatorManifest << ": no args";
  ASSERT_FALSE(worker_args.empty()) << kWorkersManifest << ": no args";
  ASSERT_EQ(coordinator_args[0], "coordinator");
  ASSERT_EQ(worker_args[0], "worker");

  std::string unmapped;
  std::vector<std::string> argv = {ip, "netns", "exec", hosts.Ns("coord"), Absolute(kEmberctl)};
  for (const std::string& a : MapArgs(coordinator_args, mounts, &unmapped)) argv.push_back(a);
  ASSERT_EQ(unmapped, "") << "a coordinator argument this test cannot map";
  std::cout << "coordinator: " << absl::StrJoin(argv, " ") << std::endl;
  Process coordinator(argv);
  const std::string coordinator_address = coordinator.Line("coordinator listening on ");
  ASSERT_FALSE(coordinator_address.empty()) << "the coordinator did not start";

  std::vector<std::unique_ptr<Process>> workers;
  for (int i = 0; i < kWorkers; ++i) {
    auto map = mounts;
    map.push_back({"$(POD_NAME).ember-workers.$(POD_NAMESPACE).svc.cluster.local", WorkerIp(i)});
    map.push_back({"--worker_name=$(POD_NAME)", absl::StrCat("--worker_name=ember-workers-", i)});
    argv = {ip, "netns", "exec", hosts.Ns(absl::StrCat("w", i)), Absolute(kEmberctl)};
    for (const std::string& a : MapArgs(worker_args, map, &unmapped)) argv.push_back(a);
    ASSERT_EQ(unmapped, "") << "a worker argument this test cannot map";
    // The "hosts" share this machine's memory and host name, where pods
    // each have their cgroup's limit: an explicit share each (else the
    // coordinator refuses the second as overcommitting the host).
    argv.push_back("--memory_gib=2");
    std::cout << "worker " << i << ": " << absl::StrJoin(argv, " ") << std::endl;
    workers.push_back(std::make_unique<Process>(argv));
    ASSERT_FALSE(workers.back()->Line("worker ").empty()) << "worker " << i << " did not start";
  }

  // The trainer's view of the deployment, through its environment.
  std::vector<std::string> worker_addresses;
  for (int i = 0; i < kWorkers; ++i) worker_addresses.push_back(WorkerIp(i) + ":7000");
  setenv("EMBER_MH_COORDINATOR", (CoordinatorIp() + ":7000").c_str(), 1);
  setenv("EMBER_MH_WORKERS", absl::StrJoin(worker_addresses, ",").c_str(), 1);
  setenv("EMBER_MH_HEALTH_PORT", "8081", 1);
  setenv("EMBER_MH_DIR", dir.c_str(), 1);
  // The trainer is a test binary of its own: keep it off this test's
  // result files.
  for (const char* v : {"XML_OUTPUT_FILE", "GTEST_OUTPUT", "TEST_PREMATURE_EXIT_FILE"}) unsetenv(v);
  auto trainer = [&](const std::string& filter) {
    Process t({ip, "netns", "exec", hosts.Ns("trainer"), Absolute(kTrainer),
               "--gtest_filter=" + filter});
    return Follow(&t, "trainer| ", absl::Minutes(3));
  };

  EXPECT_EQ(trainer("Trainer.TrainsAgainstTheReference:Trainer.EveryPortRefusesStrangers"), 0);

  // A worker's node loses its network.
  ASSERT_TRUE(hosts.Cut(absl::StrCat("w", kCutWorker)));
  setenv("EMBER_MH_CUT", worker_addresses[kCutWorker].c_str(), 1);
  EXPECT_EQ(trainer("Trainer.ACutWorkerIsUnavailableWithinTheDeadline"), 0);

  // Workers drain on SIGTERM; here they just stop.
  for (auto& w : workers) w->Stop(SIGKILL);
  coordinator.Stop(SIGTERM);
}

}  // namespace
}  // namespace ember
