#include "cli/json_io.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"

namespace ember {
namespace cli {
namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;
using google::protobuf::Value;

absl::StatusOr<Struct> ParseObject(const std::string& json) {
  Struct s;
  const auto st = google::protobuf::util::JsonStringToMessage(json, &s);
  if (!st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("not a JSON object: ", st.message().as_string()));
  }
  return s;
}

absl::Status CheckFields(const Struct& s, std::initializer_list<const char*> allowed) {
  for (const auto& [name, v] : s.fields()) {
    bool ok = false;
    for (const char* a : allowed) ok = ok || name == a;
    if (!ok) return absl::InvalidArgumentError(absl::StrCat("unknown field '", name, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<const ListValue*> List(const Struct& s, const char* name, bool required) {
  auto it = s.fields().find(name);
  if (it == s.fields().end()) {
    if (required) return absl::InvalidArgumentError(absl::StrCat("missing field '", name, "'"));
    return nullptr;
  }
  if (it->second.kind_case() != Value::kListValue) {
    return absl::InvalidArgumentError(absl::StrCat("'", name, "' must be an array"));
  }
  return &it->second.list_value();
}

template <typename Vector>  // of int64_t
absl::Status Ints(const ListValue& l, const char* name, Vector* out) {
  for (int i = 0; i < l.values_size(); ++i) {
    const Value& v = l.values(i);
    if (v.kind_case() != Value::kNumberValue || std::floor(v.number_value()) != v.number_value() ||
        std::abs(v.number_value()) > 9007199254740992.0) {
      return absl::InvalidArgumentError(absl::StrCat(name, "[", i, "] is not an integer"));
    }
    out->push_back(static_cast<int64_t>(v.number_value()));
  }
  return absl::OkStatus();
}

template <typename Vector>
absl::Status Floats(const ListValue& l, const std::string& name, Vector* out) {
  for (int i = 0; i < l.values_size(); ++i) {
    if (l.values(i).kind_case() != Value::kNumberValue) {
      return absl::InvalidArgumentError(absl::StrCat(name, "[", i, "] is not a number"));
    }
    out->push_back(static_cast<float>(l.values(i).number_value()));
  }
  return absl::OkStatus();
}

absl::Status Strings(const ListValue& l, const char* name, std::vector<std::string>* out) {
  for (int i = 0; i < l.values_size(); ++i) {
    if (l.values(i).kind_case() != Value::kStringValue) {
      return absl::InvalidArgumentError(absl::StrCat(name, "[", i, "] is not a string"));
    }
    out->push_back(l.values(i).string_value());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<client::KeyedJaggedTensor> ParseKjtJson(const std::string& json) {
  auto s = ParseObject(json);
  if (!s.ok()) return s.status();
  if (absl::Status st = CheckFields(*s, {"keys", "lengths", "values", "weights"}); !st.ok()) {
    return st;
  }
  client::KeyedJaggedTensor kjt;
  auto keys = List(*s, "keys", true);
  auto lengths = List(*s, "lengths", true);
  auto values = List(*s, "values", true);
  auto weights = List(*s, "weights", false);
  for (const auto* l : {&keys, &lengths, &values, &weights}) {
    if (!l->ok()) return l->status();
  }
  if (absl::Status st = Strings(**keys, "keys", &kjt.keys); !st.ok()) return st;
  if (absl::Status st = Ints(**lengths, "lengths", &kjt.lengths); !st.ok()) return st;
  if (absl::Status st = Ints(**values, "values", &kjt.values); !st.ok()) return st;
  if (*weights != nullptr) {
    if (absl::Status st = Floats(**weights, "weights", &kjt.weights); !st.ok()) return st;
  }
  if (absl::Status st = kjt.Validate(); !st.ok()) return st;
  return kjt;
}

absl::StatusOr<client::KeyedTensor> ParseKeyedTensorJson(const std::string& json) {
  auto s = ParseObject(json);
  if (!s.ok()) return s.status();
  if (absl::Status st = CheckFields(*s, {"keys", "length_per_key", "values"}); !st.ok()) return st;
  client::KeyedTensor kt;
  auto keys = List(*s, "keys", true);
  auto dims = List(*s, "length_per_key", true);
  auto values = List(*s, "values", true);
  for (const auto* l : {&keys, &dims, &values}) {
    if (!l->ok()) return l->status();
  }
  if (absl::Status st = Strings(**keys, "keys", &kt.keys); !st.ok()) return st;
  if (absl::Status st = Ints(**dims, "length_per_key", &kt.length_per_key); !st.ok()) return st;
  if (kt.keys.size() != kt.length_per_key.size()) {
    return absl::InvalidArgumentError("keys and length_per_key differ in length");
  }
  const int64_t width = kt.row_width();
  kt.batch_size = (*values)->values_size();
  for (int b = 0; b < (*values)->values_size(); ++b) {
    const Value& row = (*values)->values(b);
    if (row.kind_case() != Value::kListValue || row.list_value().values_size() != width) {
      return absl::InvalidArgumentError(
          absl::StrCat("values[", b, "] must be an array of ", width, " numbers"));
    }
    if (absl::Status st = Floats(row.list_value(), absl::StrCat("values[", b, "]"), &kt.values);
        !st.ok()) {
      return st;
    }
  }
  return kt;
}

std::string KeyedTensorToJson(const client::KeyedTensor& kt) {
  std::ostringstream o;
  o.precision(9);
  o << "{\"keys\": [";
  for (size_t k = 0; k < kt.keys.size(); ++k) o << (k ? ", " : "") << "\"" << kt.keys[k] << "\"";
  o << "], \"length_per_key\": [";
  for (size_t k = 0; k < kt.length_per_key.size(); ++k) o << (k ? ", " : "") << kt.length_per_key[k];
  o << "], \"values\": [";
  const int64_t width = kt.row_width();
  for (int64_t b = 0; b < kt.batch_size; ++b) {
    o << (b ? ", " : "") << "[";
    for (int64_t c = 0; c < width; ++c) o << (c ? ", " : "") << kt.values[b * width + c];
    o << "]";
  }
  o << "]}\n";
  return o.str();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out || !out.write(contents.data(), contents.size()) || !out.flush()) {
    return absl::PermissionDeniedError(absl::StrCat("cannot write '", path, "'"));
  }
  return absl::OkStatus();
}

namespace {

// A C-order .npy file (format version 1.0) of `descr` with `shape` (the
// text inside the parentheses) over `data`.
std::string Npy(const char* descr, const std::string& shape, const char* data, size_t bytes) {
  std::string header =
      absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': (", shape, "), }");
  // Magic + version + header length, then the header padded with spaces and
  // ending in '\n' so the data starts on a 64-byte boundary.
  const size_t preamble = 10;
  size_t total = preamble + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  const uint16_t len = static_cast<uint16_t>(header.size());
  out.push_back(static_cast<char>(len & 0xff));
  out.push_back(static_cast<char>(len >> 8));
  out += header;
  out.append(data, bytes);
  return out;
}

}  // namespace

std::string NpyFloat32(const std::vector<float>& values, int64_t rows, int64_t cols) {
  return Npy("<f4", absl::StrCat(rows, ", ", cols), reinterpret_cast<const char*>(values.data()),
             values.size() * sizeof(float));
}

std::string NpyInt64(const std::vector<int64_t>& values) {
  return Npy("<i8", absl::StrCat(values.size(), ","), reinterpret_cast<const char*>(values.data()),
             values.size() * sizeof(int64_t));
}

}  // namespace cli
}  // namespace ember
