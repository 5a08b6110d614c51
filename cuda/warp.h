// The warp the kernel bodies (kernel_bodies.h) are written against: its lane
// and its shuffles. DeviceWarp is the real one (nvcc); HostWarp runs the 32
// lanes of a body in lockstep on one CPU thread, each lane a fiber that
// yields at every shuffle, so the same kernel code runs in CPU tests and
// gives the same bits (the arithmetic and its order are the same).
#ifndef EMBER_CUDA_WARP_H_
#define EMBER_CUDA_WARP_H_

#include <cstdint>
#include <cstring>
#include <functional>

// Kernel-body functions: device functions under nvcc, plain inline C++ in
// host builds (the emulated backend and its tests).
#if defined(__CUDACC__)
#define EMBER_KERNEL __device__ __forceinline__
#else
#define EMBER_KERNEL inline
#endif

namespace ember {
namespace cuda {

constexpr int kWarpSize = 32;

#if defined(__CUDACC__)
struct DeviceWarp {
  __device__ __forceinline__ int lane() const { return threadIdx.x % kWarpSize; }
  template <typename T>
  __device__ __forceinline__ T shfl(T v, int src) const {
    return __shfl_sync(0xffffffffu, v, src);
  }
  template <typename T>
  __device__ __forceinline__ T shfl_xor(T v, int mask) const {
    return __shfl_xor_sync(0xffffffffu, v, mask);
  }
};
#else
// Not thread-safe across lanes by design (they are fibers of one thread);
// separate Run calls on separate threads are independent.
class HostWarp {
 public:
  // Runs body(warp) for lanes 0..31 in lockstep. Every shuffle must be
  // reached by all 32 lanes (the full-mask rule of the device code);
  // otherwise the process aborts with a message.
  static void Run(const std::function<void(HostWarp&)>& body);

  int lane() const { return lane_; }
  template <typename T>
  T shfl(T v, int src) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    bits = Exchange(bits, src & (kWarpSize - 1));
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
  }
  template <typename T>
  T shfl_xor(T v, int mask) {
    return shfl(v, lane_ ^ mask);
  }

  struct Group;  // the lanes' fibers and shuffle slots (host_warp.cc)

 private:
  HostWarp(Group* group, int lane) : group_(group), lane_(lane) {}
  uint64_t Exchange(uint64_t mine, int src);
  static void LaneMain(int lane);

  Group* group_;
  int lane_;
};
#endif

}  // namespace cuda
}  // namespace ember

#endif  // EMBER_CUDA_WARP_H_
