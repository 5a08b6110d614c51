// Reading collection specs from files.
//
// Thread-safe: pure functions (plus file reads).
#ifndef EMBER_CLI_SPEC_IO_H_
#define EMBER_CLI_SPEC_IO_H_

#include <string>

#include "absl/status/statusor.h"
#include "proto/collection.pb.h"

namespace ember {
namespace cli {

// Parses a collection spec in the proto3 JSON mapping. Field names may be
// snake_case (as in the .proto) or lowerCamelCase; unknown fields are an
// error. INVALID_ARGUMENT with the parser's message on malformed input.
absl::StatusOr<ember::v1::CollectionSpec> ParseCollectionSpecJson(
    const std::string& json);

// Reads and parses `path`. NOT_FOUND if it cannot be opened.
absl::StatusOr<ember::v1::CollectionSpec> ReadCollectionSpec(
    const std::string& path);

}  // namespace cli
}  // namespace ember

#endif  // EMBER_CLI_SPEC_IO_H_
