#include "server/worker/worker_service.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/common/grpc_util.h"
#include "server/common/table_spec.h"
#include "server/common/wire.h"

namespace ember {
namespace worker {

using ember::v1::ShardFeature;
using ember::v1::ShardRef;

// One feature's arrays, viewed in place in the request's bytes (copied into
// the vectors only when misaligned).
struct WorkerService::Decoded {
  std::vector<int64_t> lengths, ids;
  std::vector<float> weights, grad;
  backend::FeatureRequest request;
  absl::Span<const float> grad_view;
};

namespace {

std::string RefString(const ShardRef& ref) {
  return absl::StrCat("table '", ref.table(), "' shard ", ref.shard_index());
}

}  // namespace

WorkerService::WorkerService(std::unique_ptr<backend::EmbeddingBackend> backend,
                             const WorkerServiceOptions& options)
    : backend_(std::move(backend)), options_(options) {}

WorkerService::~WorkerService() = default;

absl::StatusOr<WorkerService::Collection*> WorkerService::HeldCollection(
    const std::string& name) const {
  auto it = collections_.find(name);
  if (it == collections_.end()) {
    return absl::NotFoundError(absl::StrCat("no collection '", name, "' on this worker"));
  }
  return it->second.get();
}

absl::StatusOr<WorkerService::Collection*> WorkerService::FindCollection(const std::string& name,
                                                                         int64_t epoch) const {
  auto c = HeldCollection(name);
  if (!c.ok()) return c;
  if (epoch != (*c)->epoch) {
    return absl::FailedPreconditionError(
        absl::StrCat("stale epoch ", epoch, " for collection '", name, "': the plan is at epoch ",
                     (*c)->epoch, "; refresh the plan"));
  }
  return c;
}

absl::StatusOr<const WorkerService::ShardEntry*> WorkerService::FindShard(
    const Collection& c, const ShardRef& ref) const {
  auto it = c.shards.find({ref.table(), ref.shard_index()});
  if (it == c.shards.end()) {
    return absl::NotFoundError(absl::StrCat("no ", RefString(ref), " on this worker"));
  }
  return &it->second;
}

absl::Status WorkerService::DecodeFeature(const Collection& c, const ShardFeature& f,
                                          int64_t* cols, Decoded* out) const {
  auto shard = FindShard(c, f.shard());
  if (!shard.ok()) return shard.status();
  const std::string what = absl::StrCat("feature '", f.feature(), "' (", RefString(f.shard()), ")");
  backend::FeatureRequest& r = out->request;
  if (absl::Status s = wire::View(f.lengths(), "lengths", &out->lengths, &r.lengths); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
  }
  if (absl::Status s = wire::View(f.ids(), "ids", &out->ids, &r.ids); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
  }
  if (absl::Status s = wire::View(f.weights(), "weights", &out->weights, &r.weights); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", s.message()));
  }
  r.shard = (*shard)->id;
  r.pooling = PoolingFromProto(f.pooling());
  // Shape checks before any buffer is sized from the request.
  if (absl::Status s = backend::ValidateFeature(out->request, (*shard)->assignment.rows(), what);
      !s.ok()) {
    return s;
  }
  *cols = (*shard)->assignment.cols();
  return absl::OkStatus();
}

grpc::Status WorkerService::CreateShards(grpc::ServerContext*,
                                         const ember::v1::CreateShardsRequest* req,
                                         ember::v1::CreateShardsResponse*) {
  if (req->collection().empty()) {
    return ToGrpc(absl::InvalidArgumentError("collection name is empty"));
  }
  if (req->epoch() <= 0) {
    return ToGrpc(absl::InvalidArgumentError(absl::StrCat("epoch must be > 0, got ", req->epoch())));
  }
  for (const auto& a : req->shards()) {
    if (a.ref().table() != a.table().name()) {
      return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
          RefString(a.ref()), " carries the config of table '", a.table().name(), "'")));
    }
    if (a.col_offset() < 0 || a.cols() <= 0 ||
        a.col_offset() + a.cols() > a.table().embedding_dim()) {
      return ToGrpc(absl::InvalidArgumentError(
          absl::StrCat(RefString(a.ref()), ": columns [", a.col_offset(), ", ",
                       a.col_offset() + a.cols(), ") are outside the table's ",
                       a.table().embedding_dim())));
    }
  }
  absl::MutexLock lock(&mu_);
  auto it = collections_.find(req->collection());
  if (it != collections_.end()) {
    if (it->second->epoch == req->epoch()) return grpc::Status::OK;  // a retried create
    return ToGrpc(absl::AlreadyExistsError(
        absl::StrCat("collection '", req->collection(), "' is already held at epoch ",
                     it->second->epoch, "; drop it first")));
  }
  auto c = std::make_unique<Collection>();
  c->epoch = req->epoch();
  absl::Status failed;
  for (const auto& a : req->shards()) {
    const backend::ShardSpec spec =
        ShardSpecFromTable(a.table(), a.row_offset(), a.col_offset(), a.rows(), a.cols());
    auto key = std::make_pair(a.ref().table(), a.ref().shard_index());
    if (c->shards.count(key)) {
      failed = absl::InvalidArgumentError(absl::StrCat("duplicate ", RefString(a.ref())));
      break;
    }
    auto id = backend_->CreateShard(spec);
    if (!id.ok()) {
      failed = absl::Status(id.status().code(),
                            absl::StrCat(RefString(a.ref()), ": ", id.status().message()));
      break;
    }
    c->shards[key] = ShardEntry{*id, a};
  }
  if (!failed.ok()) {
    for (const auto& [key, entry] : c->shards) (void)backend_->DropShard(entry.id);
    return ToGrpc(failed);
  }
  LOG(INFO) << "collection '" << req->collection() << "' epoch " << req->epoch() << ": "
            << c->shards.size() << " shard(s) created";
  collections_[req->collection()] = std::move(c);
  return grpc::Status::OK;
}

