// A fault-injection point for tests: EMBER_COORDINATOR_CRASH_AT=<point>
// makes the coordinator exit there at once, as kill -9 would;
// EMBER_COORDINATOR_PAUSE_AT=<point> makes it wait there for
// EMBER_COORDINATOR_PAUSE_MS (default 3000) ms, a test's window onto a
// state that otherwise passes in an instant.
#ifndef EMBER_SERVER_COORDINATOR_CRASH_POINT_H_
#define EMBER_SERVER_COORDINATOR_CRASH_POINT_H_

#include <unistd.h>

#include <cstdlib>
#include <string>

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

}  // namespace coordinator
}  // namespace ember

#endif  // EMBER_SERVER_COORDINATOR_CRASH_POINT_H_
