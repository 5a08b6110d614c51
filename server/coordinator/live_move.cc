// CoordinatorService's live moves (drains, rescaling): shards copied
// while the old placement serves, then a short fence for what changed
// meanwhile. What moves where is PlanMove's (move_plan.h).
//
//   1. Destinations: a worker new to the collection creates its shards at
//      the new epoch (no client of the old plan calls it); one that holds
//      the collection stages them for that epoch (CreateShardsRequest.
//      staged: allocated beside what it serves, out of the data plane).
//   2. Bulk copy: each block's source change mark is taken (under the
//      source's update fence), then every row is copied in chunks while
//      updates go on.
//   3. Catch-up rounds: a new mark, then the rows changed since the last
//      one (ExportRowsRequest.changed_since). A row an update changes
//      while it is copied carries a later generation, so the next round
//      copies it again. Rounds go on while they shrink and are over
//      kQuietRows, at most kMaxRounds.
//   4. Fence: BOUNDED steps are fenced (FenceSteps); every holder moves to
//      the fence epoch (between the plans'; stages are kept), so each
//      client of the old plan is refused and waits for the new one.
//   5. Last catch-up under the fence: the rows changed since the last
//      mark, each new shard's step (the largest of its sources') and
//      exactly-once record (theirs merged); a dynamic table's shard (whose
//      slots move with their bookkeeping) is copied whole here.
//   6. The new placement is persisted with its data in place; then the
//      switch: holders adopt their stages and drop what is no longer
//      theirs (UpdateShardsRequest.require_staged, exact), emptied workers
//      drop the collection.
//
// Training stops only for steps 4 to 6.
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
#include "server/common/wire.h"
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

