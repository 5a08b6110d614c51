#include "server/common/auth.h"

#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace ember {
namespace {

constexpr size_t kMinTokenLength = 16;

// Compares without an early exit, so the time taken does not tell how much
// of a guessed token was right.
bool SameToken(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read token file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The non-empty, non-comment lines, split on whitespace.
std::vector<std::vector<std::string>> Lines(absl::string_view text) {
  std::vector<std::vector<std::string>> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    const size_t hash = line.find('#');
    if (hash != absl::string_view::npos) line = line.substr(0, hash);
    std::vector<std::string> words = absl::StrSplit(line, absl::ByAnyChar(" \t\r"),
                                                    absl::SkipEmpty());
    out.push_back(std::move(words));
  }
  return out;
}

}  // namespace

const char* RoleName(Role r) {
  switch (r) {
    case Role::kWorker:
      return "worker";
    case Role::kTrainer:
      return "trainer";
    default:
      return "admin";
  }
}

absl::StatusOr<TokenTable> TokenTable::Parse(absl::string_view text, const std::string& what) {
  TokenTable t;
  t.enabled_ = true;
  const auto lines = Lines(text);
  for (size_t n = 0; n < lines.size(); ++n) {
    const auto& w = lines[n];
    if (w.empty()) continue;
    const std::string where = absl::StrCat(what, " line ", n + 1);
    if (w.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": expected \"ROLE TOKEN\""));
    }
    int role = -1;
    for (Role r : {Role::kWorker, Role::kTrainer, Role::kAdmin}) {
      if (w[0] == RoleName(r)) role = static_cast<int>(r);
    }
    if (role < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": unknown role (worker, trainer or admin)"));
    }
    if (!t.tokens_[role].empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": role ", w[0], " given twice"));
    }
    if (w[1].size() < kMinTokenLength) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": tokens need at least ", kMinTokenLength, " characters"));
    }
    for (const std::string& other : t.tokens_) {
      if (!other.empty() && SameToken(other, w[1])) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": the same token for two roles"));
      }
    }
    t.tokens_[role] = w[1];
  }
  if (t.tokens_[static_cast<int>(Role::kAdmin)].empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": no admin token"));
  }
  return t;
}

absl::StatusOr<TokenTable> TokenTable::Load(const std::string& path) {
  auto text = ReadFile(path);
  if (!text.ok()) return text.status();
  return Parse(*text, path);
}

std::optional<absl::string_view> AuthorizationOf(const grpc::ServerContext* ctx) {
  if (ctx == nullptr) return std::nullopt;
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return std::nullopt;
  return absl::string_view(it->second.data(), it->second.size());
}

grpc::Status TokenTable::Check(const grpc::ServerContext* ctx, Role needed) const {
  if (!enabled_) return grpc::Status::OK;
  const std::optional<absl::string_view> authorization = AuthorizationOf(ctx);
  if (!authorization.has_value()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "no credentials: send \"authorization: Bearer TOKEN\" "
                        "(--auth_token_file)");
  }
  absl::string_view value = *authorization;
  if (!absl::ConsumePrefix(&value, "Bearer ")) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "authorization is not a Bearer token");
  }
  int role = -1;
  for (int r = 0; r < 3; ++r) {
    if (!tokens_[r].empty() && SameToken(tokens_[r], value)) role = r;
  }
  if (role < 0) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "unknown token");
  if (role == static_cast<int>(Role::kAdmin) || role == static_cast<int>(needed)) {
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat("a ", RoleName(static_cast<Role>(role)),
                                   " token may not make this call (needs ", RoleName(needed),
                                   ")"));
}

absl::StatusOr<std::string> LoadClientToken(const std::string& path) {
  auto text = ReadFile(path);
  if (!text.ok()) return text.status();
  std::vector<std::vector<std::string>> lines;
  for (auto& w : Lines(*text)) {
    if (!w.empty()) lines.push_back(std::move(w));
  }
  if (lines.size() == 1 && lines[0].size() == 1) {
    if (lines[0][0].size() < kMinTokenLength) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tokens need at least ", kMinTokenLength, " characters"));
    }
    return lines[0][0];
  }
  auto table = TokenTable::Parse(*text, path);  // a server's file: act as its admin
  if (!table.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": expected one token, or a ROLE TOKEN file (", table.status().message(), ")"));
  }
  return table->TokenOf(Role::kAdmin);
}

void AddToken(grpc::ClientContext* ctx, const std::string& token) {
  if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
}

}  // namespace ember
