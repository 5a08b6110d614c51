// WorkerService's rows in and out: ExportRows and ImportRows (drain, the
// coordinator's copies, tools), WriteCheckpoint and LoadCheckpoint (shard
// files, re-cut on restore). The data plane is worker_service.cc; shard
// bookkeeping is worker_shards.cc.
#include <algorithm>
#include <map>
#include <optional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "server/checkpoint/checkpoint_files.h"
#include "server/checkpoint/recut.h"
#include "server/checkpoint/rehash.h"
#include "server/common/grpc_util.h"
#include "server/common/wire.h"
#include "server/worker/shard_names.h"
#include "server/worker/worker_service.h"

namespace ember {
namespace worker {

grpc::Status WorkerService::ExportRows(grpc::ServerContext* ctx, const ember::v1::ExportRowsRequest* req,
                                       ember::v1::ExportRowsResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  absl::ReaderMutexLock lock(&mu_);
  auto c = HeldCollection(req->collection());
  if (!c.ok()) return ToGrpc(c.status());
  auto shard = FindShard(**c, req->shard());
  if (!shard.ok()) return ToGrpc(shard.status());
  const auto& a = (*shard)->assignment;
  const int64_t b = req->row_begin(), e = req->row_end();
  if (b < 0 || e > a.rows() || b > e) {
    return ToGrpc(absl::InvalidArgumentError(
        absl::StrCat("row range [", b, ", ", e, ") is outside [0, ", a.rows(), ")")));
  }
  // A live move's copy: the shard's change mark first, then the rows (or
  // only those changed since an earlier mark: a catch-up).
  const bool changed = req->has_changed_since();
  if (req->mark() || changed) {
    if (a.table().has_dynamic()) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
          RefString(a.ref()),
          " is a dynamic table's: its slots move whole (no mark or changed_since)")));
    }
    if (req->with_applied_ids()) {
      return ToGrpc(absl::InvalidArgumentError(
          "with_applied_ids is not taken with mark or changed_since (ask for it on its own)"));
    }
  }
  if (req->mark()) {
    // Under the update fence: every update before the mark is in the rows
    // read after it; every later one carries a later generation.
    absl::MutexLock apply((*c)->apply_mu.get());
    auto mark = backend_->MarkChanges((*shard)->id);
    if (!mark.ok()) return ToGrpc(mark.status());
    resp->mutable_mark()->set_lineage(mark->lineage);
    resp->mutable_mark()->set_generation(mark->generation);
  }
  std::vector<int64_t> rows;
  if (changed) {
    auto since = backend_->ChangedRowsIn(
        (*shard)->id, {req->changed_since().lineage(), req->changed_since().generation()}, b, e);
    if (!since.ok()) return ToGrpc(since.status());
    rows = *std::move(since);
  }
  auto spec = backend_->GetShardSpec((*shard)->id);
  if (!spec.ok()) return ToGrpc(spec.status());
  const int64_t width = backend::OptimizerStateWidth(spec->optimizer.type, spec->dim);
  const int64_t n = changed ? static_cast<int64_t>(rows.size()) : e - b;
  const int64_t bytes = n * (spec->dim + width) * 4;
  if (bytes > options_.max_response_bytes) {
    return ToGrpc(absl::ResourceExhaustedError(absl::StrCat(
        "exporting ", n, " rows takes ", bytes, " bytes, over the limit of ",
        options_.max_response_bytes, "; export fewer rows per call")));
  }
  auto weights = wire::Resize<float>(resp->mutable_weights(), n * spec->dim);
  auto state = wire::Resize<float>(resp->mutable_state(), n * width);
  const absl::Status exported =
      changed ? backend_->ExportRowsAt((*shard)->id, rows, weights, state)
              : backend_->ExportRows((*shard)->id, b, e, weights, state);
  if (!exported.ok()) return ToGrpc(exported);
  if (changed) wire::Encode(absl::Span<const int64_t>(rows), resp->mutable_rows());
  auto step = backend_->ExportStep((*shard)->id);
  if (!step.ok()) return ToGrpc(step.status());
  if (spec->is_dynamic) {
    std::vector<backend::EmbeddingBackend::SlotMeta> slots(e - b);
    if (absl::Status s = backend_->ExportSlots((*shard)->id, b, e, absl::MakeSpan(slots));
        !s.ok()) {
      return ToGrpc(s);
    }
    wire::Encode(absl::Span<const int64_t>(backend::EmbeddingBackend::PackSlots(slots)),
                 resp->mutable_slot_meta());
  }
  resp->set_cols(spec->dim);
  resp->set_state_width(width);
  resp->set_step(*step);
  if (req->with_applied_ids()) {
    absl::MutexLock apply((*c)->apply_mu.get());
    for (const auto& [id, when] : (*shard)->applied->Entries()) {
      resp->add_applied_ids(id);
      resp->add_applied_unix_ms(absl::ToUnixMillis(when));
    }
    if (spec->is_dynamic) {  // and the ids' admission counts, exact and sketched
      auto pending = backend_->ExportPendingCounts((*shard)->id);
      if (!pending.ok()) return ToGrpc(pending.status());
      wire::Encode(absl::Span<const int64_t>(*pending), resp->mutable_pending_counts());
      auto sketch = backend_->ExportPendingSketch((*shard)->id);
      if (!sketch.ok()) return ToGrpc(sketch.status());
      wire::Encode(absl::Span<const uint32_t>(*sketch), resp->mutable_pending_sketch());
    }
  }
  return grpc::Status::OK;
}

