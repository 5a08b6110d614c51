// A fault-injection point for tests: EMBER_COORDINATOR_CRASH_AT=<point>
// makes the coordinator exit there at once, as kill -9 would.
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
}

}  // namespace coordinator
}  // namespace ember

#endif  // EMBER_SERVER_COORDINATOR_CRASH_POINT_H_
