#include "cuda/device_query.h"

#include <cuda_runtime.h>

#include "cuda/cuda_status.h"

namespace ember {
namespace cuda {

bool BuiltWithCuda() { return true; }

absl::StatusOr<std::vector<DeviceInfo>> QueryDevices() {
  int count = 0;
  EMBER_RETURN_IF_CUDA_ERROR(cudaGetDeviceCount(&count));
  std::vector<DeviceInfo> out;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop;
    EMBER_RETURN_IF_CUDA_ERROR(cudaGetDeviceProperties(&prop, i));
    DeviceInfo d;
    d.index = i;
    d.name = prop.name;
    d.total_memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
    d.compute_capability_major = prop.major;
    d.compute_capability_minor = prop.minor;
    d.multiprocessors = prop.multiProcessorCount;
    out.push_back(d);
  }
  if (out.empty()) return absl::UnavailableError("no CUDA device visible");
  return out;
}

}  // namespace cuda
}  // namespace ember