absl::StatusOr<const WorkerService::ShardEntry*> WorkerService::ImportTarget(
    const std::string& collection, int64_t epoch, const ember::v1::ShardRef& ref, Collection** c,
    bool* staged) const {
  auto held = HeldCollection(collection);
  if (!held.ok()) return held.status();
  *c = *held;
  *staged = (*held)->staged_epoch != 0 && (*held)->staged_epoch == epoch;
  if (!*staged) {
    auto current = FindCollection(collection, epoch);
    if (!current.ok()) return current.status();
    return FindShard(**c, ref);
  }
  auto it = (*held)->staged.find({ref.table(), ref.shard_index()});
  if (it == (*held)->staged.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no ", RefString(ref), " staged for epoch ", epoch, " on this worker"));
  }
  return &it->second;
}

absl::StatusOr<int64_t> WorkerService::CopyWithin(const Collection& c, const ShardEntry& to,
                                                   const ember::v1::ImportRowsRequest& req) {
  auto from = FindShard(c, req.copy_from());
  if (!from.ok()) return from.status();
  const ember::v1::ShardAssignment& fa = (*from)->assignment;
  const ember::v1::ShardAssignment& ta = to.assignment;
  const int64_t b = req.row_begin(), e = req.row_end(), src = req.copy_from_row();
  if (fa.table().has_dynamic() || ta.table().has_dynamic() ||
      fa.ref().table() != ta.ref().table() || fa.col_offset() != ta.col_offset() ||
      fa.cols() != ta.cols()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "copy_from ", RefString(fa.ref()), " into ", RefString(ta.ref()),
        ": the same fixed table's columns only"));
  }
  if (b < 0 || b > e || e > ta.rows() || src < 0 || src + (e - b) > fa.rows()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "copy_from: rows [", src, ", ", src + (e - b), ") of ", fa.rows(), " into [", b, ", ", e,
        ") of ", ta.rows()));
  }
  std::vector<int64_t> rows;
  if (req.has_copy_changed_since()) {
    auto changed = backend_->ChangedRowsIn(
        (*from)->id, {req.copy_changed_since().lineage(), req.copy_changed_since().generation()},
        src, src + (e - b));
    if (!changed.ok()) return changed.status();
    rows = *std::move(changed);
  } else {
    rows.resize(e - b);
    for (int64_t k = 0; k < e - b; ++k) rows[k] = src + k;
  }
  if (rows.empty()) return 0;
  auto spec = backend_->GetShardSpec(to.id);
  if (!spec.ok()) return spec.status();
  const int64_t width = backend::OptimizerStateWidth(spec->optimizer.type, spec->dim);
  const int64_t n = static_cast<int64_t>(rows.size());
  std::vector<float> weights(n * spec->dim), state(n * width);
  if (!req.has_copy_changed_since()) {  // the whole block: one range each way
    if (absl::Status s = backend_->ExportRows((*from)->id, src, src + n, absl::MakeSpan(weights),
                                              absl::MakeSpan(state));
        !s.ok()) {
      return s;
    }
    if (absl::Status s = backend_->ImportRows(to.id, b, e, weights, state); !s.ok()) return s;
    return n;
  }
  if (absl::Status s = backend_->ExportRowsAt((*from)->id, rows, absl::MakeSpan(weights),
                                              absl::MakeSpan(state));
      !s.ok()) {
    return s;
  }
  for (int64_t& r : rows) r += b - src;
  if (absl::Status s = backend_->ImportRowsAt(to.id, rows, weights, state); !s.ok()) return s;
  return n;
}

