// CoordinatorService's live moves (a drain): shards copied while the old
// placement serves, then a short fence for what changed meanwhile.
//
//   1. Destinations: a worker new to the collection creates its shards at
//      the new epoch (no client of the old plan calls it); one that holds
//      the collection stages them for that epoch (CreateShardsRequest.
//      staged: allocated beside what it serves, out of the data plane).
//   2. Bulk copy: each fixed shard's change mark is taken (under the
//      source's update fence), then every row is copied in chunks while
//      updates go on.
//   3. Catch-up rounds: a new mark, then the rows changed since the last
//      one (ExportRowsRequest.changed_since). A row an update changes
//      while it is copied carries a later generation, so the next round
//      copies it again. Rounds go on while they shrink and are over
//      kQuietRows, at most kMaxRounds.
//   4. Fence: BOUNDED steps are fenced (FenceSteps); every holder moves to
//      the new epoch (staged shards adopted: UpdateShardsRequest.
//      require_staged), so each client of the old plan is refused and
//      waits for the new one.
//   5. Last catch-up under the fence: the rows changed since the last
//      mark, each shard's step and exactly-once record; a dynamic table's
//      shard (whose slots move with their bookkeeping) is copied whole
//      here, as a stopped drain did.
//
// The caller persists the new placement with its data in place, drops the
// drained copies and publishes the new plan. Training stops only for the
// fence and the last catch-up.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "planner/plan_view.h"
#include "server/common/grpc_util.h"
#include "server/coordinator/assignments.h"
#include "server/coordinator/call_each.h"
#include "server/coordinator/coordinator_service.h"
#include "server/coordinator/crash_point.h"
#include "server/coordinator/replacement_policy.h"

namespace ember {
namespace coordinator {

using ember::v1::CollectionInfo;

namespace {

// Catch-up rounds stop once one copies at most this many rows in all (the
// fence then copies about as many again), or after kMaxRounds.
constexpr int64_t kQuietRows = 4096;
constexpr int kMaxRounds = 4;

// Rows of a shard per copy call: about 4 MiB of weights and state.
int64_t ChunkRows(int64_t cols, int64_t state_width) {
  return std::max<int64_t>(1, (int64_t{4} << 20) / (4 * std::max<int64_t>(1, cols + state_width)));
}

}  // namespace

absl::StatusOr<int64_t> CoordinatorService::CopyPass(const std::string& collection, int64_t epoch,
                                                     ShardCopy* c, bool mark, bool whole) {
  ember::v1::Worker::Stub* src = StubFor(c->from);
  ember::v1::Worker::Stub* dst = StubFor(c->to);
  auto exported = [&](const ember::v1::ExportRowsRequest& ex,
                      ember::v1::ExportRowsResponse* got) -> absl::Status {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, options_.worker_rpc_timeout);
    AddToken(&ctx, CredentialFor(c->from));
    if (grpc::Status s = src->ExportRows(&ctx, ex, got); !s.ok()) return FromGrpc(s, c->from);
    return absl::OkStatus();
  };
  ember::v1::ExportRowsRequest ex;
  ex.set_collection(collection);
  *ex.mutable_shard() = c->from_ref;
  const ember::v1::ChangeMark since = c->mark;
  if (mark) {  // the mark first: every row read after it is at least this current
    ex.set_mark(true);
    ember::v1::ExportRowsResponse got;
    if (absl::Status s = exported(ex, &got); !s.ok()) return s;
    c->mark = got.mark();
    c->cols = got.cols();
    c->state_width = got.state_width();
    ex.set_mark(false);
  }
  if (!whole) *ex.mutable_changed_since() = since;
  const int64_t chunk = ChunkRows(c->cols, c->state_width);
  int64_t copied = 0;
  for (int64_t b = 0; b < c->rows; b += chunk) {
    const int64_t e = std::min(c->rows, b + chunk);
    ex.set_row_begin(b);
    ex.set_row_end(e);
    ember::v1::ExportRowsResponse got;
    if (absl::Status s = exported(ex, &got); !s.ok()) return s;
    if (!whole && got.rows().empty()) continue;  // nothing changed here
    ember::v1::ImportRowsRequest im;
    im.set_collection(collection);
    im.set_epoch(epoch);
    *im.mutable_shard() = c->to_ref;
    im.set_row_begin(b);
    im.set_row_end(e);
    im.set_weights(std::move(*got.mutable_weights()));
    im.set_state(std::move(*got.mutable_state()));
    im.set_rows(std::move(*got.mutable_rows()));
    im.set_step(-1);  // the step comes with the last catch-up
    ember::v1::ImportRowsResponse done;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, options_.worker_rpc_timeout);
    AddToken(&ctx, CredentialFor(c->to));
    if (grpc::Status s = dst->ImportRows(&ctx, im, &done); !s.ok()) return FromGrpc(s, c->to);
    copied += whole ? e - b : static_cast<int64_t>(im.rows().size() / sizeof(int64_t));
  }
  return copied;
}

