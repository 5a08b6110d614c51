// How the worker names a shard in its messages: "table 'T' shard I".
//
// Thread-safe: a pure function.
#ifndef EMBER_SERVER_WORKER_SHARD_NAMES_H_
#define EMBER_SERVER_WORKER_SHARD_NAMES_H_

#include <string>

#include "absl/strings/str_cat.h"
#include "proto/service.pb.h"

namespace ember {
namespace worker {

inline std::string RefString(const ember::v1::ShardRef& ref) {
  return absl::StrCat("table '", ref.table(), "' shard ", ref.shard_index());
}

}  // namespace worker
}  // namespace ember

#endif  // EMBER_SERVER_WORKER_SHARD_NAMES_H_
