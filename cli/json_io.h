// JSON and NumPy files of the CLI: KeyedJaggedTensor input, KeyedTensor
// output / gradients, and float32 .npy tables.
//
// Thread-safe: pure functions (plus file I/O).
#ifndef EMBER_CLI_JSON_IO_H_
#define EMBER_CLI_JSON_IO_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/kjt.h"

namespace ember {
namespace cli {

// {"keys": [...], "lengths": [...], "values": [...], "weights": [...]?}
// (TorchRec's KJT layout, lengths key-major). INVALID_ARGUMENT naming the
// problem for malformed input; the layout is checked by Validate().
absl::StatusOr<client::KeyedJaggedTensor> ParseKjtJson(const std::string& json);

// {"keys": [...], "length_per_key": [...], "values": [[row 0], [row 1], ...]}
absl::StatusOr<client::KeyedTensor> ParseKeyedTensorJson(const std::string& json);
std::string KeyedTensorToJson(const client::KeyedTensor& kt);

absl::StatusOr<std::string> ReadFile(const std::string& path);
absl::Status WriteFile(const std::string& path, const std::string& contents);

// A float32 [rows, cols] C-order .npy file (format version 1.0).
std::string NpyFloat32(const std::vector<float>& values, int64_t rows, int64_t cols);
// An int64 [n] .npy file.
std::string NpyInt64(const std::vector<int64_t>& values);

}  // namespace cli
}  // namespace ember

#endif  // EMBER_CLI_JSON_IO_H_
