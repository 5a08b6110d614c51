// Token authentication with roles, for every Ember port.
//
// Servers (coordinator, workers) take --auth_token_file=FILE: one
// "ROLE TOKEN" line per role (worker, trainer, admin; '#' starts a comment),
// the same file everywhere. Every call must carry "authorization: Bearer
// TOKEN"; a missing or unknown token gets UNAUTHENTICATED before any work, a
// token whose role may not make the call PERMISSION_DENIED. Roles:
//   worker   register and heartbeat (and drain itself);
//   trainer  lookups, gradients, reading plans, status and tables;
//   admin    everything (create, drop, import, checkpoint, restore, drain);
//            the coordinator calls workers as admin.
// Without a token file a server accepts every call (the plaintext default on
// 127.0.0.1 that `emberctl up` uses).
//
// Clients (emberctl, the C++ and Python clients) take --auth_token_file=FILE
// holding just their own token (a server's ROLE TOKEN file also works: its
// admin token is used) and send it on every call.
#ifndef EMBER_SERVER_COMMON_AUTH_H_
#define EMBER_SERVER_COMMON_AUTH_H_

#include <array>
#include <optional>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ember {

enum class Role { kWorker = 0, kTrainer = 1, kAdmin = 2 };

const char* RoleName(Role r);

class TokenTable {
 public:
  TokenTable() = default;  // disabled: every call is accepted

  // From a ROLE TOKEN file. INVALID_ARGUMENT naming the line for an unknown
  // role, a role given twice, a token shorter than 16 characters or with
  // whitespace, or the same token for two roles; NOT_FOUND if unreadable.
  static absl::StatusOr<TokenTable> Load(const std::string& path);
  static absl::StatusOr<TokenTable> Parse(absl::string_view text, const std::string& what);

  bool enabled() const { return enabled_; }
  // The token of `role` ("" when disabled or absent): what this server sends
  // when it calls another as that role.
  const std::string& TokenOf(Role role) const { return tokens_[static_cast<int>(role)]; }

  // OK when the call may run as `needed` (admin may do anything).
  grpc::Status Check(const grpc::ServerContext* ctx, Role needed) const;

 private:
  bool enabled_ = false;
  std::array<std::string, 3> tokens_;
};

// A client's token from FILE: its only line, or the admin line of a server's
// ROLE TOKEN file. INVALID_ARGUMENT / NOT_FOUND as TokenTable::Load.
absl::StatusOr<std::string> LoadClientToken(const std::string& path);

// The call's "authorization" metadata, if it carries one (nullopt too for
// a null context: services called directly in tests).
std::optional<absl::string_view> AuthorizationOf(const grpc::ServerContext* ctx);

// Adds "authorization: Bearer TOKEN" to an outgoing call (nothing when empty).
void AddToken(grpc::ClientContext* ctx, const std::string& token);

}  // namespace ember

#endif  // EMBER_SERVER_COMMON_AUTH_H_
