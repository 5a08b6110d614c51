// Built instead of device_query.cc where the CUDA toolkit is absent.
#include "absl/status/status.h"
#include "cuda/device_query.h"

namespace ember {
namespace cuda {

bool BuiltWithCuda() { return false; }

absl::StatusOr<std::vector<DeviceInfo>> QueryDevices() {
  return absl::UnavailableError("this build of Ember has no CUDA support (nvcc was not found)");
}

}  // namespace cuda
}  // namespace ember
