// libFuzzer target: the coordinator with token authentication on, as a
// hostile client meets it: each input picks an RPC (the admin ones among
// them: checkpoint, restore, drop, drain), a credential (none, a stranger's,
// a trainer's, an admin's, one of two workers', the credential the
// coordinator gives a worker) and a serialized request. Invariants checked
// besides "no crash, no sanitizer report":
//   - no credential or an unknown one: UNAUTHENTICATED, before any work;
//   - the coordinator's credential for a worker authenticates nothing here;
//   - no role but admin succeeds at an admin RPC;
//   - a worker's credential never heartbeats or drains a worker id that
//     another credential registered (ids are tracked from the answers);
//   - checkpoint and restore paths stay under the root (a restore outside
//     it never succeeds; a checkpoint never lands outside it).
// Calls that would dial workers (CreateCollection, and Restore with a
// checkpoint to load) find none: nothing is created and no fake worker's
// lease is live when they run (registrations are refused to live leases by
// a 1 ns lease).
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>
#include <grpcpp/test/server_context_test_spouse.h>

#include "proto/service.pb.h"
#include "server/common/auth.h"
#include "server/coordinator/coordinator_service.h"

namespace {

using ember::Role;

constexpr char kTokens[] =
    "admin adm1n-fuzz-token-000000\n"
    "trainer tr4iner-fuzz-token-00000\n"
    "worker a w0rker-a-fuzz-token-000\n"
    "worker b w0rker-b-fuzz-token-000\n";

struct World {
  ember::TokenTable tokens;
  std::string root;
  std::unique_ptr<ember::coordinator::CoordinatorService> service;
  std::map<std::string, std::string> bound;  // worker id -> the name that registered it
};

World* Make() {
  auto* w = new World;
  auto t = ember::TokenTable::Parse(kTokens, "fuzz tokens");
  if (!t.ok()) std::abort();
  w->tokens = *t;
  char tmpl[] = "/tmp/ember-fuzz-root-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) std::abort();
  w->root = tmpl;
  ember::coordinator::CoordinatorOptions o;
  o.auth = w->tokens;
  o.checkpoint_dir = w->root;
  o.lease = absl::Nanoseconds(1);  // no fake worker is ever live: nothing is dialled
  auto c = ember::coordinator::CoordinatorService::Create(o);
  if (!c.ok()) std::abort();
  w->service = std::move(*c);
  return w;
}

// The credential byte: which token the call carries, and who that is.
struct Credential {
  std::string token;  // "" = none
  bool known = false;
  Role role = Role::kAdmin;
  std::string name;  // a worker's
};

Credential Pick(const World& w, uint8_t b) {
  Credential c;
  switch (b % 7) {
    case 0:
      break;
    case 1:
      c.token = "not-a-token-0000000000";
      break;
    case 2:
      c = {w.tokens.TokenOf(Role::kTrainer), true, Role::kTrainer, ""};
      break;
    case 3:
      c = {w.tokens.TokenOf(Role::kAdmin), true, Role::kAdmin, ""};
      break;
    case 4:
      c = {"w0rker-a-fuzz-token-000", true, Role::kWorker, "a"};
      break;
    case 5:
      c = {"w0rker-b-fuzz-token-000", true, Role::kWorker, "b"};
      break;
    default:  // what the coordinator presents to worker a: nothing here
      c.token = w.tokens.CoordinatorTokenFor("a");
  }
  return c;
}

void Require(bool ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "invariant broken: %s\n", what);
    std::abort();
  }
}

