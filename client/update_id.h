// An update's identity, for exactly-once: a fresh random request id when
// the caller gives none, and the digest of the update's content sent with an
// id the caller chose (so that a worker tells a retry from the id's reuse
// for another update). Private to //client:client.
#ifndef EMBER_CLIENT_UPDATE_ID_H_
#define EMBER_CLIENT_UPDATE_ID_H_

#include <cstdint>
#include <cstring>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "client/kjt.h"

namespace ember {
namespace client {

// A fresh request id: 128 random bits in hex.
inline std::string RandomRequestId() {
  thread_local std::mt19937_64 rng(std::random_device{}() ^
                                   (static_cast<uint64_t>(std::random_device{}()) << 32));
  return absl::StrCat(absl::Hex(rng(), absl::kZeroPad16), absl::Hex(rng(), absl::kZeroPad16));
}

// A stable 64-bit hash of an update's content (the same in every process
// and build), sent with a request id the caller chose so that a worker tells
// a retry from the id's reuse for another update (0 is never a digest).
class UpdateDigest {
 public:
  void Add(const void* data, size_t n) {
    Word(n);
    const char* p = static_cast<const char*>(data);
    for (; n >= 8; n -= 8, p += 8) {
      uint64_t w;
      std::memcpy(&w, p, 8);
      Word(w);
    }
    uint64_t tail = 0;
    std::memcpy(&tail, p, n);
    Word(tail);
  }
  template <typename T>
  void Add(absl::Span<const T> values) {
    Add(values.data(), values.size() * sizeof(T));
  }
  void Add(absl::string_view s) { Add(s.data(), s.size()); }
  void Add(const KjtView& kjt) {
    for (const std::string& k : kjt.keys) Add(k);
    Add(kjt.lengths);
    Add(kjt.values);
    Add(kjt.weights);
  }
  uint64_t value() const {
    uint64_t h = h_;
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
    h ^= h >> 31;
    return h == 0 ? 1 : h;
  }

 private:
  void Word(uint64_t w) {
    h_ = (h_ ^ w) * 0x9e3779b97f4a7c15ULL;
    h_ ^= h_ >> 29;
  }
  uint64_t h_ = 0x243f6a8885a308d3ULL;
};

}  // namespace client
}  // namespace ember

#endif  // EMBER_CLIENT_UPDATE_ID_H_