grpc::Status WorkerService::DropShards(grpc::ServerContext*, const ember::v1::DropShardsRequest* req,
                                       ember::v1::DropShardsResponse*) {
  absl::MutexLock lock(&mu_);
  auto c = HeldCollection(req->collection());
  if (!c.ok()) return ToGrpc(c.status());
  {
    absl::MutexLock apply((*c)->apply_mu.get());  // let an update in flight finish
    for (const auto& [key, entry] : (*c)->shards) (void)backend_->DropShard(entry.id);
  }
  collections_.erase(req->collection());
  LOG(INFO) << "collection '" << req->collection() << "' dropped";
  return grpc::Status::OK;
}

grpc::Status WorkerService::Lookup(grpc::ServerContext*, const ember::v1::WorkerLookupRequest* req,
                                   ember::v1::WorkerLookupResponse* resp) {
  absl::ReaderMutexLock lock(&mu_);
  auto c = FindCollection(req->collection(), req->epoch());
  if (!c.ok()) return ToGrpc(c.status());
  const int n = req->features_size();
  std::vector<Decoded> decoded(n);
  std::vector<int64_t> cols(n);
  int64_t total_bytes = 0;
  for (int i = 0; i < n; ++i) {
    if (absl::Status s = DecodeFeature(**c, req->features(i), &cols[i], &decoded[i]); !s.ok()) {
      return ToGrpc(s);
    }
    total_bytes += backend::OutputSize(decoded[i].request, cols[i]) * 4;
  }
  if (total_bytes > options_.max_response_bytes) {
    return ToGrpc(absl::ResourceExhaustedError(
        absl::StrCat("lookup output would be ", total_bytes, " bytes, over the limit of ",
                     options_.max_response_bytes, "; split the batch")));
  }
  std::vector<backend::LookupRequest> requests(n);
  for (int i = 0; i < n; ++i) {
    requests[i].feature = decoded[i].request;
    requests[i].output = wire::Resize<float>(
        resp->add_outputs(), backend::OutputSize(decoded[i].request, cols[i]));
  }
  if (absl::Status s = backend_->Lookup(requests); !s.ok()) {
    resp->clear_outputs();
    return ToGrpc(s);
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::ApplyGradients(grpc::ServerContext*,
                                           const ember::v1::WorkerApplyGradientsRequest* req,
                                           ember::v1::WorkerApplyGradientsResponse* resp) {
  if (req->request_id().empty()) {
    return ToGrpc(absl::InvalidArgumentError("request_id is empty (needed for exactly-once)"));
  }
  absl::ReaderMutexLock lock(&mu_);
  auto c = FindCollection(req->collection(), req->epoch());
  if (!c.ok()) return ToGrpc(c.status());
  Collection& coll = **c;
  absl::MutexLock apply(coll.apply_mu.get());
  if (coll.applied.contains(req->request_id())) {
    resp->set_duplicate(true);
    return grpc::Status::OK;
  }
  const int n = req->gradients_size();
  std::vector<Decoded> decoded(n);
  std::vector<backend::GradientRequest> requests(n);
  for (int i = 0; i < n; ++i) {
    const auto& g = req->gradients(i);
    int64_t cols = 0;
    if (absl::Status s = DecodeFeature(coll, g.feature(), &cols, &decoded[i]); !s.ok()) {
      return ToGrpc(s);
    }
    if (absl::Status s = wire::View(g.grad(), "grad", &decoded[i].grad, &decoded[i].grad_view);
        !s.ok()) {
      return ToGrpc(s);
    }
    requests[i].feature = decoded[i].request;
    requests[i].grad = decoded[i].grad_view;
  }
  if (absl::Status s = backend_->ApplyGradients(requests); !s.ok()) return ToGrpc(s);
  coll.applied.insert(req->request_id());
  coll.applied_order.push_back(req->request_id());
  while (static_cast<int>(coll.applied_order.size()) > options_.dedup_window) {
    coll.applied.erase(coll.applied_order.front());
    coll.applied_order.pop_front();
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::ExportRows(grpc::ServerContext*, const ember::v1::ExportRowsRequest* req,
                                       ember::v1::ExportRowsResponse* resp) {
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
  auto spec = backend_->GetShardSpec((*shard)->id);
  if (!spec.ok()) return ToGrpc(spec.status());
  const int64_t width = backend::OptimizerStateWidth(spec->optimizer.type, spec->dim);
  const int64_t bytes = (e - b) * (spec->dim + width) * 4;
  if (bytes > options_.max_response_bytes) {
    return ToGrpc(absl::ResourceExhaustedError(absl::StrCat(
        "exporting ", e - b, " rows takes ", bytes, " bytes, over the limit of ",
        options_.max_response_bytes, "; export fewer rows per call")));
  }
  auto weights = wire::Resize<float>(resp->mutable_weights(), (e - b) * spec->dim);
  auto state = wire::Resize<float>(resp->mutable_state(), (e - b) * width);
  if (absl::Status s = backend_->ExportRows((*shard)->id, b, e, weights, state); !s.ok()) {
    return ToGrpc(s);
  }
  auto step = backend_->ExportStep((*shard)->id);
  if (!step.ok()) return ToGrpc(step.status());
  resp->set_cols(spec->dim);
  resp->set_state_width(width);
  resp->set_step(*step);
  return grpc::Status::OK;
}

grpc::Status WorkerService::ImportRows(grpc::ServerContext*, const ember::v1::ImportRowsRequest* req,
                                       ember::v1::ImportRowsResponse*) {
  absl::ReaderMutexLock lock(&mu_);
  auto c = HeldCollection(req->collection());
  if (!c.ok()) return ToGrpc(c.status());
  auto shard = FindShard(**c, req->shard());
  if (!shard.ok()) return ToGrpc(shard.status());
  std::vector<float> weights, state;
  if (absl::Status s = wire::Decode(req->weights(), "weights", &weights); !s.ok()) {
    return ToGrpc(s);
  }
  if (absl::Status s = wire::Decode(req->state(), "state", &state); !s.ok()) return ToGrpc(s);
  absl::MutexLock apply((*c)->apply_mu.get());
  if (absl::Status s =
          backend_->ImportRows((*shard)->id, req->row_begin(), req->row_end(), weights, state);
      !s.ok()) {
    return ToGrpc(s);
  }
  if (req->step() >= 0) {
    if (absl::Status s = backend_->ImportStep((*shard)->id, req->step()); !s.ok()) {
      return ToGrpc(s);
    }
  }
  return grpc::Status::OK;
}

grpc::Status WorkerService::ShardStatus(grpc::ServerContext*, const ember::v1::ShardStatusRequest*,
                                        ember::v1::ShardStatusResponse* resp) {
  absl::ReaderMutexLock lock(&mu_);
  resp->set_backend(backend_->Name());
  for (const auto& [name, c] : collections_) {
    for (const auto& [key, entry] : c->shards) {
      auto* info = resp->add_shards();
      info->set_collection(name);
      info->set_epoch(c->epoch);
      *info->mutable_shard() = entry.assignment.ref();
      info->set_row_offset(entry.assignment.row_offset());
      info->set_col_offset(entry.assignment.col_offset());
      info->set_rows(entry.assignment.rows());
      info->set_cols(entry.assignment.cols());
      auto step = backend_->ExportStep(entry.id);
      info->set_step(step.ok() ? *step : -1);
    }
  }
  return grpc::Status::OK;
}

}  // namespace worker
}  // namespace ember