template <typename Req, typename Resp, typename Method>
grpc::Status Call(World* w, const Credential& c, Method method, const Req& req, Resp* resp) {
  grpc::ServerContext ctx;
  grpc::testing::ServerContextTestSpouse spouse(&ctx);
  if (!c.token.empty()) spouse.AddClientMetadata("authorization", "Bearer " + c.token);
  const grpc::Status s = (w->service.get()->*method)(&ctx, &req, resp);
  if (!c.known) Require(s.error_code() == grpc::StatusCode::UNAUTHENTICATED, "unauthenticated");
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static World* w = Make();
  if (size < 2) return 0;
  const Credential cred = Pick(*w, data[1]);
  const std::string payload(reinterpret_cast<const char*>(data) + 2, size - 2);
  using S = ember::coordinator::CoordinatorService;
  const bool admin = cred.known && cred.role == Role::kAdmin;
  switch (data[0] % 9) {
    case 0: {
      ember::v1::PreviewPlanRequest r;
      ember::v1::PreviewPlanResponse out;
      // Planning time grows with tables x workers; keep each run short.
      if (r.ParseFromString(payload) && r.spec().tables_size() <= 64 &&
          r.topology().world_size() <= 256) {
        (void)Call(w, cred, &S::PreviewPlan, r, &out);
      }
      break;
    }
    case 1: {
      ember::v1::RegisterWorkerRequest r;
      ember::v1::RegisterWorkerResponse out;
      if (!r.ParseFromString(payload)) break;
      const grpc::Status s = Call(w, cred, &S::RegisterWorker, r, &out);
      if (s.ok()) {
        Require(cred.role == Role::kWorker || admin, "register as a non-worker");
        w->bound[out.worker_id()] = cred.role == Role::kWorker ? cred.name : "";
      }
      break;
    }
    case 2:
    case 3: {
      const bool drain = data[0] % 9 == 3;
      std::string id;
      if (!w->bound.empty() && !payload.empty()) {  // mostly a registered id
        auto it = w->bound.begin();
        std::advance(it, static_cast<uint8_t>(payload[0]) % w->bound.size());
        id = it->first;
      }
      grpc::Status s;
      if (drain) {
        ember::v1::DrainWorkerRequest r;
        ember::v1::DrainWorkerResponse out;
        if (!r.ParseFromString(payload.substr(payload.empty() ? 0 : 1))) break;
        if (!id.empty() && (payload.size() < 2 || payload[1] % 2 == 0)) r.set_worker_id(id);
        s = Call(w, cred, &S::DrainWorker, r, &out);
        id = r.worker_id();
      } else {
        ember::v1::HeartbeatRequest r;
        ember::v1::HeartbeatResponse out;
        if (!r.ParseFromString(payload.substr(payload.empty() ? 0 : 1))) break;
        if (!id.empty() && (payload.size() < 2 || payload[1] % 2 == 0)) r.set_worker_id(id);
        s = Call(w, cred, &S::Heartbeat, r, &out);
        id = r.worker_id();
      }
      if (s.ok() && !admin) {
        auto it = w->bound.find(id);
        Require(it != w->bound.end() && it->second == cred.name,
                "a worker credential acted for another worker");
      }
      break;
    }
    case 4: {
      ember::v1::CheckpointRequest r;
      ember::v1::CheckpointResponse out;
      if (!r.ParseFromString(payload)) break;
      const grpc::Status s = Call(w, cred, &S::Checkpoint, r, &out);
      if (s.ok()) {
        Require(admin, "a checkpoint by a non-admin");
        Require(out.checkpoint().path().rfind(w->root + "/", 0) == 0, "a checkpoint outside the root");
      }
      break;
    }
    case 5: {
      ember::v1::RestoreRequest r;
      ember::v1::RestoreResponse out;
      if (!r.ParseFromString(payload)) break;
      const grpc::Status s = Call(w, cred, &S::Restore, r, &out);
      Require(!s.ok(), "a restore from a root holding no checkpoint");
      if (!admin) {
        Require(s.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                    s.error_code() == grpc::StatusCode::PERMISSION_DENIED,
                "a restore by a non-admin went past the credential check");
      }
      break;
    }
    case 6: {
      ember::v1::DropCollectionRequest r;
      ember::v1::DropCollectionResponse out;
      if (!r.ParseFromString(payload)) break;
      const grpc::Status s = Call(w, cred, &S::DropCollection, r, &out);
      if (!admin) Require(!s.ok(), "a drop by a non-admin");
      ember::v1::ScaleCollectionRequest sr;
      ember::v1::ScaleCollectionResponse scaled;
      if (!sr.ParseFromString(payload)) break;
      const grpc::Status ss = Call(w, cred, &S::ScaleCollection, sr, &scaled);
      if (!admin) {
        Require(ss.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                    ss.error_code() == grpc::StatusCode::PERMISSION_DENIED,
                "a rescale by a non-admin went past the credential check");
      }
      break;
    }
    case 7: {
      ember::v1::CreateCollectionRequest r;
      ember::v1::CreateCollectionResponse out;
      if (!r.ParseFromString(payload) || r.spec().tables_size() > 64) break;
      const grpc::Status s = Call(w, cred, &S::CreateCollection, r, &out);
      Require(!s.ok(), "a create with no live worker");
      if (!admin) {
        Require(s.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                    s.error_code() == grpc::StatusCode::PERMISSION_DENIED,
                "a create by a non-admin went past the credential check");
      }
      break;
    }
    default: {
      ember::v1::ListWorkersRequest r;
      ember::v1::ListWorkersResponse out;
      (void)Call(w, cred, &S::ListWorkers, r, &out);
      ember::v1::ListCheckpointsRequest lc;
      ember::v1::ListCheckpointsResponse lco;
      if (lc.ParseFromString(payload)) (void)Call(w, cred, &S::ListCheckpoints, lc, &lco);
      ember::v1::GetCollectionRequest g;
      ember::v1::GetCollectionResponse go;
      if (g.ParseFromString(payload)) (void)Call(w, cred, &S::GetCollection, g, &go);
    }
  }
  return 0;
}
