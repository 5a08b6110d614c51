// The NCCL entry points nccl_link.cc calls, as a table, so that a test can
// put its own behind NCCL links (fake_nccl.h runs them over a socket on the
// host CUDA runtime in CI).
#ifndef EMBER_LINK_NCCL_API_H_
#define EMBER_LINK_NCCL_API_H_

#include <nccl.h>

#include "link/peer_link.h"

namespace ember {
namespace cuda {

struct NcclApi {
  decltype(&ncclGetUniqueId) GetUniqueId;
  decltype(&ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&ncclCommAbort) CommAbort;
  decltype(&ncclSend) Send;
  decltype(&ncclRecv) Recv;
  decltype(&ncclGetErrorString) GetErrorString;
};

// NCCL links over `api` (NcclLinks() is this over libnccl.so.2's). The
// table must outlive the links; the PeerLinks is the caller's.
std::unique_ptr<PeerLinks> NcclLinksOver(const NcclApi* api);

}  // namespace cuda
}  // namespace ember

#endif  // EMBER_LINK_NCCL_API_H_
