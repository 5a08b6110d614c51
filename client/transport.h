// How one worker request's bulk arrays travel. The client's routing
// (client.cc) writes every array of a request (lengths, ids, weights,
// gradients) through a Transport and reads every output back through it, so
// the routing is one implementation whatever carries the bytes:
//
//   InlineTransport  the bytes fields of the gRPC message (the default, and
//                    the fallback when no channel is to be had);
//   ShmTransport     a shared-memory channel to the worker (shm_channel.h):
//                    arrays are written straight into its region, the
//                    message carries only slices naming where, and the
//                    worker writes lookup outputs into the region too.
//                    Over a link channel the region is this process's own,
//                    the worker keeps a copy, and the bytes cross the link:
//                    sent before the message (Sending), a lookup's outputs
//                    received after the answer (Received).
//
// The gRPC message stays the control message of every transfer (collection,
// epoch, request id, shapes), so validation, epochs and exactly-once work
// the same whatever carries the bytes.
#ifndef EMBER_CLIENT_TRANSPORT_H_
#define EMBER_CLIENT_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "client/shm_channel.h"
#include "proto/service.pb.h"

namespace ember {
namespace client {

class Transport {
 public:
  virtual ~Transport() = default;

  // Room for an array of `bytes` (`field`: the array's bytes field in the
  // message), to be filled and then cut with Keep to the `used` bytes at
  // `data` (what Take returned). Several arrays may be taken before any is
  // kept. `slice` makes the array's shared-memory slice (called only by a
  // transport that uses it: a slice present in a message says the array is
  // in a channel).
  using SliceFn = absl::FunctionRef<ember::v1::ShmSlice*()>;
  virtual char* Take(std::string* field, uint64_t bytes) = 0;
  virtual void Keep(std::string* field, SliceFn slice, const char* data, uint64_t used) = 0;

  // Lookups: where output `index` of `request` is to be written (shared
  // memory: room in the region, named by a slice in the request), and the
  // output's bytes once the call succeeded. INTERNAL when the worker's
  // answer does not hold it.
  virtual void AddOutput(ember::v1::WorkerLookupRequest* request, uint64_t bytes) = 0;
  // `scratch` holds a copy when the inline bytes are not aligned for floats.
  virtual absl::Status Output(const ember::v1::WorkerLookupRequest& request,
                              const ember::v1::WorkerLookupResponse& response, int index,
                              std::vector<float>* scratch, absl::Span<const float>* out) = 0;

  // The call failed: a channel is not to be trusted again.
  virtual void Failed() {}

  // Link channels: just before the call's message goes, sends the arrays
  // taken so far over the link and names them in `sent` (the request's
  // link_sent); for a lookup (`reply` not null) names the outputs' bytes the
  // worker sends back. Received takes those once the call succeeded, and
  // waits for the whole exchange, by `deadline` (after every successful
  // call, a lookup's or an update's: the region is not to be rewritten
  // before). Failing, the channel is lost (Failed) and the call is to be
  // retried. Called only where Linked().
  virtual absl::Status Sending(ember::v1::ShmSlice* sent, ember::v1::ShmSlice* reply) {
    return absl::OkStatus();
  }
  virtual absl::Status Received(absl::Time deadline) { return absl::OkStatus(); }
  // A link channel's call that ended without its whole exchange (refused,
  // failed, or its outputs never received): the link may be out of step.
  virtual bool Unfinished() const { return false; }
  // A link channel's call the worker refused after taking its bytes off
  // the link (kLinkBytesTaken): once the send is done (by `deadline`) the
  // exchange is finished and the link in step.
  virtual void Settled(absl::Time deadline) {}
  // Whether this is a link channel's (the worker cannot map this process's
  // buffers through it).
  virtual bool Linked() const { return false; }

  // Link channels, for arrays in device memory (Client::LookupOnDevice):
  // reserves room for `rows` rows of `width` bytes, names it as Keep does,
  // and has Sending copy them there in the link's memory from `src` (rows
  // `src_pitch` bytes apart) before the call's bytes go. And after
  // Received, queues output `index`'s rows (`cols` floats each) to device
  // memory `dst`, `dst_pitch` bytes apart; WaitCopies waits for those.
  // Called only where Linked().
  virtual void KeepOnDevice(std::string* field, SliceFn slice, const void* src,
                            uint64_t src_pitch, uint64_t width, uint64_t rows) {}
  virtual absl::Status OutputToDevice(const ember::v1::WorkerLookupRequest& request, int index,
                                      float* dst, uint64_t dst_pitch, int64_t cols) {
    return absl::UnimplementedError("no link channel");
  }
  virtual absl::Status WaitCopies(absl::Time deadline) { return absl::OkStatus(); }

