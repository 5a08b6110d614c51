// A fault-injection point for tests: EMBER_COORDINATOR_CRASH_AT=<point>
// makes the coordinator exit there at once, as kill -9 would;
// EMBER_COORDINATOR_PAUSE_AT=<point> makes it wait there for
// EMBER_COORDINATOR_PAUSE_MS (default 3000) ms, a test's window onto a
// state that otherwise passes in an instant. FailPoint: with
// EMBER_COORDINATOR_FAIL_AT=<point>[,<point>...], the step there fails
// (UNAVAILABLE) the first time each point is reached, as a worker's
// refusal would.
#ifndef EMBER_SERVER_COORDINATOR_CRASH_POINT_H_
#define EMBER_SERVER_COORDINATOR_CRASH_POINT_H_

#include <unistd.h>

#include <cstdlib>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"

namespace ember {
namespace coordinator {

inline void CrashPoint(const char* point) {
  static const char* at = std::getenv("EMBER_COORDINATOR_CRASH_AT");
  if (at != nullptr && std::string(at) == point) {
    LOG(ERROR) << "EMBER_COORDINATOR_CRASH_AT=" << point << ": exiting";
    _exit(137);
  }
  static const char* pause = std::getenv("EMBER_COORDINATOR_PAUSE_AT");
  if (pause != nullptr && std::string(pause) == point) {
    static const char* ms = std::getenv("EMBER_COORDINATOR_PAUSE_MS");
    const int wait_ms = ms != nullptr ? std::atoi(ms) : 3000;
    LOG(WARNING) << "EMBER_COORDINATOR_PAUSE_AT=" << point << ": waiting " << wait_ms << " ms";
    usleep(static_cast<useconds_t>(wait_ms) * 1000);
  }
}

inline absl::Status FailPoint(const char* point) {
  static const char* at = std::getenv("EMBER_COORDINATOR_FAIL_AT");
  if (at == nullptr) return absl::OkStatus();
  static absl::Mutex mu;
  static std::set<std::string>* failed = new std::set<std::string>();
  absl::MutexLock lock(&mu);
  for (absl::string_view p : absl::StrSplit(at, ',')) {
    if (p == point && failed->insert(point).second) {
      LOG(ERROR) << "EMBER_COORDINATOR_FAIL_AT=" << point << ": failing this step";
      return absl::UnavailableError(absl::StrCat("injected failure at ", point));
    }
  }
  return absl::OkStatus();
}

}  // namespace coordinator
}  // namespace ember

#endif  // EMBER_SERVER_COORDINATOR_CRASH_POINT_H_
