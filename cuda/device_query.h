// What GPUs this process can see. Host header: exposes no CUDA types, so
// every build (with or without nvcc) compiles against it.
//
// Thread-safe.
#ifndef EMBER_CUDA_DEVICE_QUERY_H_
#define EMBER_CUDA_DEVICE_QUERY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ember {
namespace cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int64_t total_memory_bytes = 0;   // HBM
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  int multiprocessors = 0;
};

// True when this binary was built with the CUDA backend.
bool BuiltWithCuda();

// The visible devices. UNAVAILABLE when built without CUDA, when no driver
// or device is present (the CUDA runtime's message is included), or when
// the driver is too old for the runtime.
absl::StatusOr<std::vector<DeviceInfo>> QueryDevices();

}  // namespace cuda
}  // namespace ember

#endif  // EMBER_CUDA_DEVICE_QUERY_H_
