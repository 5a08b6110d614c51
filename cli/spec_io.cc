#include "cli/spec_io.h"

#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"

namespace ember {
namespace cli {

absl::StatusOr<ember::v1::CollectionSpec> ParseCollectionSpecJson(
    const std::string& json) {
  ember::v1::CollectionSpec spec;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  options.case_insensitive_enum_parsing = false;
  const auto status =
      google::protobuf::util::JsonStringToMessage(json, &spec, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed collection spec: ", status.message().as_string()));
  }
  return spec;
}

absl::StatusOr<ember::v1::CollectionSpec> ReadCollectionSpec(
    const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot open spec file '", path, "'"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  auto spec = ParseCollectionSpecJson(buffer.str());
  if (!spec.ok()) {
    return absl::Status(spec.status().code(),
                        absl::StrCat(path, ": ", spec.status().message()));
  }
  return spec;
}

}  // namespace cli
}  // namespace ember
