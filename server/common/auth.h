// Token authentication with roles and worker identities, for every Ember
// port (the threat model: docs/security.md).
//
// Servers (coordinator, workers) take --auth_token_file=FILE, lines of
//   admin   TOKEN        everything (create, drop, import, checkpoint,
//                        restore, drain any worker)
//   trainer TOKEN        lookups, gradients, reading plans, status, tables
//   worker  NAME TOKEN   the worker called NAME: it registers, heartbeats and
//                        drains only as itself (one line per worker)
// ('#' starts a comment). Every call must carry "authorization: Bearer
// TOKEN"; a missing or unknown token gets UNAUTHENTICATED before any work, a
// token whose role may not make the call PERMISSION_DENIED.
//
// The coordinator calls a worker with a credential of a fourth role,
// "coordinator", made for that worker alone: CoordinatorTokenFor(NAME), an
// HMAC-SHA256 of NAME keyed by the admin token. Worker NAME accepts it for
// its control RPCs (create, drop, import, checkpoint); no other worker
// accepts it and the coordinator accepts it for nothing, so a process that
// registers under a worker's credential learns nothing it could use against
// the coordinator or another worker. A worker learns its NAME from
// --worker_name, or from the file when it holds one worker line.
//
// Without a token file a server accepts every call (the plaintext default on
// 127.0.0.1 that `emberctl up` uses). Under mutual TLS without tokens, a
// caller's identity is its certificate's common name (IdentityOf).
//
// Clients (emberctl, the C++ and Python clients) take --auth_token_file=FILE
// holding just their own token (a server's file also works: its admin token is
// used) and send it on every call.
#ifndef EMBER_SERVER_COMMON_AUTH_H_
#define EMBER_SERVER_COMMON_AUTH_H_

#include <array>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ember {

enum class Role { kWorker = 0, kTrainer = 1, kAdmin = 2, kCoordinator = 3 };

const char* RoleName(Role r);

// Who made a call, once its credential checked out.
struct Caller {
  Role role = Role::kAdmin;
  // A worker's NAME (token mode), "cert:CN" (mutual TLS without tokens), or
  // "" (no authentication: every caller is anyone).
  std::string identity;
};

// Thread-safe after construction (const).
class TokenTable {
 public:
  TokenTable() = default;  // disabled: every call is accepted

  // From a server's token file. INVALID_ARGUMENT naming the line for an
  // unknown role, a role or worker name given twice, a worker line without a
  // name (the shared worker token of earlier versions), a token shorter than
  // 16 characters, or the same token twice; NOT_FOUND if unreadable.
  static absl::StatusOr<TokenTable> Load(const std::string& path);
  static absl::StatusOr<TokenTable> Parse(absl::string_view text, const std::string& what);

  bool enabled() const { return enabled_; }
  // The token of the trainer or admin role ("" when disabled or absent).
  const std::string& TokenOf(Role role) const;

  // Worker names with a line in the file, in the file's order.
  const std::vector<std::string>& worker_names() const { return worker_order_; }
  // Makes this table a worker's: `name` ("" = the file's only worker line)
  // is whose token it sends and whose coordinator credential it accepts.
  // INVALID_ARGUMENT when the file has no such line (or several and no name).
  absl::Status SetSelf(const std::string& name);
  const std::string& self() const { return self_; }
  // The worker token this process sends as its own ("" when disabled).
  std::string SelfToken() const;

  // The credential the coordinator presents to worker `name` ("" when
  // disabled): hex HMAC-SHA256 keyed by the admin token.
  std::string CoordinatorTokenFor(absl::string_view name) const;
  // The key a primary sends with the updates it forwards to the backups of
  // `collection` at `epoch` ("" when disabled): hex HMAC-SHA256 keyed by
  // the admin token, which every server holds and no trainer does.
  std::string ReplicationKey(absl::string_view collection, int64_t epoch) const;
  // A comparison whose time does not tell where two secrets differ.
  static bool SameSecret(absl::string_view a, absl::string_view b);

  // OK when the call may run as `needed` (admin may do anything); `caller`
  // (optional) gets who it is.
  grpc::Status Check(const grpc::ServerContext* ctx, Role needed, Caller* caller = nullptr) const;

 private:
  bool enabled_ = false;
  std::array<std::string, 3> tokens_;                // by Role; kWorker's unused
  std::map<std::string, std::string> worker_tokens_;  // NAME -> token
  std::vector<std::string> worker_order_;
  std::string self_;                     // a worker's own NAME
  std::string self_coordinator_token_;  // CoordinatorTokenFor(self_)
  std::string Mac(absl::string_view message) const;  // keyed by the admin token
};

// The identity a call's credentials prove: "cert:CN" for a client
// certificate that TLS verified, else "".
std::string CertificateIdentityOf(const grpc::ServerContext* ctx);

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