grpc::Status WorkerService::ImportRows(grpc::ServerContext* ctx, const ember::v1::ImportRowsRequest* req,
                                       ember::v1::ImportRowsResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kCoordinator); !a.ok()) return a;
  if (req->epoch() <= 0) {
    return ToGrpc(absl::InvalidArgumentError(absl::StrCat("epoch must be > 0, got ", req->epoch())));
  }
  absl::ReaderMutexLock lock(&mu_);
  Collection* c = nullptr;
  bool staged = false;
  auto shard = ImportTarget(req->collection(), req->epoch(), req->shard(), &c, &staged);
  if (!shard.ok()) return ToGrpc(shard.status());
  std::vector<float> weights, state;
  if (absl::Status s = wire::Decode(req->weights(), "weights", &weights); !s.ok()) {
    return ToGrpc(s);
  }
  if (absl::Status s = wire::Decode(req->state(), "state", &state); !s.ok()) return ToGrpc(s);
  if (req->applied_ids_size() != req->applied_unix_ms_size()) {
    return ToGrpc(absl::InvalidArgumentError(
        absl::StrCat(req->applied_ids_size(), " applied ids with ", req->applied_unix_ms_size(),
                     " times")));
  }
  // A staged shard is out of the data plane's reach (its changes come
  // under mu_, held here shared): no need to stall the collection's updates.
  std::optional<absl::MutexLock> apply;
  if (!staged) apply.emplace(c->apply_mu.get());
  const ember::v1::ShardAssignment& a = (*shard)->assignment;
  if (req->has_copy_from()) {  // rows from a shard held here: nothing crosses the wire
    if (!weights.empty() || !state.empty() || !req->rows().empty() || req->applied_for_rows()) {
      return ToGrpc(absl::InvalidArgumentError(
          "copy_from takes no weights, state, rows or applied_for_rows"));
    }
    auto copied = CopyWithin(*c, **shard, *req);
    if (!copied.ok()) return ToGrpc(copied.status());
    resp->set_rows_copied(*copied);
  } else if (req->applied_for_rows()) {  // a record for some rows: they carry no values here
    if (a.table().has_dynamic() || !weights.empty() || !state.empty() || !req->rows().empty() ||
        req->row_begin() < 0 || req->row_begin() >= req->row_end() || req->row_end() > a.rows()) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
          "applied_for_rows takes a fixed shard's non-empty row range inside [0, ", a.rows(),
          ") and no rows, weights or state; got [", req->row_begin(), ", ", req->row_end(), ")")));
    }
  } else if (absl::Status s = ImportInto(**shard, *req, weights, state); !s.ok()) {
    return ToGrpc(s);
  }
  if (req->applied_ids_size() > 0) {
    std::vector<std::pair<uint64_t, absl::Time>> entries;
    for (int i = 0; i < req->applied_ids_size(); ++i) {
      entries.emplace_back(req->applied_ids(i), absl::FromUnixMillis(req->applied_unix_ms(i)));
    }
    std::sort(entries.begin(), entries.end(),
              [](const auto& a, const auto& b) { return a.second < b.second; });
    AppliedIds* into = (*shard)->applied.get();
    if (req->applied_for_rows()) {
      std::vector<RowsRecord>& records = *(*shard)->rows_applied;
      auto it = std::find_if(records.begin(), records.end(), [&](const RowsRecord& r) {
        return r.begin == req->row_begin() && r.end == req->row_end();
      });
      if (it == records.end()) {
        records.push_back({req->row_begin(), req->row_end(), AppliedIds()});
        it = records.end() - 1;
      }
      into = &it->applied;
    }
    dedup_forgotten_early_.fetch_add(
        into->Merge(entries, absl::Now(), options_.dedup_ttl, options_.dedup_window),
        std::memory_order_relaxed);
  }
  if (req->step() >= 0) {
    if (absl::Status s = backend_->ImportStep((*shard)->id, req->step()); !s.ok()) {
      return ToGrpc(s);
    }
  }
  return grpc::Status::OK;
}

