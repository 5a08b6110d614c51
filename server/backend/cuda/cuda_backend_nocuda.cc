// Built instead of cuda_backend.cc where nvcc is absent.
#include "absl/status/status.h"
#include "server/backend/cuda/cuda_backend.h"

namespace ember {
namespace backend {

absl::StatusOr<std::unique_ptr<backend::EmbeddingBackend>> CreateCudaBackend(
    const CudaBackendOptions&) {
  return absl::UnavailableError("built without CUDA");
}

absl::Status InjectDeviceFaultForTest(backend::EmbeddingBackend*) {
  return absl::UnavailableError("built without CUDA");
}

}  // namespace backend
}  // namespace ember