  // Whether the request may name a shared buffer of this process for the
  // worker to read ids from (ChannelPool::Lease::NamesIdBuffers), and the
  // worker's refusal of one (later calls to it send the ids as arrays).
  virtual bool NamesBuffers() const { return false; }
  virtual void BuffersRefused() {}

  // The request's channel_id and channel_seq (WorkerLookupRequest /
  // WorkerApplyGradientsRequest): 0 inline.
  virtual uint64_t channel_id() const { return 0; }
  virtual uint64_t channel_seq() const { return 0; }

  // Typed forms of Take / Keep.
  template <typename T>
  absl::Span<T> TakeArray(std::string* field, int64_t count) {
    return absl::Span<T>(reinterpret_cast<T*>(Take(field, count * sizeof(T))), count);
  }
  template <typename T>
  void KeepArray(std::string* field, SliceFn slice, absl::Span<const T> kept) {
    Keep(field, slice, reinterpret_cast<const char*>(kept.data()), kept.size() * sizeof(T));
  }
};

// Arrays in the message's bytes fields.
class InlineTransport : public Transport {
 public:
  char* Take(std::string* field, uint64_t bytes) override;
  void Keep(std::string* field, SliceFn slice, const char* data, uint64_t used) override;
  void AddOutput(ember::v1::WorkerLookupRequest* request, uint64_t bytes) override {}
  absl::Status Output(const ember::v1::WorkerLookupRequest& request,
                      const ember::v1::WorkerLookupResponse& response, int index,
                      std::vector<float>* scratch, absl::Span<const float>* out) override;
};

// Arrays in a shared-memory channel's region, laid out in the order they
// are taken, each 64-byte aligned. The lease holds the channel for this one
// call; the region must be large enough for everything the call takes
// (the caller sizes it by upper bounds).
class ShmTransport : public Transport {
 public:
  explicit ShmTransport(ChannelPool::Lease lease)
      : lease_(std::move(lease)), seq_(lease_.get()->NextSeq()) {}
  uint64_t channel_id() const override { return lease_.get()->id(); }
  uint64_t channel_seq() const override { return seq_; }

  char* Take(std::string* field, uint64_t bytes) override;
  void Keep(std::string* field, SliceFn slice, const char* data, uint64_t used) override;
  void AddOutput(ember::v1::WorkerLookupRequest* request, uint64_t bytes) override;
  absl::Status Output(const ember::v1::WorkerLookupRequest& request,
                      const ember::v1::WorkerLookupResponse& response, int index,
                      std::vector<float>* scratch, absl::Span<const float>* out) override;
  void Failed() override { lease_.Invalidate(); }
  absl::Status Sending(ember::v1::ShmSlice* sent, ember::v1::ShmSlice* reply) override;
  absl::Status Received(absl::Time deadline) override;
  bool Unfinished() const override { return Linked() && !finished_; }
  void Settled(absl::Time deadline) override;
  bool Linked() const override { return lease_.get()->link() != nullptr; }
  void KeepOnDevice(std::string* field, SliceFn slice, const void* src, uint64_t src_pitch,
                    uint64_t width, uint64_t rows) override;
  absl::Status OutputToDevice(const ember::v1::WorkerLookupRequest& request, int index,
                              float* dst, uint64_t dst_pitch, int64_t cols) override;
  absl::Status WaitCopies(absl::Time deadline) override;
  bool NamesBuffers() const override { return lease_.NamesIdBuffers(); }
  void BuffersRefused() override { lease_.IdBufferRefused(); }

  // Bytes a region needs for arrays of these sizes (each aligned).
  static uint64_t Aligned(uint64_t bytes) { return (bytes + 63) / 64 * 64; }

 private:
  ChannelPool::Lease lease_;
  const uint64_t seq_;  // this call's transfer number on the channel
  uint64_t at_ = 0;     // the next array's offset
  // The outputs' bytes [out_begin_, out_end_) (AddOutput); a link channel's
  // exchange done (sent and, for a lookup, received).
  uint64_t out_begin_ = UINT64_MAX, out_end_ = 0;
  bool expects_reply_ = false;
  bool finished_ = false;
  // Arrays in device memory, copied into the link's memory at `at` by
  // Sending (KeepOnDevice).
  struct DeviceArray {
    uint64_t at;
    const void* src;
    uint64_t src_pitch, width, rows;
  };
  std::vector<DeviceArray> device_arrays_;
  // Received outputs still only in the link's memory: Output copies its
  // slice to the region first.
  bool outputs_in_link_ = false;
  bool outputs_copied_ = false;  // to the region (Output)
  absl::Time deadline_;  // Received's, for those copies
};

}  // namespace client
}  // namespace ember

#endif  // EMBER_CLIENT_TRANSPORT_H_
