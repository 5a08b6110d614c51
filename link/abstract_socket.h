// Two ends meeting at an abstract Unix-domain socket (no file: the name
// lives in the network namespace and goes with its last descriptor): how
// socket peer links (peer_link.h) and the tests' stand-in NCCL
// (fake_nccl.h) connect their two ranks, and the byte transfers both use.
#ifndef EMBER_LINK_ABSTRACT_SOCKET_H_
#define EMBER_LINK_ABSTRACT_SOCKET_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ember {
namespace cuda {

// Rank 0 listens at `name` and accepts one connection; rank 1 connects,
// retrying until the listener is there. The connected descriptor (the
// caller's to close); DEADLINE_EXCEEDED when the other end has not come by
// `deadline`, or once `*abandon` (if given, looked at every 20 ms) is true;
// INVALID_ARGUMENT for an empty name, one too long for an address, or a
// rank other than 0 and 1; UNAVAILABLE when the socket calls fail.
absl::StatusOr<int> MeetAt(const std::string& name, int rank, absl::Time deadline,
                           const std::atomic<bool>* abandon = nullptr);

// Sends / reads all `n` bytes, through short transfers and EINTR; false
// when the other end is gone (errno says why; ECONNRESET at end of stream).
bool WriteAll(int fd, const char* p, uint64_t n);
bool ReadAll(int fd, char* p, uint64_t n);

}  // namespace cuda
}  // namespace ember

#endif  // EMBER_LINK_ABSTRACT_SOCKET_H_
