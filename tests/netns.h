// Hosts on one machine: network namespaces joined by veth pairs to a
// bridge (in a namespace of its own), each with its own address, so that
// servers can be cut off from each other as nodes of a real network are.
// Root only: Start() is false where namespaces cannot be made. Every
// namespace (with its links) is deleted when the Hosts are destroyed.
#ifndef EMBER_TESTS_NETNS_H_
#define EMBER_TESTS_NETNS_H_

#include <unistd.h>

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace ember {
namespace testing_util {

// Runs a shell command, its output discarded; true when it succeeded.
inline bool Sh(const std::string& cmd) {
  return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0;
}

// The `ip` command (iproute2), or "" where there is none. Bazel's test
// PATH leaves out the sbin directories it lives in.
inline std::string IpBinary() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}

// `path` made absolute against the working directory.
inline std::string Absolute(const std::string& path) {
  char buf[4096];
  if (path.rfind('/', 0) == 0 || getcwd(buf, sizeof(buf)) == nullptr) return path;
  return std::string(buf) + "/" + path;
}

class Hosts {
 public:
  explicit Hosts(std::string prefix) : prefix_(std::move(prefix)) {}
  ~Hosts() {
    for (auto it = made_.rbegin(); it != made_.rend(); ++it) Sh("ip netns del " + *it);
  }
  Hosts(const Hosts&) = delete;
  Hosts& operator=(const Hosts&) = delete;

  // The switch; false when namespaces cannot be made here.
  bool Start() {
    const std::string path = getenv("PATH") ? getenv("PATH") : "/usr/bin:/bin";
    setenv("PATH", (path + ":/usr/sbin:/sbin").c_str(), 1);
    if (getuid() != 0 || IpBinary().empty() || !MakeNs(prefix_ + "-net")) return false;
    return Sh(absl::StrCat("ip -n ", prefix_, "-net link add br0 type bridge && ip -n ", prefix_,
                           "-net link set br0 up"));
  }
  // Host `name` at `ip` (/24) on the bridge.
  bool Add(const std::string& name, const std::string& ip) {
    const std::string ns = Ns(name);
    if (!MakeNs(ns)) return false;
    const std::string plug = Plug(ns, "eth0");
    return Sh(absl::StrCat("set -e; ip -n ", ns, " link set lo up; ", plug, "; ip -n ", ns,
                           " addr add ", ip, "/24 dev eth0; ip -n ", ns, " link set eth0 up"));
  }
  // This process's own namespace on the bridge at `ip` (/24): the test
  // itself is then a host that reaches every other (its end of the link
  // goes when the bridge's namespace is deleted).
  bool AddThisHost(const std::string& ip) {
    const std::string eth = absl::StrCat("emh", getpid() % 100000, "h");
    const std::string plug = Plug("", eth);
    return Sh(absl::StrCat("set -e; ", plug, "; ip addr add ", ip, "/24 dev ", eth,
                           "; ip link set ", eth, " up"));
  }
  // Takes host `name` off the network (its link down: packets to and from it
  // are dropped, as when a node loses its network).
  bool Cut(const std::string& name) { return Sh("ip -n " + Ns(name) + " link set eth0 down"); }
  // Host `name` cannot (`on`) or can again (`on` false) send to `ip`: a
  // blackhole route, so that a partition can leave other paths up.
  bool Blackhole(const std::string& name, const std::string& ip, bool on) {
    return Sh(absl::StrCat("ip -n ", Ns(name), " route ", on ? "add" : "del", " blackhole ", ip,
                           "/32"));
  }
  std::string Ns(const std::string& name) const { return prefix_ + "-" + name; }
  // The argv prefix that runs a command on host `name`.
  std::vector<std::string> Exec(const std::string& name) const {
    return {IpBinary(), "netns", "exec", Ns(name)};
  }

 private:
  bool MakeNs(const std::string& ns) {
    if (!Sh("ip netns add " + ns)) return false;
    made_.push_back(ns);
    return true;
  }
  // The commands making a veth pair: one end on the bridge, the other
  // (`inside`) in namespace `ns` ("": this process's).
  std::string Plug(const std::string& ns, const std::string& inside) {
    const std::string outside = absl::StrCat("emh", getpid() % 100000, "v", links_++);
    return absl::StrCat("ip link add ", outside, " type veth peer name ", inside,
                        ns.empty() ? "" : " netns " + ns, "; ip link set ", outside, " netns ",
                        prefix_, "-net; ip -n ", prefix_, "-net link set ", outside,
                        " master br0 up");
  }
  const std::string prefix_;
  std::vector<std::string> made_;
  int links_ = 0;
};

}  // namespace testing_util
}  // namespace ember

#endif  // EMBER_TESTS_NETNS_H_
