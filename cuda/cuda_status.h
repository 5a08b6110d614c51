// CUDA runtime errors as absl::Status, at the edge where they happen.
#ifndef EMBER_CUDA_CUDA_STATUS_H_
#define EMBER_CUDA_CUDA_STATUS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace ember {
namespace cuda {

// Driver/device absence is UNAVAILABLE (retry elsewhere), out of memory is
// RESOURCE_EXHAUSTED, everything else INTERNAL.
inline absl::Status CudaErrorToStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string msg =
      absl::StrCat(what, ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  switch (err) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorDevicesUnavailable:
      return absl::UnavailableError(msg);
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace cuda
}  // namespace ember

#define EMBER_RETURN_IF_CUDA_ERROR(expr)                                   \
  do {                                                                     \
    const cudaError_t ember_cuda_err_ = (expr);                            \
    if (ember_cuda_err_ != cudaSuccess) {                                  \
      return ::ember::cuda::CudaErrorToStatus(ember_cuda_err_, #expr);     \
    }                                                                      \
  } while (0)

#endif  // EMBER_CUDA_CUDA_STATUS_H_
