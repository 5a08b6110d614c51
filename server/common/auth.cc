#include "server/common/auth.h"

#include <fstream>
#include <sstream>
#include <vector>

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "absl/strings/escaping.h"
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
    case Role::kCoordinator:
      return "coordinator";
    default:
      return "admin";
  }
}

absl::StatusOr<TokenTable> TokenTable::Parse(absl::string_view text, const std::string& what) {
  TokenTable t;
  t.enabled_ = true;
  std::vector<std::string> seen;  // every token, to refuse one given twice
  const auto lines = Lines(text);
  for (size_t n = 0; n < lines.size(); ++n) {
    const auto& w = lines[n];
    if (w.empty()) continue;
    const std::string where = absl::StrCat(what, " line ", n + 1);
    const bool worker = w[0] == RoleName(Role::kWorker);
    if (worker && w.size() == 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": a worker line names its worker: \"worker NAME TOKEN\", one per worker (a "
                 "shared worker token let any worker act as any other; docs/security.md)"));
    }
    if (w.size() != (worker ? 3u : 2u)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, worker ? ": expected \"worker NAME TOKEN\"" : ": expected \"ROLE TOKEN\""));
    }
    int role = -1;
    for (Role r : {Role::kTrainer, Role::kAdmin}) {
      if (w[0] == RoleName(r)) role = static_cast<int>(r);
    }
    if (role < 0 && !worker) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": unknown role (worker, trainer or admin)"));
    }
    const std::string& token = w.back();
    if (token.size() < kMinTokenLength) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": tokens need at least ", kMinTokenLength, " characters"));
    }
    for (const std::string& other : seen) {
      if (SameToken(other, token)) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": the same token twice"));
      }
    }
    if (worker) {
      if (t.worker_tokens_.count(w[1])) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": worker ", w[1], " given twice"));
      }
      t.worker_tokens_[w[1]] = token;
      t.worker_order_.push_back(w[1]);
    } else {
      if (!t.tokens_[role].empty()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": role ", w[0], " given twice"));
      }
      t.tokens_[role] = token;
    }
    seen.push_back(token);
  }
  if (t.tokens_[static_cast<int>(Role::kAdmin)].empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": no admin token"));
  }
  return t;
}

const std::string& TokenTable::TokenOf(Role role) const {
  static const std::string* const kNone = new std::string();
  if (role != Role::kTrainer && role != Role::kAdmin) return *kNone;
  return tokens_[static_cast<int>(role)];
}

absl::Status TokenTable::SetSelf(const std::string& name) {
  if (!enabled_) {
    self_ = name;
    return absl::OkStatus();
  }
  if (name.empty()) {
    if (worker_order_.size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the token file has ", worker_order_.size(),
          " worker lines: name this worker's with --worker_name"));
    }
    self_ = worker_order_[0];
    self_coordinator_token_ = CoordinatorTokenFor(self_);
    return absl::OkStatus();
  }
  if (!worker_tokens_.count(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the token file has no line \"worker ", name, " TOKEN\""));
  }
  self_ = name;
  self_coordinator_token_ = CoordinatorTokenFor(self_);
  return absl::OkStatus();
}

std::string TokenTable::SelfToken() const {
  auto it = worker_tokens_.find(self_);
  return it == worker_tokens_.end() ? std::string() : it->second;
}

std::string TokenTable::CoordinatorTokenFor(absl::string_view name) const {
  return Mac(absl::StrCat("ember coordinator credential for worker ", name));
}

std::string TokenTable::ReplicationKey(absl::string_view collection, int64_t epoch) const {
  return Mac(absl::StrCat("ember replication of collection ", collection, " at epoch ", epoch));
}

bool TokenTable::SameSecret(absl::string_view a, absl::string_view b) { return SameToken(a, b); }

std::string TokenTable::Mac(absl::string_view message) const {
  if (!enabled_) return "";
  const std::string& key = tokens_[static_cast<int>(Role::kAdmin)];
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int mac_len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &mac_len);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(mac), mac_len));
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

std::string CertificateIdentityOf(const grpc::ServerContext* ctx) {
  if (ctx == nullptr) return "";
  const std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  const std::vector<grpc::string_ref> cn = auth->FindPropertyValues("x509_common_name");
  if (cn.empty()) return "";
  return absl::StrCat("cert:", absl::string_view(cn[0].data(), cn[0].size()));
}

grpc::Status TokenTable::Check(const grpc::ServerContext* ctx, Role needed, Caller* caller) const {
  Caller who;
  if (!enabled_) {
    who.identity = CertificateIdentityOf(ctx);
    if (caller != nullptr) *caller = who;
    return grpc::Status::OK;
  }
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
  bool known = false;
  for (Role r : {Role::kTrainer, Role::kAdmin}) {
    if (!tokens_[static_cast<int>(r)].empty() && SameToken(tokens_[static_cast<int>(r)], value)) {
      who.role = r;
      known = true;
    }
  }
  // Every worker's line is compared, so the time taken does not tell which.
  for (const auto& [name, token] : worker_tokens_) {
    if (SameToken(token, value)) {
      who.role = Role::kWorker;
      who.identity = name;
      known = true;
    }
  }
  // A worker accepts the coordinator's credential made for it alone.
  if (!self_coordinator_token_.empty() && SameToken(self_coordinator_token_, value)) {
    who.role = Role::kCoordinator;
    known = true;
  }
  if (!known) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "unknown token");
  if (who.role != Role::kAdmin && who.role != needed) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat("a ", RoleName(who.role),
                                     " token may not make this call (needs ", RoleName(needed),
                                     ")"));
  }
  if (caller != nullptr) *caller = who;
  return grpc::Status::OK;
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
