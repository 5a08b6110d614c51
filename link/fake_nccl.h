// A stand-in for the NCCL library (tests only): two-rank communicators over
// a Unix-domain socket whose transfers run on the host CUDA runtime's
// streams (host_runtime.h), behind the same entry points nccl_link.cc calls
// (nccl_api.h). With it CI runs nccl_link.cc itself: its non-blocking
// initialisation, the polling of its waits against their deadlines, its
// aborts, and its copies in stream order (pageable copies block as CUDA's
// do). What it does not model: NCCL's own protocol, buffers and kernels, a
// GPU. Only what nccl_link.cc asks for is accepted (two ranks, bytes,
// non-blocking communicators).
#ifndef EMBER_LINK_FAKE_NCCL_H_
#define EMBER_LINK_FAKE_NCCL_H_

#include "link/nccl_api.h"

namespace ember {
namespace cuda {

const NcclApi* FakeNccl();

}  // namespace cuda
}  // namespace ember

#endif  // EMBER_LINK_FAKE_NCCL_H_
