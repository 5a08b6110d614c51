// CPU scheduling policy for a worker process that shares its host with the
// trainers it serves.
//
// A worker's data calls are compute-bound and start when a request
// arrives. Under Linux's default policy a thread that wakes may preempt the
// thread running on its CPU, so a worker woken by a trainer's first call
// takes the CPU from that trainer before it has sent its calls to the other
// workers: on a host with no idle core, their calls then reached them up
// to milliseconds later (docs/lab-notes/2026-11-benchmarks.md). SCHED_BATCH threads never
// preempt on waking; otherwise they get their fair share of the CPU, as
// before.
//
// Thread-safe.
#ifndef EMBER_SERVER_COMMON_SCHEDULING_H_
#define EMBER_SERVER_COMMON_SCHEDULING_H_

#include "absl/status/status.h"

namespace ember {

// Puts the calling thread under SCHED_BATCH (priority 0, no privilege
// needed); threads it creates afterwards inherit the policy, so a process
// calls it first, before it starts any. An error status (errno's text)
// where the kernel refused (a seccomp profile that forbids
// sched_setscheduler), UNIMPLEMENTED off Linux.
absl::Status UseBatchScheduling();

}  // namespace ember

#endif  // EMBER_SERVER_COMMON_SCHEDULING_H_