absl::Status WorkerService::ImportInto(const ShardEntry& shard, const ember::v1::ImportRowsRequest& req,
                                       const std::vector<float>& weights,
                                       const std::vector<float>& state) {
  const bool dynamic = shard.assignment.table().has_dynamic();
  if (!dynamic) {
    if (!req.slot_meta().empty() || !req.ids().empty() || !req.pending_counts().empty() ||
        !req.pending_sketch().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          RefString(shard.assignment.ref()),
          " is not a dynamic table's: no slot_meta, ids, pending_counts or pending_sketch"));
    }
    if (req.rows().empty()) {
      return backend_->ImportRows(shard.id, req.row_begin(), req.row_end(), weights, state);
    }
    std::vector<int64_t> rows;  // a live move's catch-up: just these
    if (absl::Status s = wire::Decode(req.rows(), "rows", &rows); !s.ok()) return s;
    for (size_t k = 0; k < rows.size(); ++k) {
      if (rows[k] < req.row_begin() || rows[k] >= req.row_end() ||
          (k > 0 && rows[k] <= rows[k - 1])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rows: entry ", k, " (", rows[k], ") is outside [", req.row_begin(), ", ",
            req.row_end(), ") or not after the one before (they ascend, distinct)"));
      }
    }
    return backend_->ImportRowsAt(shard.id, rows, weights, state);
  }
  if (!req.rows().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        RefString(shard.assignment.ref()), " is a dynamic table's: its slots move whole (no rows)"));
  }
  if (!req.ids().empty()) {  // rows by id
    if (!req.slot_meta().empty() || !req.pending_counts().empty() ||
        !req.pending_sketch().empty()) {
      return absl::InvalidArgumentError(
          "an import by ids takes no slot_meta, pending_counts or pending_sketch (those come with "
          "slots: a move)");
    }
    std::vector<int64_t> ids;
    if (absl::Status s = wire::Decode(req.ids(), "ids", &ids); !s.ok()) return s;
    return backend_->ImportIds(shard.id, ids, weights, state);
  }
  // Slots with their bookkeeping (a move): the rows checked first, then the
  // slots (checked before they change), then the rows.
  std::vector<int64_t> packed;
  if (absl::Status s = wire::Decode(req.slot_meta(), "slot_meta", &packed); !s.ok()) return s;
  auto slots = backend::EmbeddingBackend::UnpackSlots(packed);
  if (!slots.ok()) return slots.status();
  const int64_t b = req.row_begin(), e = req.row_end();
  if (static_cast<int64_t>(slots->size()) != e - b) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a dynamic table's slots [", b, ", ", e, ") come with their slot_meta (", e - b,
        " entries); got ", slots->size()));
  }
  auto spec = backend_->GetShardSpec(shard.id);
  if (!spec.ok()) return spec.status();
  if (absl::Status s = backend::ValidateImport(*spec, b, e, weights, state); !s.ok()) return s;
  std::vector<int64_t> pending;
  if (absl::Status s = wire::Decode(req.pending_counts(), "pending_counts", &pending); !s.ok()) {
    return s;
  }
  if (absl::Status s = backend::EmbeddingBackend::CheckPendingCounts(pending); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("pending_counts: ", s.message()));
  }
  std::vector<uint32_t> sketch;
  if (absl::Status s = wire::Decode(req.pending_sketch(), "pending_sketch", &sketch); !s.ok()) {
    return s;
  }
  if (absl::Status s = backend::EmbeddingBackend::CheckPendingSketch(sketch); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("pending_sketch: ", s.message()));
  }
  if (absl::Status s = backend_->ImportSlots(shard.id, b, e, *slots); !s.ok()) return s;
  if (absl::Status s = backend_->ImportRows(shard.id, b, e, weights, state); !s.ok()) return s;
  // The counts a move carries replace the shard's, exact and sketched
  // alike (ImportPendingCounts clears the sketch first), so a retried first
  // copy call does not count them twice.
  if (pending.empty() && sketch.empty()) return absl::OkStatus();
  if (absl::Status s = backend_->ImportPendingCounts(shard.id, pending); !s.ok()) return s;
  return backend_->MergePendingSketch(shard.id, sketch);
}

