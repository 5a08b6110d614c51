// NCCL links where the build has no CUDA toolkit (peer_link.h).
#include "link/peer_link.h"

namespace ember {
namespace cuda {

absl::StatusOr<PeerLinks*> NcclLinks() {
  return absl::UnavailableError("NCCL: this build has no CUDA toolkit (built without nccl.h)");
}

}  // namespace cuda
}  // namespace ember
