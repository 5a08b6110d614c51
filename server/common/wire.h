// Little-endian arrays in protobuf `bytes` fields: the payload format of
// every RPC (see proto/service.proto).
//
// Thread-safe: pure functions.
#ifndef EMBER_SERVER_COMMON_WIRE_H_
#define EMBER_SERVER_COMMON_WIRE_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the wire format is little-endian; add byte swapping for this host");

namespace ember {
namespace wire {

// Decodes `bytes` as an array of T into *out. INVALID_ARGUMENT naming
// `what` when the size is not a whole number of elements.
template <typename T>
absl::Status Decode(const std::string& bytes, const char* what, std::vector<T>* out) {
  if (bytes.size() % sizeof(T) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, " holds ", bytes.size(),
                                                   " bytes, not a multiple of ", sizeof(T)));
  }
  out->resize(bytes.size() / sizeof(T));
  if (!bytes.empty()) std::memcpy(out->data(), bytes.data(), bytes.size());
  return absl::OkStatus();
}

// A read-only view of `bytes` as T[] in *out: the bytes themselves when they
// are aligned for T (a heap std::string always is), else a copy made in
// *scratch. *out is valid while `bytes` (and *scratch) live unchanged.
// INVALID_ARGUMENT as Decode's.
template <typename T>
absl::Status View(const std::string& bytes, const char* what, std::vector<T>* scratch,
                  absl::Span<const T>* out) {
  if (reinterpret_cast<uintptr_t>(bytes.data()) % alignof(T) != 0) {
    if (absl::Status s = Decode(bytes, what, scratch); !s.ok()) return s;
    *out = *scratch;
    return absl::OkStatus();
  }
  if (bytes.size() % sizeof(T) != 0) return Decode(bytes, what, scratch);  // the error
  *out = absl::Span<const T>(reinterpret_cast<const T*>(bytes.data()), bytes.size() / sizeof(T));
  return absl::OkStatus();
}

template <typename T>
void Encode(absl::Span<const T> values, std::string* bytes) {
  bytes->resize(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(&(*bytes)[0], values.data(), bytes->size());
}

template <typename T>
std::string Encode(absl::Span<const T> values) {
  std::string bytes;
  Encode(values, &bytes);
  return bytes;
}

// A writable view of `bytes` resized to n elements of T (std::string's heap
// buffer is aligned for any fundamental type).
template <typename T>
absl::Span<T> Resize(std::string* bytes, size_t n) {
  bytes->resize(n * sizeof(T));
  return absl::Span<T>(reinterpret_cast<T*>(bytes->empty() ? nullptr : &(*bytes)[0]), n);
}

}  // namespace wire
}  // namespace ember

#endif  // EMBER_SERVER_COMMON_WIRE_H_