grpc::Status WorkerService::WriteCheckpoint(grpc::ServerContext* ctx,
                                            const ember::v1::WriteCheckpointRequest* req,
                                            ember::v1::WriteCheckpointResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kCoordinator); !a.ok()) return a;
  if (req->dir().empty()) return ToGrpc(absl::InvalidArgumentError("no checkpoint directory"));
  auto dir = checkpoint::ConfinedPath(options_.checkpoint_root, req->dir());
  if (!dir.ok()) return ToGrpc(dir.status());
  struct Copy {
    ember::v1::ShardAssignment assignment;
    checkpoint::ShardData data;
    const ember::v1::CheckpointShard* base = nullptr;  // an incremental one's, if it may fit
    backend::EmbeddingBackend::ChangeMark mark;        // lineage 0: untracked
  };
  std::map<std::pair<std::string, int32_t>, const ember::v1::CheckpointShard*> bases;
  for (const auto& b : req->base()) bases[{b.ref().table(), b.ref().shard_index()}] = &b;
  std::vector<Copy> copies(req->shards_size());
  absl::Duration pause;
  {
    absl::ReaderMutexLock lock(&mu_);
    auto c = FindCollection(req->collection(), req->epoch());
    if (!c.ok()) return ToGrpc(c.status());
    std::vector<const ShardEntry*> entries;
    for (const auto& ref : req->shards()) {
      auto shard = FindShard(**c, ref);
      if (!shard.ok()) return ToGrpc(shard.status());
      entries.push_back(*shard);
    }
    // The buffers of whole copies are allocated (and their pages touched)
    // before the fence, so that the fence lasts only for the copies
    // themselves. A shard whose base entry has its rows and columns is
    // likely a delta: its buffers are sized in the fence, by its changes.
    for (size_t i = 0; i < entries.size(); ++i) {
      const ShardEntry& e = *entries[i];
      auto spec = backend_->GetShardSpec(e.id);
      if (!spec.ok()) return ToGrpc(spec.status());
      checkpoint::ShardData& d = copies[i].data;
      copies[i].assignment = e.assignment;
      d.rows = spec->rows;
      d.cols = spec->dim;
      d.state_width = backend::OptimizerStateWidth(spec->optimizer.type, spec->dim);
      auto b = bases.find({e.assignment.ref().table(), e.assignment.ref().shard_index()});
      if (b != bases.end() && b->second->lineage() != 0 && b->second->rows() == d.rows &&
          b->second->cols() == d.cols && b->second->state_width() == d.state_width &&
          b->second->row_offset() == e.assignment.row_offset() &&
          b->second->col_offset() == e.assignment.col_offset()) {
        copies[i].base = b->second;
        continue;
      }
      d.weights.resize(d.rows * d.cols);
      d.state.resize(d.rows * d.state_width);
    }
    // The fence: no update runs on this collection while its shards are
    // copied; lookups go on.
    const absl::Time fence = absl::Now();
    absl::MutexLock apply((*c)->apply_mu.get());
    for (size_t i = 0; i < entries.size(); ++i) {
      const ShardEntry& e = *entries[i];
      checkpoint::ShardData& d = copies[i].data;
      // The mark this copy is at (a backend without tracking: none), then
      // the rows changed since the base's (its lineage still: else whole).
      if (auto mark = backend_->MarkChanges(e.id); mark.ok()) copies[i].mark = *mark;
      if (copies[i].base != nullptr) {
        auto changed = backend_->ChangedRows(
            e.id, {copies[i].base->lineage(), copies[i].base->generation()});
        // A delta of more than half the rows (an update by device ids
        // marks them all) would be larger than the whole shard.
        if (changed.ok() && static_cast<int64_t>(changed->size()) * 2 <= d.rows) {
          d.delta = true;
          d.changed_rows = *std::move(changed);
        } else {  // moved, recovered or re-created since its base; or mostly changed
          copies[i].base = nullptr;
        }
      }
      const int64_t held = d.delta ? static_cast<int64_t>(d.changed_rows.size()) : d.rows;
      d.weights.resize(held * d.cols);
      d.state.resize(held * d.state_width);
      const absl::Status exported =
          d.delta ? backend_->ExportRowsAt(e.id, d.changed_rows, absl::MakeSpan(d.weights),
                                           absl::MakeSpan(d.state))
                  : backend_->ExportRows(e.id, 0, d.rows, absl::MakeSpan(d.weights),
                                         absl::MakeSpan(d.state));
      if (!exported.ok()) return ToGrpc(exported);
      auto step = backend_->ExportStep(e.id);
      if (!step.ok()) return ToGrpc(step.status());
      d.step = *step;
      if (e.assignment.table().has_dynamic()) {  // and what each slot holds
        std::vector<backend::EmbeddingBackend::SlotMeta> slots(d.rows);
        if (absl::Status s = backend_->ExportSlots(e.id, 0, d.rows, absl::MakeSpan(slots));
            !s.ok()) {
          return ToGrpc(s);
        }
        d.slot_meta = backend::EmbeddingBackend::PackSlots(slots);
        auto pending = backend_->ExportPendingCounts(e.id);
        if (!pending.ok()) return ToGrpc(pending.status());
        d.pending_counts = *std::move(pending);
        auto sketch = backend_->ExportPendingSketch(e.id);
        if (!sketch.ok()) return ToGrpc(sketch.status());
        d.pending_sketch = *std::move(sketch);
      }
      for (const auto& [id, when] : e.applied->Entries()) {
        d.applied_ids.push_back(id);
        d.applied_unix_ms.push_back(absl::ToUnixMillis(when));
      }
    }
    pause = absl::Now() - fence;
  }
  // Updates flow again while the files are written.
  const absl::Time write_start = absl::Now();
  for (Copy& copy : copies) {
    auto entry = checkpoint::WriteShardFile(*dir, copy.assignment.ref(), copy.data);
    if (!entry.ok()) return ToGrpc(entry.status());
    entry->set_row_offset(copy.assignment.row_offset());
    entry->set_col_offset(copy.assignment.col_offset());
    entry->set_lineage(copy.mark.lineage);
    entry->set_generation(copy.mark.generation);
    if (copy.base != nullptr) entry->set_base_generation(copy.base->generation());
    *resp->add_shards() = *std::move(entry);
    copy.data = checkpoint::ShardData();  // free the copy as soon as it is on disk
  }
  resp->set_pause_ms(absl::ToDoubleMilliseconds(pause));
  resp->set_write_ms(absl::ToDoubleMilliseconds(absl::Now() - write_start));
  VLOG(1) << "checkpoint of '" << req->collection() << "': " << copies.size() << " shard(s), pause "
          << resp->pause_ms() << " ms, write " << resp->write_ms() << " ms";
  return grpc::Status::OK;
}

