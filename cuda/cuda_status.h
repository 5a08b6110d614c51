// CUDA runtime errors as absl::Status, at the edge where they happen.
#ifndef EMBER_CUDA_CUDA_STATUS_H_
#define EMBER_CUDA_CUDA_STATUS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace ember {
namespace cuda {

// Errors that leave the CUDA context unusable for the rest of the process
// ("sticky"): every later runtime call fails with them too. A backend that
// sees one is lost for good (EmbeddingBackend::Health).
inline bool IsStickyError(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorContextIsDestroyed:
      return true;
    default:
      return false;
  }
}

// Driver/device absence and sticky errors are UNAVAILABLE (retry elsewhere),
// out of memory is RESOURCE_EXHAUSTED, everything else INTERNAL.
inline absl::Status CudaErrorToStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string msg =
      absl::StrCat(what, ": ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  if (IsStickyError(err)) {
    return absl::UnavailableError(absl::StrCat(msg, " (the GPU context is lost)"));
  }
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
