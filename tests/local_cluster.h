// Child processes for tests and benchmarks: Process (any command, stdout on
// a pipe) and LocalCluster (`emberctl up --workers=N` on 127.0.0.1); both
// stopped (SIGTERM, then SIGKILL) when destroyed.
#ifndef EMBER_TESTS_LOCAL_CLUSTER_H_
#define EMBER_TESTS_LOCAL_CLUSTER_H_

#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace ember {
namespace testing_util {

// One child process with its stdout on a pipe; SIGTERM (then SIGKILL after
// 15 s) when destroyed.
class Process {
 public:
  explicit Process(std::vector<std::string> args) {
    int fds[2];
    if (pipe(fds) != 0) return;
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      dup2(fds[1], 1);
      close(fds[0]);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
  }
  ~Process() {
    Stop(SIGTERM);
    if (out_ != nullptr) fclose(out_);
  }
  // The next line of stdout without its newline; false at end of output.
  bool NextLine(std::string* line) {
    char buf[512];
    if (out_ == nullptr || fgets(buf, sizeof(buf), out_) == nullptr) return false;
    *line = std::string(absl::StripSuffix(buf, "\n"));
    return true;
  }
  // The rest of the first line starting with `prefix`; "" at end of output.
  std::string Line(const std::string& prefix) {
    for (std::string l; NextLine(&l);) {
      if (l.rfind(prefix, 0) == 0) return l.substr(prefix.size());
    }
    return "";
  }
  pid_t pid() const { return pid_; }
  // Reaps the process once it exits by itself: its exit code, or -1 when it
  // was killed by a signal or is still running after `timeout` (then it is
  // killed).
  int Wait(absl::Duration timeout) {
    if (pid_ <= 0) return -1;
    const absl::Time deadline = absl::Now() + timeout;
    int status = 0;
    pid_t r;
    while ((r = waitpid(pid_, &status, WNOHANG)) == 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    if (r == 0) {
      Stop(SIGKILL);
      return -1;
    }
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  // Sends `sig` and reaps the process (SIGKILL after 15 s).
  void Stop(int sig) {
    if (pid_ <= 0) return;
    kill(pid_, sig);
    const absl::Time deadline = absl::Now() + absl::Seconds(15);
    while (waitpid(pid_, nullptr, WNOHANG) == 0) {
      if (absl::Now() > deadline) {
        kill(pid_, SIGKILL);
        waitpid(pid_, nullptr, 0);
        break;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
};

// `emberctl coordinator` and N `emberctl worker`s as separate processes on
// 127.0.0.1, so that the coordinator can be killed and started again alone
// (at the same address, with the same flags).
class StandaloneCluster {
 public:
  // `crash_at`: EMBER_COORDINATOR_CRASH_AT for the first coordinator only.
  // `worker_flags`: more flags for every worker ("--device=cuda_emulated").
  StandaloneCluster(const std::string& emberctl, int workers,
                    std::vector<std::string> coordinator_flags, const std::string& crash_at = "",
                    const std::vector<std::string>& worker_flags = {})
      : emberctl_(emberctl), flags_(std::move(coordinator_flags)) {
    if (!StartCoordinator("127.0.0.1:0", crash_at)) return;
    // Workers share the coordinator's checkpoint root (their files lie
    // under it).
    // An explicit share of memory each: N workers on one host with the
    // host's default would overcommit it (the coordinator refuses that).
    std::vector<std::string> worker_args = {emberctl, "worker", "--coordinator=" + address_,
                                            "--listen=127.0.0.1:0", "--memory_gib=2"};
    for (const std::string& f : flags_) {
      if (f.rfind("--checkpoint_dir=", 0) == 0) worker_args.push_back(f);
    }
    worker_args.insert(worker_args.end(), worker_flags.begin(), worker_flags.end());
    for (int i = 0; i < workers; ++i) {
      workers_.push_back(std::make_unique<Process>(worker_args));
      if (workers_.back()->Line("worker ").empty()) return;
    }
    ok_ = true;
  }
  bool ok() const { return ok_; }
  const std::string& address() const { return address_; }
  Process& coordinator() { return *coordinator_; }
  std::vector<std::unique_ptr<Process>>& workers() { return workers_; }
  // Kills the coordinator (if it still runs) and starts it again.
  bool RestartCoordinator() {
    coordinator_->Stop(SIGKILL);
    return StartCoordinator(address_, "");
  }

 private:
  bool StartCoordinator(const std::string& listen, const std::string& crash_at) {
    std::vector<std::string> args = {emberctl_, "coordinator", "--listen=" + listen};
    args.insert(args.end(), flags_.begin(), flags_.end());
    if (!crash_at.empty()) setenv("EMBER_COORDINATOR_CRASH_AT", crash_at.c_str(), 1);
    coordinator_ = std::make_unique<Process>(args);
    unsetenv("EMBER_COORDINATOR_CRASH_AT");
    const std::string address = coordinator_->Line("coordinator listening on ");
    if (!address.empty()) address_ = address;
    return !address.empty();
  }

  const std::string emberctl_;
  const std::vector<std::string> flags_;
  std::unique_ptr<Process> coordinator_;
  std::vector<std::unique_ptr<Process>> workers_;
  std::string address_;
  bool ok_ = false;
};

// `emberctl up --workers=N` as a child process, stopped when destroyed.
class LocalCluster {
 public:
  // Starts the cluster; ok() tells whether it came up within 60 s. `extra`:
  // more `emberctl up` flags ("--threads=2").
  LocalCluster(const std::string& emberctl, int workers, std::vector<std::string> extra = {})
      : process_(Args(emberctl, workers, std::move(extra))) {
    for (std::string line; process_.NextLine(&line);) {
      std::vector<std::string> w = absl::StrSplit(line, ' ', absl::SkipWhitespace());
      if (w.size() >= 2 && w[0] == "coordinator:") coordinator_ = w[1];
      if (w.size() >= 5 && w[0] == "worker" && w[3] == "pid") worker_pids_.push_back(std::stoi(w[4]));
      if (w.size() >= 1 && w[0] == "ready:") {
        ready_ = true;
        break;
      }
    }
  }

  bool ok() const { return ready_ && !coordinator_.empty(); }
  // The `emberctl up` process (which runs the coordinator).
  pid_t pid() const { return process_.pid(); }
  const std::string& coordinator() const { return coordinator_; }
  const std::vector<int>& worker_pids() const { return worker_pids_; }

 private:
  static std::vector<std::string> Args(const std::string& emberctl, int workers,
                                       std::vector<std::string> extra) {
    std::vector<std::string> args = {emberctl, "up", absl::StrCat("--workers=", workers),
                                     "--lease_ms=3000"};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }

  Process process_;
  bool ready_ = false;
  std::string coordinator_;
  std::vector<int> worker_pids_;
};

}  // namespace testing_util
}  // namespace ember

#endif  // EMBER_TESTS_LOCAL_CLUSTER_H_
