#include "server/common/scheduling.h"

#include <sched.h>

#include <cerrno>

namespace ember {

absl::Status UseBatchScheduling() {
#ifdef SCHED_BATCH
  sched_param param{};
  param.sched_priority = 0;
  if (sched_setscheduler(0, SCHED_BATCH, &param) != 0) {
    const int err = errno;
    return absl::ErrnoToStatus(err, "sched_setscheduler(SCHED_BATCH)");
  }
  return absl::OkStatus();
#else
  return absl::UnimplementedError("SCHED_BATCH is Linux's; not on this system");
#endif
}

}  // namespace ember
