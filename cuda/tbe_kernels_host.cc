// tbe_kernels.h on the host CUDA runtime (host_runtime.h): each launch is
// queued on its stream and runs there with host_kernels.h, and, as the nvcc
// launchers do, answers cudaGetLastError() after queuing. The temporary
// storage asked for is the emulated backend's stand-in for CUB's, which the
// launches scribble over. For the *_on_host test targets.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>

#include "cuda/host_kernels.h"
#include "cuda/host_runtime.h"
#include "cuda/tbe_kernels.h"

namespace ember {
namespace cuda {

namespace {

cudaError_t Launch(cudaStream_t stream, std::function<void()> op) {
  if (const cudaError_t e = HostLaunch(stream, std::move(op)); e != cudaSuccess) return e;
  return cudaGetLastError();
}

}  // namespace

cudaError_t LookupTempBytes(int64_t bags, size_t* bytes) {
  *bytes = HostTempBytes(bags);
  return cudaSuccess;
}

cudaError_t BackwardTempBytes(int64_t bags, int64_t ids, int, size_t* bytes) {
  *bytes = HostTempBytes(std::max(bags, ids));
  return cudaSuccess;
}

cudaError_t LaunchLookup(const LookupLaunch& a, int, cudaStream_t stream) {
  return Launch(stream, [a] { RunLookupOnHost(a); });
}

cudaError_t LaunchBackward(const BackwardLaunch& a, int, cudaStream_t stream) {
  if (a.total_ids <= 0) return cudaErrorInvalidValue;  // as tbe_kernels.cu answers
  return Launch(stream, [a] { RunBackwardOnHost(a); });
}

cudaError_t LaunchCheckInputs(const InputCheckLaunch& a, int, cudaStream_t stream) {
  if (a.total <= 0) return cudaSuccess;
  return Launch(stream, [a] {
    for (int64_t e = 0; e < a.total; ++e) {
      if (kernels::BadInputOne(e, a.begin, a.descs, a.num_requests, a.max_bits) &&
          *a.first_bad > static_cast<unsigned long long>(e)) {  // NOLINT(runtime/int)
        *a.first_bad = static_cast<unsigned long long>(e);      // NOLINT(runtime/int)
      }
    }
  });
}

cudaError_t LaunchMeasure(const MeasureLaunch& a, int, cudaStream_t stream) {
  const int64_t total = a.rows * (a.dim + a.state_width);
  if (total <= 0) return cudaSuccess;
  return Launch(stream, [a, total] {
    for (int64_t e = 0; e < total; ++e) kernels::MeasureOne(e, a, a.out);
  });
}

cudaError_t LaunchKeyFind(const KeyFindLaunch& a, int, cudaStream_t stream) {
  if (a.n <= 0) return cudaSuccess;
  return Launch(stream, [a] {
    for (int64_t e = 0; e < a.n; ++e) kernels::KeyFindOne(e, a.ids, a.lines, a.mask, a.missing);
  });
}

cudaError_t LaunchCopyRows(const CopyRowsLaunch& a, int, cudaStream_t stream) {
  const int64_t total = a.n * a.words;
  if (total <= 0) return cudaSuccess;
  return Launch(stream, [a, total] {
    for (int64_t e = 0; e < total; ++e) {
      kernels::CopyRowWordOne(e, a.rows, a.words, a.from, a.to, a.gather);
    }
  });
}

cudaError_t LaunchFill(float* p, int64_t n, float value, int, cudaStream_t stream) {
  return Launch(stream, [p, n, value] {
    for (int64_t i = 0; i < n; ++i) p[i] = value;
  });
}

cudaError_t LaunchFault(cudaStream_t stream) { return HostLaunchFault(stream); }

}  // namespace cuda
}  // namespace ember