grpc::Status WorkerService::LoadCheckpoint(grpc::ServerContext* ctx,
                                           const ember::v1::LoadCheckpointRequest* req,
                                           ember::v1::LoadCheckpointResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kCoordinator); !a.ok()) return a;
  if (req->dir().empty()) return ToGrpc(absl::InvalidArgumentError("no checkpoint directory"));
  auto dir = checkpoint::ConfinedPath(options_.checkpoint_root, req->dir());
  if (!dir.ok()) return ToGrpc(dir.status());
  // Three phases, so that no lock is held while files are read: note the
  // shards to fill; read and re-cut the files; fill the shards, if they are
  // still the same ones. (Nobody updates them meanwhile: the coordinator
  // publishes the collection's plan only once every load is done.)
  struct Target {
    std::pair<std::string, int32_t> key;
    backend::ShardId id;
    backend::ShardSpec spec;
    checkpoint::RecutTarget recut;
    // The exactly-once record of a source with exactly this shard's rows
    // and columns (a recovery); a re-cut shard starts with none.
    std::vector<std::pair<uint64_t, absl::Time>> applied;
    // A dynamic table's shard: its rows gathered by id from every source
    // of the table (rehash.h) instead of re-cut by range.
    std::unique_ptr<checkpoint::RehashTarget> rehash;
    std::vector<backend::EmbeddingBackend::SlotMeta> slots;
  };
  std::vector<Target> targets;
  {
    absl::ReaderMutexLock lock(&mu_);
    auto c = FindCollection(req->collection(), req->epoch());
    if (!c.ok()) return ToGrpc(c.status());
    std::set<std::pair<std::string, int32_t>> only;
    for (const auto& ref : req->only()) {
      if (!(*c)->shards.count({ref.table(), ref.shard_index()})) {
        return ToGrpc(absl::FailedPreconditionError(absl::StrCat("no ", RefString(ref),
                                                                 " on this worker to load")));
      }
      only.insert({ref.table(), ref.shard_index()});
    }
    for (const auto& [key, entry] : (*c)->shards) {
      if (!only.empty() && !only.count(key)) continue;
      auto spec = backend_->GetShardSpec(entry.id);
      if (!spec.ok()) return ToGrpc(spec.status());
      const auto& a = entry.assignment;
      const bool dynamic = spec->is_dynamic;
      targets.push_back({key, entry.id, *spec,
                         checkpoint::RecutTarget(spec->optimizer.type, a.row_offset(),
                                                 a.col_offset(), dynamic ? 0 : a.rows(), a.cols()),
                         {},
                         dynamic ? std::make_unique<checkpoint::RehashTarget>(*spec) : nullptr,
                         {}});
    }
  }
  int64_t bytes_read = 0;
  for (const auto& source : req->sources()) {
    std::vector<Target*> hit;
    for (Target& t : targets) {
      if (t.key.first != source.ref().table()) continue;
      if (t.rehash != nullptr || checkpoint::Overlaps(source, t.recut)) hit.push_back(&t);
    }
    if (hit.empty()) continue;
    // The shard's file, or its chain's (an incremental checkpoint's delta
    // laid over its bases' files).
    auto data = checkpoint::ReadShardChain(*dir, source, options_.checkpoint_root, &bytes_read);
    if (!data.ok()) return ToGrpc(data.status());
    for (Target* t : hit) {
      const absl::Status taken = t->rehash != nullptr ? t->rehash->Take(source, *data)
                                                      : checkpoint::CopyOverlap(source, *data,
                                                                                &t->recut);
      if (!taken.ok()) return ToGrpc(taken);
      const auto& a = t->spec;
      if (source.row_offset() == a.row_offset && source.rows() == a.rows &&
          source.col_offset() == a.col_offset && source.cols() == a.dim) {
        for (size_t i = 0; i < data->applied_ids.size(); ++i) {
          t->applied.emplace_back(data->applied_ids[i],
                                  absl::FromUnixMillis(data->applied_unix_ms[i]));
        }
      }
    }
  }
  // Every shard is checked before the first is written: a load that fails
  // changes nothing.
  for (Target& t : targets) {
    const std::string what = absl::StrCat("table '", t.key.first, "' shard ", t.key.second);
    if (t.rehash != nullptr) {
      int64_t dropped = 0;
      t.recut.rows = t.spec.rows;
      t.rehash->Finish(&t.recut.weights, &t.recut.state, &t.slots, &dropped);
      t.recut.step = t.rehash->step();
      if (dropped > 0) {
        LOG(WARNING) << what << ": " << dropped << " checkpointed row(s) past its "
                     << t.spec.rows << " were left out by the table's eviction rule";
      }
    } else if (absl::Status s = checkpoint::FinishTarget(t.key.first, &t.recut); !s.ok()) {
      return ToGrpc(s);
    }
    if (absl::Status s =
            backend::ValidateImport(t.spec, 0, t.recut.rows, t.recut.weights, t.recut.state);
        !s.ok()) {
      return ToGrpc(absl::DataLossError(absl::StrCat(what, ": ", s.message())));
    }
    std::sort(t.applied.begin(), t.applied.end(),
              [](const auto& a, const auto& b) { return a.second < b.second; });
  }
  absl::ReaderMutexLock lock(&mu_);
  auto c = FindCollection(req->collection(), req->epoch());
  if (!c.ok()) return ToGrpc(c.status());
  absl::MutexLock apply((*c)->apply_mu.get());
  std::vector<const ShardEntry*> entries;
  for (const Target& t : targets) {
    auto it = (*c)->shards.find(t.key);
    if (it == (*c)->shards.end() || it->second.id != t.id) {
      return ToGrpc(absl::FailedPreconditionError(
          absl::StrCat("table '", t.key.first, "' shard ", t.key.second,
                       " changed on this worker while its checkpoint was read")));
    }
    entries.push_back(&it->second);
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    Target& t = targets[i];
    if (t.rehash != nullptr) {
      if (absl::Status s = backend_->ImportSlots(t.id, 0, t.recut.rows, t.slots); !s.ok()) {
        return ToGrpc(absl::Status(
            s.code(), absl::StrCat("table '", t.key.first, "' shard ", t.key.second, ": ",
                                   s.message())));
      }
    }
    if (absl::Status s = backend_->ImportRows(t.id, 0, t.recut.rows, t.recut.weights,
                                              t.recut.state);
        !s.ok()) {
      return ToGrpc(absl::Status(
          s.code(), absl::StrCat("table '", t.key.first, "' shard ", t.key.second, ": ",
                                 s.message())));
    }
    if (absl::Status s = backend_->ImportStep(t.id, t.recut.step); !s.ok()) return ToGrpc(s);
    if (t.rehash != nullptr) {  // the admission counts, as checkpointed (checked by Take)
      if (absl::Status s = backend_->ImportPendingCounts(t.id, t.rehash->pending_counts());
          !s.ok()) {
        return ToGrpc(s);
      }
      if (absl::Status s = backend_->MergePendingSketch(t.id, t.rehash->pending_sketch());
          !s.ok()) {
        return ToGrpc(s);
      }
    }
    // A whole-collection load rolls the record back with the rows.
    if (req->only().empty()) *entries[i]->applied = AppliedIds();
    dedup_forgotten_early_.fetch_add(
        entries[i]->applied->Merge(t.applied, absl::Now(), options_.dedup_ttl,
                                   options_.dedup_window),
        std::memory_order_relaxed);
  }
  resp->set_bytes_read(bytes_read);
  LOG(INFO) << "collection '" << req->collection() << "' epoch " << req->epoch() << ": "
            << targets.size() << " shard(s) loaded from " << req->dir() << " (" << bytes_read
            << " bytes read)";
  return grpc::Status::OK;
}

}  // namespace worker
}  // namespace ember