absl::Status CoordinatorService::CopyShard(const std::string& collection, int64_t epoch,
                                           const std::string& from,
                                           const ember::v1::ShardRef& from_ref,
                                           const std::string& to,
                                           const ember::v1::ShardRef& to_ref, int64_t rows) {
  // Rows [b, e) across, with the step; the first call (no rows) carries the
  // shard's exactly-once record and tells the row width.
  auto copy = [&](int64_t b, int64_t e, bool first, ember::v1::ExportRowsResponse* got) {
    ember::v1::ExportRowsRequest ex;
    ex.set_collection(collection);
    *ex.mutable_shard() = from_ref;
    ex.set_row_begin(b);
    ex.set_row_end(e);
    ex.set_with_applied_ids(first);
    if (absl::Status s = CallWorker(from, &ember::v1::Worker::Stub::ExportRows, ex, got);
        !s.ok()) {
      return s;
    }
    ember::v1::ImportRowsRequest im;
    im.set_collection(collection);
    im.set_epoch(epoch);
    *im.mutable_shard() = to_ref;
    im.set_row_begin(b);
    im.set_row_end(e);
    im.set_weights(std::move(*got->mutable_weights()));
    im.set_state(std::move(*got->mutable_state()));
    im.set_slot_meta(std::move(*got->mutable_slot_meta()));  // a dynamic table's slots
    im.set_pending_counts(std::move(*got->mutable_pending_counts()));  // and admission counts,
    im.set_pending_sketch(std::move(*got->mutable_pending_sketch()));  // exact and sketched
    im.set_step(got->step());
    *im.mutable_applied_ids() = got->applied_ids();
    *im.mutable_applied_unix_ms() = got->applied_unix_ms();
    ember::v1::ImportRowsResponse done;
    return CallWorker(to, &ember::v1::Worker::Stub::ImportRows, im, &done);
  };
  ember::v1::ExportRowsResponse shape;
  if (absl::Status s = copy(0, 0, true, &shape); !s.ok()) return s;
  const int64_t chunk = ChunkRows(shape.cols(), shape.state_width());
  for (int64_t b = 0; b < rows; b += chunk) {
    ember::v1::ExportRowsResponse got;
    if (absl::Status s = copy(b, std::min(rows, b + chunk), false, &got); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CoordinatorService::CopyPass(const std::string& collection, int64_t epoch,
                                                     RowCopy* c, bool mark, bool whole) {
  ember::v1::ExportRowsRequest ex;
  ex.set_collection(collection);
  *ex.mutable_shard() = c->from_ref;
  const ember::v1::ChangeMark since = c->mark;
  if (mark) {  // the mark first: every row read after it is at least this current
    ex.set_mark(true);
    ember::v1::ExportRowsResponse got;
    if (absl::Status s = CallWorker(c->from, &ember::v1::Worker::Stub::ExportRows, ex, &got);
        !s.ok()) {
      return s;
    }
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
    ember::v1::ImportRowsRequest im;
    im.set_collection(collection);
    im.set_epoch(epoch);
    *im.mutable_shard() = c->to_ref;
    im.set_row_begin(c->to_row + b);
    im.set_row_end(c->to_row + e);
    im.set_step(-1);  // the step comes with the last catch-up
    if (c->from == c->to) {  // a block that stays on its worker: copied there
      *im.mutable_copy_from() = c->from_ref;
      im.set_copy_from_row(c->from_row + b);
      if (!whole) *im.mutable_copy_changed_since() = since;
      ember::v1::ImportRowsResponse done;
      if (absl::Status s = CallWorker(c->to, &ember::v1::Worker::Stub::ImportRows, im, &done);
          !s.ok()) {
        return s;
      }
      copied += done.rows_copied();
      continue;
    }
    ex.set_row_begin(c->from_row + b);
    ex.set_row_end(c->from_row + e);
    ember::v1::ExportRowsResponse got;
    if (absl::Status s = CallWorker(c->from, &ember::v1::Worker::Stub::ExportRows, ex, &got);
        !s.ok()) {
      return s;
    }
    if (!whole) {  // the changed rows, from the source's numbering to the target's
      std::vector<int64_t> rows;
      if (absl::Status s = wire::Decode(got.rows(), "rows", &rows); !s.ok()) return s;
      if (rows.empty()) continue;  // nothing changed here
      for (int64_t& r : rows) r += c->to_row - c->from_row;
      wire::Encode(absl::Span<const int64_t>(rows), im.mutable_rows());
      copied += static_cast<int64_t>(rows.size());
    } else {
      copied += e - b;
    }
    im.set_weights(std::move(*got.mutable_weights()));
    im.set_state(std::move(*got.mutable_state()));
    ember::v1::ImportRowsResponse done;
    if (absl::Status s = CallWorker(c->to, &ember::v1::Worker::Stub::ImportRows, im, &done);
        !s.ok()) {
      return s;
    }
  }
  return copied;
}

absl::StatusOr<CoordinatorService::MoveStats> CoordinatorService::MoveLive(const LiveMove& m,
                                                                          bool* fenced) {
  *fenced = false;
  const std::string& name = m.name;
  const int64_t epoch = m.after.plan().epoch();
  const absl::Time start = absl::Now();
  absl::StatusOr<MovePlan> planned = PlanMove(m.before, m.after);
  if (!planned.ok()) return planned.status();
  MovePlan& plan = *planned;
  MoveStats stats;
  stats.bytes_copied = plan.bytes;
  stats.bytes_between_workers = plan.bytes_between_workers;

  // 1. Destinations: created (new to the collection) or staged.
  std::vector<std::string> create_at, stage_at, at;
  std::vector<ember::v1::CreateShardsRequest> creates;
  auto request = [&](const std::string& address,
                     const std::vector<ember::v1::ShardAssignment>& shards, bool staged) {
    ember::v1::CreateShardsRequest c;
    c.set_collection(name);
    c.set_epoch(epoch);
    c.set_staged(staged);
    *c.mutable_training() = m.after.spec().training();
    for (const auto& a : shards) *c.add_shards() = a;
    (staged ? stage_at : create_at).push_back(address);
    creates.push_back(std::move(c));
    stats.shards += static_cast<int>(shards.size());
  };
  for (const auto& [address, shards] : plan.create) request(address, shards, false);
  for (const auto& [address, shards] : plan.stage) {
    if (!shards.empty()) request(address, shards, true);
  }
  at = create_at;
  at.insert(at.end(), stage_at.begin(), stage_at.end());
  // Before the fence a failure lets go of what was created or staged: the
  // old placement has served all along.
  auto undo = [&](const absl::Status& why) {
    (void)DropOnWorkers(name, epoch, create_at);
    (void)DropOnWorkers(name, epoch, stage_at, /*staged=*/true);
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
  CrashPoint("live_move_created");

  // 2. The bulk copy of each fixed block.
  std::vector<RowCopy>& copies = plan.copies;
  int64_t bulk = 0;
  for (size_t i = 0; i < copies.size(); ++i) {
    if (copies[i].dynamic) continue;
    auto n = CopyPass(name, epoch, &copies[i], /*mark=*/true, /*whole=*/true);
    if (!n.ok()) return undo(n.status());
    bulk += *n;
    SetState(name, CollectionInfo::SERVING,
             absl::StrCat(m.what, " live: ", i + 1, " of ", copies.size(), " block(s) copied (",
                          plan.bytes >> 20, " MiB in all)"));
  }
  LOG(INFO) << "collection '" << name << "': " << m.what << ": " << bulk << " rows in "
            << copies.size() << " block(s) copied live in "
            << absl::ToDoubleMilliseconds(absl::Now() - start) << " ms";
  CrashPoint("live_move_copied");
  if (absl::Status s = FailPoint("live_move_copied"); !s.ok()) return undo(s);

  // 3. Catch-up rounds while the old placement serves.
  int64_t last = std::numeric_limits<int64_t>::max();
  for (int round = 1; round <= kMaxRounds; ++round) {
    int64_t rows = 0;
    for (RowCopy& c : copies) {
      if (c.dynamic) continue;
      auto n = CopyPass(name, epoch, &c, /*mark=*/true, /*whole=*/false);
      if (!n.ok()) return undo(n.status());
      rows += *n;
    }
    LOG(INFO) << "collection '" << name << "': catch-up round " << round << ": " << rows
              << " changed row(s) copied";
    SetState(name, CollectionInfo::SERVING,
             absl::StrCat(m.what, " live: catch-up round ", round, ", ", rows, " row(s)"));
    if (rows <= kQuietRows || rows >= last) break;
    last = rows;
  }

  // 4. The fence: BOUNDED steps first (the collection serves on meanwhile:
  // the trainers' steps up to the fence complete the held ones), then
  // every holder to the fence epoch.
  const absl::Time fence_start = absl::Now();
  std::vector<std::string> holders;
  for (int r : planner::HoldingRanks(m.before.plan())) {
    holders.push_back(m.before.worker_addresses(r));
  }
  if (m.before.spec().training().mode() == ember::v1::TrainingSpec::BOUNDED) {
    SetState(name, CollectionInfo::SERVING, absl::StrCat(m.what, ": fencing the steps"));
    FenceSteps(m.before, holders);
  }
  SetState(name, CollectionInfo::RECOVERING, absl::StrCat(m.what, ": last catch-up"));
  ember::v1::UpdateShardsRequest fence;
  fence.set_collection(name);
  fence.set_epoch(m.fence_epoch);
  *fence.mutable_training() = m.before.spec().training();
  *fenced = true;
  const std::vector<grpc::Status> moved =
      CallEach<ember::v1::UpdateShardsRequest, ember::v1::UpdateShardsResponse>(
          holders, std::vector<ember::v1::UpdateShardsRequest>(holders.size(), fence),
          [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
            async->UpdateShards(ctx, request, response, std::move(done));
          });
  for (size_t i = 0; i < holders.size(); ++i) {
    if (!moved[i].ok()) return FromGrpc(moved[i], holders[i]);
  }
  CrashPoint("live_move_fenced");
  if (absl::Status s = FailPoint("live_move_fenced"); !s.ok()) return s;

  // 5. The last catch-up, and each new shard's step (the largest of its
  // sources') and exactly-once record. A shard filled from several sources
  // keeps each one's record for the rows it gave (applied_for_rows): an
  // update one source applied and another did not (in flight at the
  // fence), sent again, then applies to the rows that lack it alone.
  int64_t rows = 0;
  struct Target {  // a new shard: how many blocks fill it, the largest step among them
    int sources = 0;
    int64_t step = 0;
  };
  std::map<std::pair<std::string, std::pair<std::string, int32_t>>, Target> targets;
  auto target_of = [&](const RowCopy& c) -> Target& {
    return targets[{c.to, {c.to_ref.table(), c.to_ref.shard_index()}}];
  };
  for (const RowCopy& c : copies) ++target_of(c).sources;
  std::vector<ember::v1::ExportRowsResponse> records(copies.size());
  for (size_t i = 0; i < copies.size(); ++i) {
    RowCopy& c = copies[i];
    if (c.dynamic) {  // whole, with its step and record
      if (absl::Status s = CopyShard(name, epoch, c.from, c.from_ref, c.to, c.to_ref, c.rows);
          !s.ok()) {
        return s;
      }
      rows += c.rows;
      continue;
    }
    auto n = CopyPass(name, epoch, &c, /*mark=*/false, /*whole=*/false);
    if (!n.ok()) return n.status();
    rows += *n;
    ember::v1::ExportRowsRequest ex;  // the source's step and record: no rows
    ex.set_collection(name);
    *ex.mutable_shard() = c.from_ref;
    ex.set_with_applied_ids(true);
    if (absl::Status s = CallWorker(c.from, &ember::v1::Worker::Stub::ExportRows, ex, &records[i]);
        !s.ok()) {
      return s;
    }
    Target& t = target_of(c);
    t.step = std::max(t.step, records[i].step());
  }
  for (size_t i = 0; i < copies.size(); ++i) {
    const RowCopy& c = copies[i];
    if (c.dynamic) continue;
    const Target& t = target_of(c);
    ember::v1::ImportRowsRequest im;
    im.set_collection(name);
    im.set_epoch(epoch);
    *im.mutable_shard() = c.to_ref;
    im.set_step(t.step);
    *im.mutable_applied_ids() = records[i].applied_ids();
    *im.mutable_applied_unix_ms() = records[i].applied_unix_ms();
    if (t.sources > 1) {
      im.set_applied_for_rows(true);
      im.set_row_begin(c.to_row);
      im.set_row_end(c.to_row + c.rows);
    }
    ember::v1::ImportRowsResponse done;
    if (absl::Status s = CallWorker(c.to, &ember::v1::Worker::Stub::ImportRows, im, &done);
        !s.ok()) {
      return s;
    }
  }

  // 6. Durable with its data in place, then the switch.
  if (absl::Status s = PersistMove(name, m.after, m.after_ids, /*data_in_place=*/true); !s.ok()) {
    return s;
  }
  CrashPoint("move_after_data");
  FinishMove(name, plan, m.after);
  stats.fence_ms = absl::ToDoubleMilliseconds(absl::Now() - fence_start);
  stats.total_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  LOG(INFO) << "collection '" << name << "': " << m.what << ": fenced for " << stats.fence_ms
            << " ms (" << rows << " row(s) in the last catch-up); " << stats.shards
            << " shard(s), " << stats.bytes_copied << " bytes copied ("
            << stats.bytes_between_workers << " between workers) in " << stats.total_ms << " ms";
  return stats;
}

absl::StatusOr<CoordinatorService::MoveStats> CoordinatorService::MoveTo(
    const std::string& name, const std::string& what, const CollectionInfo& before,
    CollectionInfo* after, const std::vector<std::string>& after_ids, MoveKind kind) {
  auto fence = NextEpoch();
  if (!fence.ok()) return fence.status();
  auto next = NextEpoch();
  if (!next.ok()) return next.status();
  after->mutable_plan()->set_epoch(*next);
  // Durable before any worker hears of it (as a recovery's).
  if (absl::Status s = PersistMove(name, *after, after_ids, /*data_in_place=*/false); !s.ok()) {
    return s;
  }
  LOG(INFO) << "collection '" << name << "': " << what;
  SetState(name, CollectionInfo::SERVING, what);
  LiveMove move;
  move.name = name;
  move.what = what;
  move.fence_epoch = *fence;
  move.before = before;
  move.after = *after;
  move.after_ids = after_ids;
  return Move(move, kind);
}

absl::StatusOr<CoordinatorService::MoveStats> CoordinatorService::Move(const LiveMove& m,
                                                                       MoveKind kind) {
  bool fenced = false;
  absl::StatusOr<MoveStats> moved = MoveLive(m, &fenced);
  CountMove(kind, moved.ok() ? &*moved : nullptr);
  if (moved.ok()) return moved;
  const std::string why = absl::StrCat(m.what, " failed (", moved.status().message(), ")");
  AbandonMove(m, fenced, why);
  return absl::Status(moved.status().code(), why);
}

void CoordinatorService::CountMove(MoveKind kind, const MoveStats* stats) {
  absl::MutexLock lock(&mu_);
  Stats& s = checkpoint_stats_;
  int64_t* ok = kind == MoveKind::kScale    ? &s.scales_ok
                : kind == MoveKind::kCopies ? &s.copies_ok
                                            : &s.drains_ok;
  int64_t* failed = kind == MoveKind::kScale    ? &s.scales_failed
                    : kind == MoveKind::kCopies ? &s.copies_failed
                                                : &s.drains_failed;
  if (stats == nullptr) {
    ++*failed;
    return;
  }
  ++*ok;
  s.move_bytes_between_workers += stats->bytes_between_workers;
  s.move_bytes_local += stats->bytes_copied - stats->bytes_between_workers;
  s.last_move_fence_seconds = stats->fence_ms / 1000;
}

void CoordinatorService::AbandonMove(const LiveMove& m, bool fenced, const std::string& why) {
  LOG(WARNING) << "collection '" << m.name << "': " << why;
  if (fenced) {  // the holders moved on: back to the old placement at a newer epoch
    if (auto plan = PlanMove(m.before, m.after); plan.ok()) {
      std::vector<std::string> created;
      for (const auto& [address, shards] : plan->create) created.push_back(address);
      (void)DropOnWorkers(m.name, m.after.plan().epoch(), created);
    }
    (void)ReadoptLocked(m.name, why + "; back on the old placement");
    return;
  }
  CollectionInfo old = m.before;
  old.set_state(CollectionInfo::SERVING);
  old.set_note(why + "; the old placement serves on");
  std::vector<std::string> ids;
  {
    absl::MutexLock lock(&mu_);
    ids = rank_ids_[m.name];
  }
  (void)Register(old, ids);
}

void CoordinatorService::FinishMove(const std::string& name, const MovePlan& plan,
                                    const CollectionInfo& after) {
  const int64_t epoch = after.plan().epoch();
  std::vector<std::string> switch_at;
  std::vector<ember::v1::UpdateShardsRequest> switches;
  for (const auto& [address, shards] : plan.after) {
    ember::v1::UpdateShardsRequest u;
    u.set_collection(name);
    u.set_epoch(epoch);
    u.set_require_staged(true);
    u.set_exact(true);
    *u.mutable_training() = after.spec().training();
    for (const auto& a : shards) *u.add_create() = a;
    switch_at.push_back(address);
    switches.push_back(std::move(u));
  }
  // The data is in place and durable: the new placement stands. A switch
  // is idempotent and tried up to three times; a worker that still missed
  // it has the ranks it holds recovered by the monitor (force_lost_).
  for (int attempt = 0; attempt < 3 && !switch_at.empty(); ++attempt) {
    if (attempt > 0) absl::SleepFor(absl::Milliseconds(200) * attempt);
    const std::vector<grpc::Status> switched =
        CallEach<ember::v1::UpdateShardsRequest, ember::v1::UpdateShardsResponse>(
            switch_at, switches, [](auto* async, auto* ctx, auto* request, auto* response,
                                    auto done) {
              async->UpdateShards(ctx, request, response, std::move(done));
            });
    std::vector<std::string> again_at;
    std::vector<ember::v1::UpdateShardsRequest> again;
    for (size_t i = 0; i < switch_at.size(); ++i) {
      if (switched[i].ok()) continue;
      LOG(ERROR) << "collection '" << name << "': the switch failed on " << switch_at[i] << ": "
                 << switched[i].error_message();
      again_at.push_back(switch_at[i]);
      again.push_back(switches[i]);
    }
    switch_at.swap(again_at);
    switches.swap(again);
  }
  if (!switch_at.empty()) {
    absl::MutexLock lock(&mu_);
    for (int r : planner::HoldingRanks(after.plan())) {
      if (std::find(switch_at.begin(), switch_at.end(), after.worker_addresses(r)) !=
          switch_at.end()) {
        force_lost_[name].insert(r);
      }
    }
  }
  const std::vector<std::string> emptied(plan.emptied.begin(), plan.emptied.end());
  if (absl::Status s = DropOnWorkers(name, epoch, emptied); !s.ok()) {
    LOG(WARNING) << "collection '" << name << "': moved, but an emptied worker's copy stays: " << s;
  }
}

}  // namespace coordinator
}  // namespace ember
