#include "client/transport.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "server/common/wire.h"

namespace ember {
namespace client {

char* InlineTransport::Take(std::string* field, uint64_t bytes) {
  field->resize(bytes);
  return field->empty() ? nullptr : &(*field)[0];
}

void InlineTransport::Keep(std::string* field, SliceFn, const char*, uint64_t used) {
  field->resize(used);
}

absl::Status InlineTransport::Output(const ember::v1::WorkerLookupRequest&,
                                     const ember::v1::WorkerLookupResponse& response, int index,
                                     std::vector<float>* scratch, absl::Span<const float>* out) {
  if (index >= response.outputs_size()) {
    return absl::InternalError(absl::StrCat("the worker returned ", response.outputs_size(),
                                            " outputs, fewer than asked for"));
  }
  if (absl::Status s = wire::View(response.outputs(index), "output", scratch, out); !s.ok()) {
    return absl::InternalError(s.message());
  }
  return absl::OkStatus();
}

char* ShmTransport::Take(std::string*, uint64_t bytes) {
  // The caller sized the region for everything the call takes (upper
  // bounds); past its end is a bug of the caller's, not bad input.
  if (at_ + bytes > lease_.get()->size()) {
    std::fprintf(stderr, "ShmTransport: %llu bytes at %llu overrun a region of %llu\n",
                 static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(at_),
                 static_cast<unsigned long long>(lease_.get()->size()));
    std::abort();
  }
  char* at = lease_.get()->base() + at_;
  at_ += Aligned(bytes);
  return bytes == 0 ? nullptr : at;
}

void ShmTransport::Keep(std::string*, SliceFn slice, const char* data, uint64_t used) {
  if (used == 0) return;  // an empty array: no slice
  ember::v1::ShmSlice* s = slice();
  s->set_offset(static_cast<uint64_t>(data - lease_.get()->base()));
  s->set_size(used);
}

void ShmTransport::AddOutput(ember::v1::WorkerLookupRequest* request, uint64_t bytes) {
  if (at_ + bytes > lease_.get()->size()) {  // as Take
    std::fprintf(stderr, "ShmTransport: an output of %llu bytes overruns the region\n",
                 static_cast<unsigned long long>(bytes));
    std::abort();
  }
  ember::v1::ShmSlice* slice = request->add_shm_outputs();
  slice->set_offset(at_);
  slice->set_size(bytes);
  out_begin_ = std::min(out_begin_, at_);
  out_end_ = at_ + bytes;
  at_ += Aligned(bytes);
}

absl::Status ShmTransport::Sending(ember::v1::ShmSlice* sent, ember::v1::ShmSlice* reply) {
  cuda::PeerLink* link = lease_.get()->link();
  if (link == nullptr) return absl::OkStatus();
  // The arrays lie in [0, first output) (taken before any output), or in
  // [0, at_) for an update.
  const uint64_t n = out_end_ > 0 ? out_begin_ : at_;
  sent->set_offset(0);
  sent->set_size(n);
  expects_reply_ = reply != nullptr && out_end_ > out_begin_;
  if (expects_reply_) {
    reply->set_offset(out_begin_);
    reply->set_size(out_end_ - out_begin_);
  }
  char* memory = lease_.get()->link_memory();
  absl::Status s;
  if (n > 0) {
    // The region's bytes, then the device arrays over their room (stream
    // order), then the whole as one transfer.
    s = link->CopyIn(memory, lease_.get()->base(), n);
    for (const DeviceArray& d : device_arrays_) {
      if (s.ok()) s = link->CopyRows(memory + d.at, d.width, d.src, d.src_pitch, d.width, d.rows);
    }
    if (s.ok()) s = link->Send(memory, n);
  }
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("link channel: ", s.message()));
  return absl::OkStatus();
}

absl::Status ShmTransport::Received(absl::Time deadline) {
  cuda::PeerLink* link = lease_.get()->link();
  if (link == nullptr) return absl::OkStatus();
  absl::Status s;
  // The receive is waited for (and so is the send's copy out of the
  // region, before a later call rewrites it). The outputs stay in the
  // link's memory until Output copies one out (a copy into pageable host
  // memory may block until the stream gets there, out of a deadline's
  // reach: it comes after the wait) or OutputToDevice moves one on.
  const uint64_t n = out_end_ - out_begin_;
  char* memory = lease_.get()->link_memory() + out_begin_;
  if (expects_reply_) s = link->Recv(memory, n);
  if (s.ok()) s = link->Wait(deadline);
  outputs_in_link_ = s.ok() && expects_reply_;
  deadline_ = deadline;
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("link channel: ", s.message()));
  finished_ = true;
  return absl::OkStatus();
}