absl::Status CoordinatorService::MoveLive(const LiveMove& m, bool* fenced) {
  *fenced = false;
  const std::string& name = m.name;
  const absl::Time start = absl::Now();
  const std::string moving = absl::StrCat("moving the shards of ", DescribeRanks(m.before, m.from));

  // 1. Destinations: created (new to the collection) or staged.
  std::vector<std::string> create_at, stage_at, at;
  std::vector<ember::v1::CreateShardsRequest> creates;
  for (int r : m.replaced) {
    ember::v1::CreateShardsRequest c;
    c.set_collection(name);
    c.set_epoch(m.epoch);
    *c.mutable_training() = m.after.spec().training();
    for (const auto& a : AssignmentsOf(m.after, r)) *c.add_shards() = a;
    create_at.push_back(m.after.worker_addresses(r));
    creates.push_back(std::move(c));
  }
  for (int r : m.kept) {
    auto it = m.moved.find(r);
    if (it == m.moved.end() || it->second.empty()) continue;
    ember::v1::CreateShardsRequest c;
    c.set_collection(name);
    c.set_epoch(m.epoch);
    c.set_staged(true);
    *c.mutable_training() = m.after.spec().training();
    for (const auto& a : AssignmentsOf(m.after, r)) {
      if (it->second.count({a.ref().table(), a.ref().shard_index()})) *c.add_shards() = a;
    }
    stage_at.push_back(m.after.worker_addresses(r));
    creates.push_back(std::move(c));
  }
  at = create_at;
  at.insert(at.end(), stage_at.begin(), stage_at.end());
  // Before the fence a failure lets go of what was created or staged: the
  // old placement has served all along.
  auto undo = [&](const absl::Status& why) {
    (void)DropOnWorkers(name, m.epoch, create_at);
    (void)DropOnWorkers(name, m.epoch, stage_at, /*staged=*/true);
    return why;
  };
  const std::vector<grpc::Status> made =
      CallEach<ember::v1::CreateShardsRequest, ember::v1::CreateShardsResponse>(
          at, creates, [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
            async->CreateShards(ctx, request, response, std::move(done));
          });
  for (size_t i = 0; i < at.size(); ++i) {
    if (!made[i].ok()) return undo(FromGrpc(made[i], at[i]));
  }

  // 2. The copies, and the bulk copy of each fixed shard.
  std::vector<ShardCopy> copies;
  for (const auto& [to, refs] : m.moved) {
    for (const auto& [table, index] : refs) {
      auto dp = m.dp_source.find({table, index});
      ShardCopy c;
      c.from_ref.set_table(table);
      c.from_ref.set_shard_index(dp != m.dp_source.end() ? dp->second : index);
      c.to_ref.set_table(table);
      c.to_ref.set_shard_index(index);
      const std::optional<ember::v1::ShardAssignment> a = AssignmentOf(m.before, c.from_ref);
      if (!a) {
        return undo(absl::InternalError(
            absl::StrCat("no shard to copy for table '", table, "' shard ", index)));
      }
      c.from = m.before.worker_addresses(RankOf(m.before, c.from_ref));
      c.to = m.after.worker_addresses(to);
      c.rows = a->rows();
      c.dynamic = a->table().has_dynamic();
      copies.push_back(std::move(c));
    }
  }
  int64_t bulk = 0;
  for (size_t i = 0; i < copies.size(); ++i) {
    if (copies[i].dynamic) continue;
    auto n = CopyPass(name, m.epoch, &copies[i], /*mark=*/true, /*whole=*/true);
    if (!n.ok()) return undo(n.status());
    bulk += *n;
    SetState(name, CollectionInfo::SERVING,
             absl::StrCat(moving, " live: ", i + 1, " of ", copies.size(), " shard(s) copied"));
  }
  LOG(INFO) << "collection '" << name << "': " << moving << ": " << bulk << " rows of "
            << copies.size() << " shard(s) copied live in "
            << absl::ToDoubleMilliseconds(absl::Now() - start) << " ms";
  CrashPoint("live_move_copied");

  // 3. Catch-up rounds while the old placement serves.
  int64_t last = std::numeric_limits<int64_t>::max();
  for (int round = 1; round <= kMaxRounds; ++round) {
    int64_t rows = 0;
    for (ShardCopy& c : copies) {
      if (c.dynamic) continue;
      auto n = CopyPass(name, m.epoch, &c, /*mark=*/true, /*whole=*/false);
      if (!n.ok()) return undo(n.status());
      rows += *n;
    }
    LOG(INFO) << "collection '" << name << "': catch-up round " << round << ": " << rows
              << " changed row(s) copied";
    SetState(name, CollectionInfo::SERVING,
             absl::StrCat(moving, " live: catch-up round ", round, ", ", rows, " row(s)"));
    if (rows <= kQuietRows || rows >= last) break;
    last = rows;
  }

  // 4. The fence: BOUNDED steps first, then every holder to the new epoch.
  SetState(name, CollectionInfo::RECOVERING, absl::StrCat(moving, ": last catch-up"));
  const absl::Time fence_start = absl::Now();
  std::vector<std::string> holders, move_at;
  std::vector<ember::v1::UpdateShardsRequest> updates;
  for (int r : planner::HoldingRanks(m.before.plan())) {
    holders.push_back(m.before.worker_addresses(r));
  }
  if (m.before.spec().training().mode() == ember::v1::TrainingSpec::BOUNDED) {
    FenceSteps(m.before, holders);
  }
  for (int r : m.from) {
    ember::v1::UpdateShardsRequest u;  // keeps its shards (the copies' source) at the new epoch
    u.set_collection(name);
    u.set_epoch(m.epoch);
    *u.mutable_training() = m.before.spec().training();
    move_at.push_back(m.before.worker_addresses(r));
    updates.push_back(std::move(u));
  }
  for (int r : m.kept) {
    ember::v1::UpdateShardsRequest u;
    u.set_collection(name);
    u.set_epoch(m.epoch);
    u.set_require_staged(true);
    *u.mutable_training() = m.after.spec().training();
    for (const auto& a : AssignmentsOf(m.after, r)) *u.add_create() = a;
    move_at.push_back(m.after.worker_addresses(r));
    updates.push_back(std::move(u));
  }
  *fenced = true;
  const std::vector<grpc::Status> moved =
      CallEach<ember::v1::UpdateShardsRequest, ember::v1::UpdateShardsResponse>(
          move_at, updates, [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
            async->UpdateShards(ctx, request, response, std::move(done));
          });
  for (size_t i = 0; i < move_at.size(); ++i) {
    if (!moved[i].ok()) return FromGrpc(moved[i], move_at[i]);
  }
  CrashPoint("live_move_fenced");

  // 5. The last catch-up, each shard's step and exactly-once record.
  int64_t rows = 0;
  for (ShardCopy& c : copies) {
    if (c.dynamic) {
      if (absl::Status s = CopyShard(name, m.epoch, c.from, c.from_ref, c.to, c.to_ref, c.rows);
          !s.ok()) {
        return s;
      }
      rows += c.rows;
      continue;
    }
    auto n = CopyPass(name, m.epoch, &c, /*mark=*/false, /*whole=*/false);
    if (!n.ok()) return n.status();
    rows += *n;
    // The step and the record: a call with no rows.
    ember::v1::ExportRowsRequest ex;
    ex.set_collection(name);
    *ex.mutable_shard() = c.from_ref;
    ex.set_with_applied_ids(true);
    ember::v1::ExportRowsResponse got;
    {
      grpc::ClientContext ctx;
      SetDeadline(&ctx, options_.worker_rpc_timeout);
      AddToken(&ctx, CredentialFor(c.from));
      if (grpc::Status s = StubFor(c.from)->ExportRows(&ctx, ex, &got); !s.ok()) {
        return FromGrpc(s, c.from);
      }
    }
    ember::v1::ImportRowsRequest im;
    im.set_collection(name);
    im.set_epoch(m.epoch);
    *im.mutable_shard() = c.to_ref;
    im.set_step(got.step());
    *im.mutable_applied_ids() = got.applied_ids();
    *im.mutable_applied_unix_ms() = got.applied_unix_ms();
    ember::v1::ImportRowsResponse done;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, options_.worker_rpc_timeout);
    AddToken(&ctx, CredentialFor(c.to));
    if (grpc::Status s = StubFor(c.to)->ImportRows(&ctx, im, &done); !s.ok()) {
      return FromGrpc(s, c.to);
    }
  }
  LOG(INFO) << "collection '" << name << "': " << moving << ": fenced for "
            << absl::ToDoubleMilliseconds(absl::Now() - fence_start) << " ms (" << rows
            << " row(s) in the last catch-up); the whole move took "
            << absl::ToDoubleMilliseconds(absl::Now() - start) << " ms";
  return absl::OkStatus();
}

}  // namespace coordinator
}  // namespace ember
