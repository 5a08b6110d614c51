// DeviceStage: a device KeyedJaggedTensor's arrays (and an update's
// gradients) copied to the host when a call needs them there, each once,
// and rows copied back to the caller's device memory, through the link
// kind's copies. Private to //client:client.
#ifndef EMBER_CLIENT_DEVICE_STAGE_H_
#define EMBER_CLIENT_DEVICE_STAGE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "link/peer_link.h"

namespace ember {
namespace client {

// A DeviceKjt's arrays (and an update's gradients) copied to host memory
// when a call needs them there, each once, through the link kind's copies.
class DeviceStage {
 public:
  DeviceStage(cuda::PeerLinks* kind, int device, const DeviceKjt& kjt)
      : kind_(kind), device_(device), kjt_(kjt) {}
  const DeviceKjt& kjt() const { return kjt_; }
  bool linked() const { return kind_ != nullptr; }  // the client has link channels

  // Copies `count` elements at device `src` to the host.
  template <typename T>
  absl::Status ToHost(const T* src, int64_t count, std::vector<T>* out) {
    out->resize(count);
    if (count == 0) return absl::OkStatus();
    const uint64_t bytes = count * sizeof(T);
    return kind_->CopyRowsNow(device_, false, out->data(), bytes, src, bytes, bytes, 1);
  }
  // The whole of the KJT's values / weights / the gradients on the host.
  absl::StatusOr<const int64_t*> Ids() { return ids_.Get(this, kjt_.values, kjt_.num_values); }
  absl::StatusOr<const float*> Weights() {
    if (kjt_.weights == nullptr) return nullptr;
    return weights_.Get(this, kjt_.weights, kjt_.num_values);
  }
  // An update's gradients (device, `count` floats at `base`), and their
  // host copy.
  void SetGrads(const float* base, int64_t count) {
    grads_base_ = base;
    grads_count_ = count;
  }
  const float* grads_base() const { return grads_base_; }
  absl::StatusOr<const float*> Grads() { return grads_.Get(this, grads_base_, grads_count_); }
  // Host rows to device memory, or zeros.
  absl::Status RowsToDevice(float* dst, int64_t dst_stride, const float* src, int64_t src_stride,
                            int64_t cols, int64_t rows) {
    return kind_->CopyRowsNow(device_, true, dst, dst_stride * sizeof(float), src,
                              src_stride * sizeof(float), cols * sizeof(float), rows);
  }
  absl::Status ZeroRows(float* dst, int64_t dst_stride, int64_t cols, int64_t rows) {
    zeros_.assign(cols * rows, 0.0f);
    return RowsToDevice(dst, dst_stride, zeros_.data(), cols, cols, rows);
  }

 private:
  // A device array's host copy, made on first use.
  template <typename T>
  struct HostCopy {
    absl::StatusOr<const T*> Get(DeviceStage* stage, const T* src, int64_t count) {
      if (!loaded) {
        if (absl::Status s = stage->ToHost(src, count, &copy); !s.ok()) return s;
        loaded = true;
      }
      return copy.data();
    }
    std::vector<T> copy;
    bool loaded = false;
  };

  cuda::PeerLinks* const kind_;
  const int device_;
  const DeviceKjt& kjt_;
  HostCopy<int64_t> ids_;
  HostCopy<float> weights_, grads_;
  std::vector<float> zeros_;
  const float* grads_base_ = nullptr;
  int64_t grads_count_ = 0;
};

}  // namespace client
}  // namespace ember

#endif  // EMBER_CLIENT_DEVICE_STAGE_H_