void ShmTransport::Settled(absl::Time deadline) {
  cuda::PeerLink* link = lease_.get()->link();
  if (link != nullptr && !finished_) finished_ = link->Wait(deadline).ok();
}

void ShmTransport::KeepOnDevice(std::string* field, SliceFn slice, const void* src,
                                uint64_t src_pitch, uint64_t width, uint64_t rows) {
  const uint64_t bytes = width * rows;
  char* room = Take(field, bytes);
  if (bytes == 0) return;
  device_arrays_.push_back(
      DeviceArray{static_cast<uint64_t>(room - lease_.get()->base()), src, src_pitch, width, rows});
  Keep(field, slice, room, bytes);
}

absl::Status ShmTransport::OutputToDevice(const ember::v1::WorkerLookupRequest& request, int index,
                                          float* dst, uint64_t dst_pitch, int64_t cols) {
  if (!outputs_in_link_ || index >= request.shm_outputs_size()) {
    return absl::InternalError(absl::StrCat("no output ", index, " in the link's memory"));
  }
  const ember::v1::ShmSlice& slice = request.shm_outputs(index);
  const uint64_t width = static_cast<uint64_t>(cols) * sizeof(float);
  if (width == 0 || slice.size() % width != 0) {
    return absl::InternalError(absl::StrCat("output ", index, " is not rows of ", cols));
  }
  absl::Status s = lease_.get()->link()->CopyRows(
      dst, dst_pitch, lease_.get()->link_memory() + slice.offset(), width, width,
      slice.size() / width);
  if (!s.ok()) {
    Failed();
    return absl::UnavailableError(absl::StrCat("link channel: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status ShmTransport::WaitCopies(absl::Time deadline) {
  cuda::PeerLink* link = lease_.get()->link();
  if (link == nullptr) return absl::OkStatus();
  absl::Status s = link->Wait(deadline);
  if (!s.ok()) {
    Failed();
    return absl::UnavailableError(absl::StrCat("link channel: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status ShmTransport::Output(const ember::v1::WorkerLookupRequest& request,
                                  const ember::v1::WorkerLookupResponse&, int index,
                                  std::vector<float>*, absl::Span<const float>* out) {
  if (index >= request.shm_outputs_size()) {
    return absl::InternalError(absl::StrCat("no output slice ", index));
  }
  const ember::v1::ShmSlice& slice = request.shm_outputs(index);
  if (outputs_in_link_ && !outputs_copied_) {
    // A link channel's, received: all copied out of the link's memory at
    // the first one asked for (one wait).
    cuda::PeerLink* link = lease_.get()->link();
    absl::Status s = link->CopyOut(lease_.get()->base() + out_begin_,
                                   lease_.get()->link_memory() + out_begin_, out_end_ - out_begin_);
    if (s.ok()) s = link->Wait(deadline_);
    if (!s.ok()) {
      Failed();  // its exchange ended, but the link is not to be used again
      return absl::UnavailableError(absl::StrCat("link channel: ", s.message()));
    }
    outputs_copied_ = true;
  }
  *out = absl::Span<const float>(
      reinterpret_cast<const float*>(lease_.get()->base() + slice.offset()),
      slice.size() / sizeof(float));
  return absl::OkStatus();
}

}  // namespace client
}  // namespace ember
