// tbe_kernels.h on the host CUDA runtime (host_runtime.h): each launch is
// queued on its stream and runs there with host_kernels.h. No temporary
// storage is needed. For the *_on_host test targets.
#include <cstdint>

#include "cuda/host_kernels.h"
#include "cuda/host_runtime.h"
#include "cuda/tbe_kernels.h"

namespace ember {
namespace cuda {

cudaError_t LookupTempBytes(int64_t, size_t* bytes) {
  *bytes = 0;
  return cudaSuccess;
}

cudaError_t BackwardTempBytes(int64_t, int64_t, int, size_t* bytes) {
  *bytes = 0;
  return cudaSuccess;
}

cudaError_t LaunchLookup(const LookupLaunch& a, int, cudaStream_t stream) {
  return HostLaunch(stream, [a] { RunLookupOnHost(a); });
}

cudaError_t LaunchBackward(const BackwardLaunch& a, int, cudaStream_t stream) {
  return HostLaunch(stream, [a] { RunBackwardOnHost(a); });
}

cudaError_t LaunchFill(float* p, int64_t n, float value, int, cudaStream_t stream) {
  return HostLaunch(stream, [p, n, value] {
    for (int64_t i = 0; i < n; ++i) p[i] = value;
  });
}

cudaError_t LaunchFault(cudaStream_t stream) { return HostLaunchFault(stream); }

}  // namespace cuda
}  // namespace ember
