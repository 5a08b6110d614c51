// WorkerService in process (no gRPC transport): NaN/Inf in gradient updates,
// refused by default and left out with skip_nonfinite, against SGD values
// worked by hand.
#include "server/worker/worker_service.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <fstream>
#include <string>
#include <cmath>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "link/peer_link.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/dynamic/dynamic_backend.h"
#include "server/backend/key_value/key_value_backend.h"
#include "server/backend/forwarding_backend.h"
#include "server/common/grpc_util.h"
#include "server/common/wire.h"
#include "server/worker/applied_ids.h"
#include "server/worker/shm_channels.h"

namespace ember {
namespace worker {
namespace {

using ember::v1::TableConfig;

// The CPU backend as one that writes packed outputs only and checks ids
// before its kernels run (the CUDA backend's kind).
class PackedOutputsBackend : public backend::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  bool WritesStridedOutputs() const override { return false; }
  bool ChecksIdsWhileGathering() const override { return false; }
};

// A backend that runs `hook` as each lookup starts (a client writing its
// region while a worker serves the call).
class HookedBackend : public backend::ForwardingBackend {
 public:
  HookedBackend(std::unique_ptr<backend::EmbeddingBackend> b, std::function<void()> hook)
      : ForwardingBackend(std::move(b)), hook_(std::move(hook)) {}
  absl::Status Lookup(absl::Span<const backend::LookupRequest> r) override {
    hook_();
    return ForwardingBackend::Lookup(r);
  }

 private:
  const std::function<void()> hook_;
};

// A worker holding collection "c" at epoch 1: tables "t" (SUM) and "s"
// (NONE), 4 rows of 4 columns, all zero, SGD at rate 1.
std::unique_ptr<WorkerService> MakeService(WorkerServiceOptions so, bool packed_only = false,
                                           std::function<void()> before_lookup = nullptr) {
  backend::CpuBackendOptions o;
  o.memory_limit_bytes = 1 << 20;
  o.skip_overflow = so.skip_nonfinite;  // as WorkerServer makes its backend
  auto b = backend::CreateCpuBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  std::unique_ptr<backend::EmbeddingBackend> be = std::move(*b);
  if (packed_only) be = std::make_unique<PackedOutputsBackend>(std::move(be));
  if (before_lookup) be = std::make_unique<HookedBackend>(std::move(be), std::move(before_lookup));
  auto s = std::make_unique<WorkerService>(std::move(be), so);
  ember::v1::CreateShardsRequest req;
  req.set_collection("c");
  req.set_epoch(1);
  for (const char* name : {"t", "s"}) {
    auto* a = req.add_shards();
    a->mutable_ref()->set_table(name);
    TableConfig* t = a->mutable_table();
    t->set_name(name);
    t->set_num_embeddings(4);
    t->set_embedding_dim(4);
    t->set_pooling(std::string(name) == "s" ? TableConfig::NONE : TableConfig::SUM);
    t->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::SGD);
    t->mutable_optimizer()->set_learning_rate(1.0);
    t->mutable_initializer()->set_type(ember::v1::InitializerSpec::CONSTANT);
    t->mutable_initializer()->set_value(0.0);
    a->set_rows(4);
    a->set_cols(4);
  }
  ember::v1::CreateShardsResponse resp;
  EXPECT_TRUE(s->CreateShards(nullptr, &req, &resp).ok());
  return s;
}

// A CPU backend whose CreateShard of a table named "slow" waits until
// Release() (as a large table's initialisation takes its time); Started()
// waits for such a call to begin. Arm() sets the gate up again.
class GatedBackend : public backend::ForwardingBackend {
 public:
  explicit GatedBackend(std::unique_ptr<backend::EmbeddingBackend> b)
      : ForwardingBackend(std::move(b)) {
    Arm();
  }
  void Arm() {
    absl::MutexLock lock(&mu_);
    started_ = std::make_shared<absl::Notification>();
    release_ = std::make_shared<absl::Notification>();
  }
  void Started() { Gate().first->WaitForNotification(); }
  void Release() { Gate().second->Notify(); }

  absl::StatusOr<backend::ShardId> CreateShard(const backend::ShardSpec& spec) override {
    if (spec.table == "slow") Hold();
    return ForwardingBackend::CreateShard(spec);
  }
  // Lookups wait at the gate too (while `gate_lookups`).
  std::atomic<bool> gate_lookups{false};
  absl::Status Lookup(absl::Span<const backend::LookupRequest> r) override {
    if (gate_lookups) Hold();
    return ForwardingBackend::Lookup(r);
  }

 private:
  // Says a gated call started, and waits for Release().
  void Hold() {
    std::shared_ptr<absl::Notification> release;
    {
      absl::MutexLock lock(&mu_);
      if (!started_->HasBeenNotified()) started_->Notify();
      release = release_;
    }
    release->WaitForNotification();
  }
  using Notifications =
      std::pair<std::shared_ptr<absl::Notification>, std::shared_ptr<absl::Notification>>;
  Notifications Gate() {
    absl::MutexLock lock(&mu_);
    return {started_, release_};
  }
  absl::Mutex mu_;
  std::shared_ptr<absl::Notification> started_ ABSL_GUARDED_BY(mu_), release_ ABSL_GUARDED_BY(mu_);
};

ember::v1::ShardAssignment Assignment(const std::string& table, int rows) {
  ember::v1::ShardAssignment a;
  a.mutable_ref()->set_table(table);
  TableConfig* t = a.mutable_table();
  t->set_name(table);
  t->set_num_embeddings(rows);
  t->set_embedding_dim(4);
  t->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::SGD);
  t->mutable_optimizer()->set_learning_rate(1.0);
  a.set_rows(rows);
  a.set_cols(4);
  return a;
}

grpc::Status LookUp(WorkerService* s, const std::string& collection, const std::string& table) {
  ember::v1::WorkerLookupRequest req;
  req.set_collection(collection);
  req.set_epoch(1);
  auto* f = req.add_features();
  f->mutable_shard()->set_table(table);
  f->set_pooling(TableConfig::SUM);
  f->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{1}));
  f->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{2}));
  ember::v1::WorkerLookupResponse resp;
  return s->Lookup(nullptr, &req, &resp);
}

// A worker service over a gated CPU backend (1 MiB), holding collection
// "held" (table t, 8 rows) at epoch 1.
struct GatedService {
  explicit GatedService(WorkerServiceOptions so = WorkerServiceOptions()) {
    backend::CpuBackendOptions o;
    o.memory_limit_bytes = 1 << 20;
    auto cpu = backend::CreateCpuBackend(o);
    if (!cpu.ok()) return;
    auto owned = std::make_unique<GatedBackend>(std::move(*cpu));
    gated = owned.get();
    empty_bytes = gated->AvailableBytes();
    service = std::make_unique<WorkerService>(std::move(owned), so);
    ember::v1::CreateShardsRequest held;
    held.set_collection("held");
    held.set_epoch(1);
    *held.add_shards() = Assignment("t", 8);
    ember::v1::CreateShardsResponse cr;
    ok = service->CreateShards(nullptr, &held, &cr).ok();
  }
  bool ok = false;
  GatedBackend* gated = nullptr;
  int64_t empty_bytes = 0;  // available before any shard
  std::unique_ptr<WorkerService> service;
};

// Shards are allocated and initialised outside the worker's lock: while one
// is being made, the collections held serve lookups, a second create of the
// same collection is refused (ABORTED) instead of waiting, and an update
// whose collection is dropped meanwhile gives its new shards back.
TEST(WorkerServiceTest, MakingShardsDoesNotStallTheCollectionsHeld) {
  GatedService g;
  ASSERT_TRUE(g.ok);
  WorkerService& s = *g.service;
  GatedBackend* gated = g.gated;
  const int64_t empty = g.empty_bytes;
  ember::v1::CreateShardsResponse cr;

  ember::v1::CreateShardsRequest big;
  big.set_collection("big");
  big.set_epoch(1);
  *big.add_shards() = Assignment("slow", 16);
  grpc::Status big_status;
  std::thread creator([&] { big_status = s.CreateShards(nullptr, &big, &cr); });
  gated->Started();
  // The slow shard is being made: the held collection serves meanwhile.
  EXPECT_TRUE(LookUp(&s, "held", "t").ok());
  EXPECT_EQ(s.CreateShards(nullptr, &big, &cr).error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(LookUp(&s, "big", "slow").error_code(), grpc::StatusCode::NOT_FOUND);  // not yet
  gated->Release();
  creator.join();
  ASSERT_TRUE(big_status.ok()) << big_status.error_message();
  EXPECT_TRUE(LookUp(&s, "big", "slow").ok());
  EXPECT_TRUE(s.CreateShards(nullptr, &big, &cr).ok());  // a retry of the same create

  // An update adding a slow shard to `held`, which is dropped meanwhile:
  // the new shard is not kept.
  gated->Arm();
  ember::v1::UpdateShardsRequest update;
  update.set_collection("held");
  update.set_epoch(2);
  *update.add_create() = Assignment("slow", 16);
  ember::v1::UpdateShardsResponse ur;
  grpc::Status update_status;
  std::thread updater([&] { update_status = s.UpdateShards(nullptr, &update, &ur); });
  gated->Started();
  EXPECT_TRUE(LookUp(&s, "held", "t").ok());
  EXPECT_EQ(s.UpdateShards(nullptr, &update, &ur).error_code(), grpc::StatusCode::ABORTED);
  ember::v1::DropShardsRequest drop;
  drop.set_collection("held");
  drop.set_epoch(1);
  ember::v1::DropShardsResponse dr;
  ASSERT_TRUE(s.DropShards(nullptr, &drop, &dr).ok());
  gated->Release();
  updater.join();
  EXPECT_EQ(update_status.error_code(), grpc::StatusCode::NOT_FOUND) << update_status.error_message();
  drop.set_collection("big");
  ASSERT_TRUE(s.DropShards(nullptr, &drop, &dr).ok());
  EXPECT_EQ(gated->AvailableBytes(), empty);  // nothing left behind
}

// A backend that maps host memory (as the CUDA backend does, for
// fused_uvm shards), with `device_bytes` of memory and `mapped_bytes` of
// mapped host memory, each counted apart: the shards are held by the CPU
// backend below, and the mapped ones noted.
class HostMappingBackend : public backend::ForwardingBackend {
 public:
  HostMappingBackend(std::unique_ptr<backend::EmbeddingBackend> inner, int64_t device_bytes,
                     int64_t mapped_bytes)
      : ForwardingBackend(std::move(inner)),
        device_bytes_(device_bytes),
        mapped_bytes_(mapped_bytes) {}
  absl::StatusOr<backend::ShardId> CreateShard(const backend::ShardSpec& spec) override {
    backend::ShardSpec held = spec;
    held.host_mapped = false;
    auto id = inner()->CreateShard(held);
    if (!id.ok()) return id;
    (spec.host_mapped ? mapped_bytes_ : device_bytes_) -= backend::ShardBytes(spec);
    if (spec.host_mapped) mapped_tables.push_back(spec.table);
    return id;
  }
  int64_t AvailableBytes() const override { return device_bytes_; }
  bool MapsHostMemory() const override { return true; }
  int64_t AvailableMappedBytes() const override { return mapped_bytes_; }
  std::vector<std::string> mapped_tables;

 private:
  int64_t device_bytes_, mapped_bytes_;
};

// A worker whose backend maps host memory serves fused_uvm: such shards
// are created mapped and counted against the mapped memory, apart from
// the device's; shards that pass either are refused with nothing made.
TEST(WorkerServiceTest, FusedUvmShardsGoToMappedHostMemory) {
  auto cpu = backend::CreateCpuBackend(backend::CpuBackendOptions());
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto owned = std::make_unique<HostMappingBackend>(std::move(*cpu), 1000, 3000);
  HostMappingBackend* mapping = owned.get();
  WorkerService s(std::move(owned), WorkerServiceOptions());
  EXPECT_EQ(s.ServedComputeKernels(), (std::vector<std::string>{"dense", "fused", "fused_uvm"}));
  // Table "u", one shard per kernel, `rows` rows of 4 fp32 columns (SGD:
  // 16 bytes a row).
  auto request = [](const std::string& collection,
                    const std::vector<std::pair<std::string, int64_t>>& shards) {
    ember::v1::CreateShardsRequest req;
    req.set_collection(collection);
    req.set_epoch(1);
    int64_t offset = 0;
    for (size_t i = 0; i < shards.size(); ++i) {
      auto* a = req.add_shards();
      a->mutable_ref()->set_table("u");
      a->mutable_ref()->set_shard_index(static_cast<int>(i));
      TableConfig* t = a->mutable_table();
      t->set_name("u");
      t->set_num_embeddings(1000);
      t->set_embedding_dim(4);
      t->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::SGD);
      a->set_row_offset(offset);
      a->set_rows(shards[i].second);
      a->set_cols(4);
      a->set_compute_kernel(shards[i].first);
      offset += shards[i].second;
    }
    return req;
  };
  ember::v1::CreateShardsResponse resp;
  // 150 mapped rows (2400 bytes) beside 50 in memory (800): past the
  // 1000 bytes of memory only if both counted there.
  auto fits = request("fits", {{"fused_uvm", 150}, {"fused", 50}});
  grpc::Status st = s.CreateShards(nullptr, &fits, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(mapping->mapped_tables, std::vector<std::string>{"u"});
  EXPECT_EQ(mapping->AvailableMappedBytes(), 600);
  EXPECT_EQ(mapping->AvailableBytes(), 200);
  ember::v1::ShardStatusRequest sreq;
  ember::v1::ShardStatusResponse status;
  ASSERT_TRUE(s.ShardStatus(nullptr, &sreq, &status).ok());
  EXPECT_EQ(status.available_mapped_bytes(), 600);
  EXPECT_EQ(s.GetStats().available_mapped_bytes, 600);
  // 50 mapped rows (800 bytes) with 600 left: refused, nothing made.
  auto over = request("over", {{"fused", 5}, {"fused_uvm", 50}});
  st = s.CreateShards(nullptr, &over, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("1 fused_uvm(_caching) shard(s) need 800 bytes of host memory mapped"),
            std::string::npos)
      << st.error_message();
  EXPECT_EQ(mapping->AvailableBytes(), 200);
  EXPECT_EQ(mapping->mapped_tables.size(), 1u);
  // Memory still counts apart: 20 rows in memory (320 bytes) with 200 left.
  auto over_memory = request("over_memory", {{"fused", 20}, {"fused_uvm", 10}});
  st = s.CreateShards(nullptr, &over_memory, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("1 shard(s) need 320 bytes"), std::string::npos)
      << st.error_message();
  EXPECT_EQ(mapping->AvailableMappedBytes(), 600);
  EXPECT_EQ(mapping->mapped_tables.size(), 1u);
}

// Data calls past --max_queued_calls are refused at once ("worker busy",
// RESOURCE_EXHAUSTED) instead of queueing, counted, and served again once
// the calls in progress finish.
// A shard planned on a kernel the worker does not serve (a UVM tier) is
// refused before anything is allocated; the kernels it serves are taken.
TEST(WorkerServiceTest, KernelsItDoesNotServeAreRefusedBeforeAllocating) {
  auto s = MakeService(WorkerServiceOptions());
  ember::v1::ShardStatusRequest sreq;
  ember::v1::ShardStatusResponse before;
  ASSERT_TRUE(s->ShardStatus(nullptr, &sreq, &before).ok());
  auto request = [](const std::string& collection, const std::vector<std::string>& kernels) {
    ember::v1::CreateShardsRequest req;
    req.set_collection(collection);
    req.set_epoch(1);
    for (size_t i = 0; i < kernels.size(); ++i) {
      auto* a = req.add_shards();
      a->mutable_ref()->set_table("u");
      a->mutable_ref()->set_shard_index(static_cast<int>(i));
      TableConfig* t = a->mutable_table();
      t->set_name("u");
      t->set_num_embeddings(8 * kernels.size());
      t->set_embedding_dim(4);
      t->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::SGD);
      a->set_row_offset(8 * i);
      a->set_rows(8);
      a->set_cols(4);
      a->set_compute_kernel(kernels[i]);
    }
    return req;
  };
  ember::v1::CreateShardsResponse resp;
  for (const std::string bad : {"fused_uvm", "fused_uvm_caching", "key_value", "nonsense"}) {
    auto req = request("uvm", {"fused", bad});
    const grpc::Status st = s->CreateShards(nullptr, &req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_NE(st.error_message().find("compute kernel '" + bad + "' is not served"),
              std::string::npos)
        << st.error_message();
  }
  ember::v1::ShardStatusResponse after;
  ASSERT_TRUE(s->ShardStatus(nullptr, &sreq, &after).ok());
  EXPECT_EQ(after.shards_size(), before.shards_size());
  EXPECT_EQ(after.available_bytes(), before.available_bytes());
  auto good = request("fine", {"fused", "dense", ""});
  EXPECT_TRUE(s->CreateShards(nullptr, &good, &resp).ok());
  // A retry is the same request when "" and "fused" trade places (a shard
  // created by a coordinator from before the field); another kernel is not.
  auto retry = request("fine", {"", "dense", "fused"});
  EXPECT_TRUE(s->CreateShards(nullptr, &retry, &resp).ok());
  auto other = request("fine", {"dense", "dense", "fused"});
  EXPECT_FALSE(s->CreateShards(nullptr, &other, &resp).ok());
  EXPECT_EQ(s->ServedComputeKernels(), (std::vector<std::string>{"dense", "fused"}));
}

TEST(WorkerServiceTest, DataCallsPastTheBoundAreRefusedAsBusy) {
  WorkerServiceOptions so;
  so.max_queued_calls = 2;
  GatedService g(so);
  ASSERT_TRUE(g.ok);
  WorkerService& s = *g.service;
  GatedBackend* gated = g.gated;

  gated->gate_lookups = true;
  std::vector<std::thread> in_progress;
  std::vector<grpc::Status> results(2);
  for (int i = 0; i < 2; ++i) {
    in_progress.emplace_back([&, i] { results[i] = LookUp(&s, "held", "t"); });
  }
  gated->Started();
  while (s.GetStats().calls_in_progress < 2) std::this_thread::yield();
  const grpc::Status busy = LookUp(&s, "held", "t");
  EXPECT_EQ(busy.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(busy.error_message().rfind(kWorkerBusy, 0), 0u) << busy.error_message();
  EXPECT_TRUE(HasSignal(busy, kSignalWorkerBusy));
  EXPECT_FALSE(HasSignal(busy, kSignalLinkBytesTaken));
  ember::v1::WorkerApplyGradientsRequest update;
  update.set_collection("held");
  update.set_epoch(1);
  update.set_request_id("u1");
  ember::v1::WorkerApplyGradientsResponse ur;
  EXPECT_EQ(s.ApplyGradients(nullptr, &update, &ur).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(s.GetStats().busy_refused, 2);
  // A primary's forward is not refused as busy (lookups here may be waiting
  // for the step it carries): it gets past the bound, to its own checks.
  update.set_from_primary("10.0.0.1:7000");
  const grpc::Status forwarded = s.ApplyGradients(nullptr, &update, &ur);
  EXPECT_NE(forwarded.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << forwarded.error_message();
  EXPECT_EQ(s.GetStats().busy_refused, 2);
  gated->gate_lookups = false;
  gated->Release();
  for (auto& t : in_progress) t.join();
  for (const auto& r : results) EXPECT_TRUE(r.ok()) << r.error_message();
  EXPECT_EQ(s.GetStats().calls_in_progress, 0);
  EXPECT_TRUE(LookUp(&s, "held", "t").ok());
}

// An update of collection "c" at epoch 1 under `id`, with one gradient
// for table "t" (SUM) whose arrays the caller fills.
ember::v1::WorkerApplyGradientsRequest UpdateOfT(const std::string& id) {
  ember::v1::WorkerApplyGradientsRequest r;
  r.set_collection("c");
  r.set_epoch(1);
  r.set_request_id(id);
  auto* g = r.add_gradients();
  g->mutable_feature()->mutable_shard()->set_table("t");
  g->mutable_feature()->set_pooling(TableConfig::SUM);
  return r;
}

// Pooled table t: bag 0 = {id 0} with a NaN in its gradient row; bag 1 =
// {id 1 (weight 2), id 2 (weight Inf)} with gradient [1, 2, 3, 4].
// Sequence table s: id 0 with an Inf gradient row, id 3 with [1, 1, 1, 1].
ember::v1::WorkerApplyGradientsRequest Update(const std::string& id) {
  ember::v1::WorkerApplyGradientsRequest r = UpdateOfT(id);
  auto* g = r.mutable_gradients(0);
  g->mutable_feature()->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{1, 2}));
  g->mutable_feature()->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{0, 1, 2}));
  g->mutable_feature()->set_weights(wire::Encode<float>(std::vector<float>{1, 2, INFINITY}));
  g->set_grad(wire::Encode<float>(std::vector<float>{NAN, 1, 1, 1, 1, 2, 3, 4}));
  g = r.add_gradients();
  g->mutable_feature()->mutable_shard()->set_table("s");
  g->mutable_feature()->set_pooling(TableConfig::NONE);
  g->mutable_feature()->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{2}));
  g->mutable_feature()->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{0, 3}));
  g->set_grad(wire::Encode<float>(std::vector<float>{INFINITY, 0, 0, 0, 1, 1, 1, 1}));
  return r;
}

std::unique_ptr<WorkerService> MakeService(bool skip) {
  WorkerServiceOptions so;
  so.skip_nonfinite = skip;
  return MakeService(so);
}

// The 4 rows of table `table` of `collection`, exported.
std::vector<float> Table(WorkerService* s, const std::string& table,
                         const std::string& collection = "c") {
  ember::v1::ExportRowsRequest req;
  req.set_collection(collection);
  req.mutable_shard()->set_table(table);
  req.set_row_end(4);
  ember::v1::ExportRowsResponse resp;
  EXPECT_TRUE(s->ExportRows(nullptr, &req, &resp).ok());
  std::vector<float> w;
  EXPECT_TRUE(wire::Decode(resp.weights(), "weights", &w).ok());
  return w;
}

TEST(WorkerServiceTest, NonFiniteUpdatesAreRefusedAndCounted) {
  auto s = MakeService(/*skip=*/false);
  auto req = Update("a");
  ember::v1::WorkerApplyGradientsResponse resp;
  EXPECT_EQ(s->ApplyGradients(nullptr, &req, &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Table(s.get(), "t"), std::vector<float>(16, 0.0f));  // nothing applied
  EXPECT_EQ(Table(s.get(), "s"), std::vector<float>(16, 0.0f));
  ember::v1::ShardStatusRequest sreq;
  ember::v1::ShardStatusResponse st;
  ASSERT_TRUE(s->ShardStatus(nullptr, &sreq, &st).ok());
  EXPECT_EQ(st.nonfinite_refused(), 1);
  EXPECT_EQ(st.nonfinite_skipped_ids(), 0);
}

TEST(WorkerServiceTest, SkipNonFiniteLeavesOutWhatTheyTouchAndAppliesTheRest) {
  auto s = MakeService(/*skip=*/true);
  auto req = Update("a");
  ember::v1::WorkerApplyGradientsResponse resp;
  ASSERT_TRUE(s->ApplyGradients(nullptr, &req, &resp).ok());
  // SGD, lr 1, from 0: only id 1 of t (weight 2 x [1, 2, 3, 4]) and id 3
  // of s move.
  std::vector<float> t(16, 0.0f), q(16, 0.0f);
  for (int c = 0; c < 4; ++c) t[4 + c] = -2.0f * (c + 1);
  for (int c = 0; c < 4; ++c) q[12 + c] = -1.0f;
  EXPECT_EQ(Table(s.get(), "t"), t);
  EXPECT_EQ(Table(s.get(), "s"), q);
  ember::v1::ShardStatusRequest sreq;
  ember::v1::ShardStatusResponse st;
  ASSERT_TRUE(s->ShardStatus(nullptr, &sreq, &st).ok());
  EXPECT_EQ(st.nonfinite_skipped_ids(), 3);  // t's ids 0 and 2, s's id 0
  EXPECT_EQ(st.nonfinite_refused(), 0);
  // A malformed request is still refused whole, NaN or not.
  auto bad = Update("b");
  bad.mutable_gradients(0)->mutable_feature()->set_lengths(
      wire::Encode<int64_t>(std::vector<int64_t>{1, 5}));
  EXPECT_EQ(s->ApplyGradients(nullptr, &bad, &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Table(s.get(), "t"), t);
}

// fp32 SGD at rate 1 from zeros: bag {0, 0} with a gradient of 3e38 merges
// to 6e38 for row 0, past fp32; bag {1} moves row 1 by -1.
ember::v1::WorkerApplyGradientsRequest Overflowing(const std::string& id) {
  ember::v1::WorkerApplyGradientsRequest r = UpdateOfT(id);
  auto* g = r.mutable_gradients(0);
  g->mutable_feature()->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{2, 1}));
  g->mutable_feature()->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{0, 0, 1}));
  g->set_grad(wire::Encode<float>(std::vector<float>{3e38f, 0, 0, 0, 1, 1, 1, 1}));
  return r;
}

TEST(WorkerServiceTest, UpdatesThatWouldOverflowAreRefusedAndCounted) {
  auto s = MakeService(/*skip=*/false);
  auto req = Overflowing("a");
  ember::v1::WorkerApplyGradientsResponse resp;
  const grpc::Status st = s->ApplyGradients(nullptr, &req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(),
              ::testing::HasSubstr("table 't': row 0 column 0: the weight would become -inf"));
  EXPECT_EQ(Table(s.get(), "t"), std::vector<float>(16, 0.0f));  // nothing applied
  ember::v1::ShardStatusRequest sreq;
  ember::v1::ShardStatusResponse status;
  ASSERT_TRUE(s->ShardStatus(nullptr, &sreq, &status).ok());
  EXPECT_EQ(status.overflow_refused(), 1);
  EXPECT_EQ(status.overflow_skipped_rows(), 0);
  EXPECT_EQ(status.nonfinite_refused(), 0);
  EXPECT_EQ(s->GetStats().overflow_refused, 1);
}

TEST(WorkerServiceTest, SkipNonFiniteLeavesOverflowingRowsAsTheyWere) {
  auto s = MakeService(/*skip=*/true);
  auto req = Overflowing("a");
  ember::v1::WorkerApplyGradientsResponse resp;
  ASSERT_TRUE(s->ApplyGradients(nullptr, &req, &resp).ok());
  std::vector<float> t(16, 0.0f);
  for (int c = 0; c < 4; ++c) t[4 + c] = -1.0f;
  EXPECT_EQ(Table(s.get(), "t"), t);
  ember::v1::ShardStatusRequest sreq;
  ember::v1::ShardStatusResponse status;
  ASSERT_TRUE(s->ShardStatus(nullptr, &sreq, &status).ok());
  EXPECT_EQ(status.overflow_skipped_rows(), 1);
  EXPECT_EQ(status.overflow_refused(), 0);
  EXPECT_EQ(s->GetStats().overflow_skipped_rows, 1);
}

// One SGD step of -1 on row 0 of t under `id`; true if applied (not a
// duplicate).
bool Step(WorkerService* s, const std::string& id) {
  ember::v1::WorkerApplyGradientsRequest r = UpdateOfT(id);
  auto* g = r.mutable_gradients(0);
  g->mutable_feature()->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{1}));
  g->mutable_feature()->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{0}));
  g->set_grad(wire::Encode<float>(std::vector<float>{1, 1, 1, 1}));
  ember::v1::WorkerApplyGradientsResponse resp;
  EXPECT_TRUE(s->ApplyGradients(nullptr, &r, &resp).ok());
  return !resp.duplicate();
}

TEST(WorkerServiceTest, RequestIdsAreRememberedForTheTimeWindowThenForgotten) {
  WorkerServiceOptions o;
  o.dedup_ttl = absl::Milliseconds(300);
  auto s = MakeService(o);
  EXPECT_TRUE(Step(s.get(), "x"));
  EXPECT_FALSE(Step(s.get(), "x"));  // a retry inside the window: applied once
  absl::SleepFor(absl::Milliseconds(400));
  EXPECT_TRUE(Step(s.get(), "y"));  // ages "x" out
  EXPECT_TRUE(Step(s.get(), "x"));
  EXPECT_EQ(Table(s.get(), "t")[0], -3.0f);  // three steps of lr 1 x grad 1
  ember::v1::ShardStatusRequest sreq;
  ember::v1::ShardStatusResponse st;
  ASSERT_TRUE(s->ShardStatus(nullptr, &sreq, &st).ok());
  EXPECT_EQ(st.dedup_forgotten_early(), 0);
}

TEST(WorkerServiceTest, TheMemoryBoundForgetsTheOldestEarlyAndSaysSo) {
  WorkerServiceOptions o;
  o.dedup_window = 2;
  auto s = MakeService(o);
  EXPECT_TRUE(Step(s.get(), "a"));
  EXPECT_TRUE(Step(s.get(), "b"));
  EXPECT_TRUE(Step(s.get(), "c"));  // "a" forgotten inside its window
  EXPECT_FALSE(Step(s.get(), "b"));
  EXPECT_TRUE(Step(s.get(), "a"));
  ember::v1::ShardStatusRequest sreq;
  ember::v1::ShardStatusResponse st;
  ASSERT_TRUE(s->ShardStatus(nullptr, &sreq, &st).ok());
  EXPECT_EQ(st.dedup_forgotten_early(), 2);  // "a", then "b" when "a" came again
}

// A region as a client makes one: shm_open, sized, mapped; unlinked when
// destroyed.
struct TestRegion {
  explicit TestRegion(size_t bytes) : size(bytes) {
    // pid, counter and a random part: test processes in sandboxes of their
    // own may share a pid, never /dev/shm.
    name = "/ember-test-" + std::to_string(getpid()) + "-" + std::to_string(counter++) + "-" +
           std::to_string(std::random_device()());
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, bytes), 0);
    base = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
  }
  ~TestRegion() {
    munmap(base, size);
    shm_unlink(name.c_str());
  }
  // Copies `v` to `at` and names it in `slice`.
  template <typename T>
  void Put(const std::vector<T>& v, uint64_t at, ember::v1::ShmSlice* slice) {
    std::memcpy(base + at, v.data(), v.size() * sizeof(T));
    slice->set_offset(at);
    slice->set_size(v.size() * sizeof(T));
  }
  static inline int counter = 0;
  std::string name;
  size_t size;
  char* base;
};

ember::v1::WorkerLookupRequest PooledLookup(int64_t epoch = 1) {
  ember::v1::WorkerLookupRequest req;
  req.set_collection("c");
  req.set_epoch(epoch);
  auto* f = req.add_features();
  f->mutable_shard()->set_table("t");
  f->set_pooling(TableConfig::SUM);
  return req;
}

// Table "t"'s pooled rows for bags of `ids` (`lengths`), looked up inline.
std::vector<float> InlineLookup(WorkerService* s, const std::vector<int64_t>& lengths,
                                const std::vector<int64_t>& ids) {
  ember::v1::WorkerLookupRequest req = PooledLookup();
  req.mutable_features(0)->set_lengths(wire::Encode<int64_t>(lengths));
  req.mutable_features(0)->set_ids(wire::Encode<int64_t>(ids));
  ember::v1::WorkerLookupResponse resp;
  std::vector<float> out;
  const grpc::Status st = s->Lookup(nullptr, &req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  if (st.ok()) {
    EXPECT_TRUE(wire::Decode(resp.outputs(0), "out", &out).ok());
  }
  return out;
}

// ShardStatus reports the lookups' time in the backend and in the whole
// handler: both grow with a lookup that succeeds, the handler's at least as
// much; a refused lookup adds no handler time.
TEST(WorkerServiceTest, StatusReportsBackendAndHandlerTime) {
  auto s = MakeService(false);
  auto status = [&] {
    ember::v1::ShardStatusRequest sreq;
    ember::v1::ShardStatusResponse st;
    EXPECT_TRUE(s->ShardStatus(nullptr, &sreq, &st).ok());
    return st;
  };
  const auto before = status();
  EXPECT_EQ(before.backend_lookup_ns(), 0);
  EXPECT_EQ(before.lookup_handler_ns(), 0);
  ember::v1::WorkerLookupRequest req = PooledLookup();
  req.mutable_features(0)->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{2, 1}));
  req.mutable_features(0)->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{0, 1, 3}));
  ember::v1::WorkerLookupResponse resp;
  ASSERT_TRUE(s->Lookup(nullptr, &req, &resp).ok());
  const auto after = status();
  EXPECT_GT(after.backend_lookup_ns(), 0);
  EXPECT_GE(after.lookup_handler_ns(), after.backend_lookup_ns());
  EXPECT_EQ(after.lookups(), 1);
  ember::v1::WorkerLookupRequest bad = req;
  bad.mutable_features(0)->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{0, 1, 99}));
  EXPECT_EQ(s->Lookup(nullptr, &bad, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status().lookup_handler_ns(), after.lookup_handler_ns());
}

// Traffic per table: the ids each table's shards served, counted only for
// calls that succeeded (the refused lookup and the duplicate update add
// nothing), with the collection and table that label the metrics.
TEST(WorkerServiceTest, TableStatsCountEachTablesIds) {
  auto s = MakeService(/*skip=*/true);
  InlineLookup(s.get(), {2, 1}, {0, 1, 3});
  InlineLookup(s.get(), {0, 1}, {2});
  ember::v1::WorkerLookupRequest bad = PooledLookup();
  bad.mutable_features(0)->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{1}));
  bad.mutable_features(0)->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{99}));
  ember::v1::WorkerLookupResponse resp;
  EXPECT_FALSE(s->Lookup(nullptr, &bad, &resp).ok());
  // Update(): t keeps ids 1 of {0, 1, 2} (NaN row, Inf weight left out), s
  // keeps id 3 of {0, 3}; applied once, then answered as a duplicate.
  ember::v1::WorkerApplyGradientsResponse gresp;
  const ember::v1::WorkerApplyGradientsRequest first = Update("u1");
  ASSERT_TRUE(s->ApplyGradients(nullptr, &first, &gresp).ok());
  const ember::v1::WorkerApplyGradientsRequest again = Update("u1");
  ASSERT_TRUE(s->ApplyGradients(nullptr, &again, &gresp).ok());
  EXPECT_TRUE(gresp.duplicate());
  std::map<std::string, WorkerService::TableStats> by_table;
  for (const auto& t : s->GetTableStats()) by_table[t.table] = t;
  ASSERT_EQ(by_table.size(), 2u);
  EXPECT_EQ(by_table["t"].collection, "c");
  EXPECT_EQ(by_table["t"].shards, 1);
  EXPECT_EQ(by_table["t"].lookup_ids, 4);
  EXPECT_EQ(by_table["t"].gradient_ids, 1);
  EXPECT_EQ(by_table["s"].lookup_ids, 0);
  EXPECT_EQ(by_table["s"].gradient_ids, 1);
}

// A prefetch (WorkerLookupRequest.prefetch) over a key_value table of 100
// rows caching 10 and a table in memory: the answer counts the rows brought
// in (the key_value table's distinct ones, none of the other's) and has no
// outputs; the lookup after it fills nothing; it is not counted as a
// lookup. A channel, a step or a bad id is refused, nothing brought in.
TEST(WorkerServiceTest, PrefetchFillsCachesAndAnswersACount) {
  const std::string dir = std::getenv("TEST_TMPDIR") != nullptr ? std::getenv("TEST_TMPDIR") : "/tmp";
  backend::KeyValueOptions kv;
  kv.dir = dir;
  auto cpu = backend::CreateCpuBackend(backend::CpuBackendOptions());
  ASSERT_TRUE(cpu.ok());
  WorkerServiceOptions so;
  so.ssd_tier = true;
  so.key_value_min_cache_rows = 1;
  WorkerService s(backend::WithKeyValueShards(std::move(*cpu), kv), so);
  ember::v1::CreateShardsRequest create;
  create.set_collection("c");
  create.set_epoch(1);
  ember::v1::ShardAssignment cached = Assignment("t", 100);
  cached.set_compute_kernel("key_value");
  cached.set_cache_load_factor(0.1);
  *create.add_shards() = cached;
  *create.add_shards() = Assignment("m", 8);
  ember::v1::CreateShardsResponse cr;
  ASSERT_TRUE(s.CreateShards(nullptr, &create, &cr).ok());

  auto feature = [](ember::v1::WorkerLookupRequest* r, const std::string& table,
                    const std::vector<int64_t>& ids) {
    auto* f = r->add_features();
    f->mutable_shard()->set_table(table);
    f->set_pooling(TableConfig::SUM);
    f->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>(ids.size(), 1)));
    f->set_ids(wire::Encode<int64_t>(ids));
  };
  ember::v1::WorkerLookupRequest pre;
  pre.set_collection("c");
  pre.set_epoch(1);
  pre.set_prefetch(true);
  feature(&pre, "t", {5, 6, 5, 70});
  feature(&pre, "m", {1, 2});
  ember::v1::WorkerLookupResponse resp;
  grpc::Status st = s.Lookup(nullptr, &pre, &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(resp.prefetched_rows(), 3);
  EXPECT_EQ(resp.outputs_size(), 0);
  const WorkerService::Stats after_prefetch = s.GetStats();
  EXPECT_EQ(after_prefetch.prefetches, 1);
  EXPECT_EQ(after_prefetch.prefetch_ids, 6);
  EXPECT_EQ(after_prefetch.lookups, 0);
  auto tier = [&s] {
    for (const auto& t : s.GetTableStats()) {
      if (t.table == "t") return t.tier;
    }
    return backend::TierStats();
  };
  EXPECT_EQ(tier().fills, 3);
  EXPECT_EQ(tier().prefetched, 3);
  ember::v1::WorkerLookupRequest look;
  look.set_collection("c");
  look.set_epoch(1);
  feature(&look, "t", {5, 6, 70});
  ASSERT_TRUE(s.Lookup(nullptr, &look, &resp).ok());
  EXPECT_EQ(tier().fills, 3);
  EXPECT_EQ(tier().hits, 3);

  // Refused, nothing brought in.
  ember::v1::WorkerLookupRequest bad = pre;
  bad.set_channel_id(7);
  EXPECT_EQ(s.Lookup(nullptr, &bad, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad = pre;
  bad.set_step(3);
  EXPECT_EQ(s.Lookup(nullptr, &bad, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad = pre;
  bad.clear_features();
  feature(&bad, "t", {80, 81});
  feature(&bad, "m", {8});
  st = s.Lookup(nullptr, &bad, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  bad.clear_features();
  feature(&bad, "t", {100});
  EXPECT_EQ(s.Lookup(nullptr, &bad, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(tier().fills, 3);
  EXPECT_EQ(s.GetStats().prefetches, 1);
}

// Lookups and updates through a shared-memory channel give what the same
// calls inline give; every malformed use of a channel is refused with
// INVALID_ARGUMENT (UNAVAILABLE for an unknown channel) and applies
// nothing.
TEST(WorkerServiceTest, SharedMemoryChannelsServeLikeInlineAndRefuseMisuse) {
  auto s = MakeService(false);
  TestRegion region(1 << 16);
  ember::v1::OpenChannelRequest open;
  ember::v1::OpenChannelResponse opened;
  for (const std::string bad : {"/etc-passwd", "/ember-x/y", "ember-x"}) {
    open.set_shm_name(bad);
    open.set_size(1 << 16);
    EXPECT_EQ(s->OpenChannel(nullptr, &open, &opened).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT) << bad;
  }
  open.set_shm_name("/ember-does-not-exist-" + std::to_string(getpid()));
  EXPECT_EQ(s->OpenChannel(nullptr, &open, &opened).error_code(), grpc::StatusCode::NOT_FOUND);
  open.set_shm_name(region.name);
  open.set_size(100);  // under 4 KiB
  EXPECT_EQ(s->OpenChannel(nullptr, &open, &opened).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  open.set_size(1 << 20);  // more than the region holds
  EXPECT_EQ(s->OpenChannel(nullptr, &open, &opened).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  open.set_size(1 << 16);
  ASSERT_TRUE(s->OpenChannel(nullptr, &open, &opened).ok());
  EXPECT_NE(opened.channel_id(), 0u);
  EXPECT_EQ(s->open_channels(), 1);
  EXPECT_FALSE(opened.reads_id_buffers()) << "a named region says nothing of the client's memfds";

  // Inline, then the same through the channel: bags {0, 1} and {3}.
  const std::vector<int64_t> lengths = {2, 1}, ids = {0, 1, 3};
  const std::vector<float> want = InlineLookup(s.get(), lengths, ids);
  ASSERT_EQ(want.size(), 8u);

  ember::v1::WorkerLookupRequest req = PooledLookup();
  req.set_channel_id(opened.channel_id());
  uint64_t seq = 0;  // transfers through the channel so far
  req.set_channel_seq(++seq);
  region.Put(lengths, 0, req.mutable_features(0)->mutable_shm_lengths());
  region.Put(ids, 64, req.mutable_features(0)->mutable_shm_ids());
  auto* out = req.add_shm_outputs();
  out->set_offset(1024);
  out->set_size(8 * 4);
  ember::v1::WorkerLookupResponse resp;
  ASSERT_TRUE(s->Lookup(nullptr, &req, &resp).ok());
  EXPECT_EQ(resp.outputs_size(), 0);
  std::vector<float> got(8);
  std::memcpy(got.data(), region.base + 1024, 32);
  EXPECT_EQ(got, want);

  // Misuse, each refused.
  auto refused = [&](ember::v1::WorkerLookupRequest r, grpc::StatusCode code,
                     const std::string& why) {
    if (r.channel_seq() == req.channel_seq()) r.set_channel_seq(++seq);  // a fresh transfer
    ember::v1::WorkerLookupResponse rr;
    const grpc::Status st = s->Lookup(nullptr, &r, &rr);
    EXPECT_EQ(st.error_code(), code) << why << ": " << st.error_message();
    EXPECT_NE(st.error_message().find(why), std::string::npos) << st.error_message();
  };
  ember::v1::WorkerLookupRequest r = req;
  r.set_channel_id(opened.channel_id() + 1);
  refused(r, grpc::StatusCode::UNAVAILABLE, "no shared-memory channel");
  r = req;
  r.mutable_features(0)->mutable_shm_ids()->set_offset((1 << 16) - 8);
  refused(r, grpc::StatusCode::INVALID_ARGUMENT, "outside the shared region");
  r = req;
  r.mutable_features(0)->mutable_shm_ids()->set_offset(66);
  refused(r, grpc::StatusCode::INVALID_ARGUMENT, "multiples of 8");
  r = req;
  r.mutable_shm_outputs(0)->set_size(16);
  refused(r, grpc::StatusCode::INVALID_ARGUMENT, "the output is 32");
  r = req;
  r.clear_shm_outputs();
  refused(r, grpc::StatusCode::INVALID_ARGUMENT, "0 output slice(s)");
  r = req;
  r.mutable_features(0)->set_ids(wire::Encode<int64_t>(ids));
  refused(r, grpc::StatusCode::INVALID_ARGUMENT, "both inline and in the channel");
  r = req;
  r.set_channel_id(0);
  refused(r, grpc::StatusCode::INVALID_ARGUMENT, "without a channel");
  r = req;  // a stale control message: an earlier transfer's number
  r.set_channel_seq(seq - 1);
  refused(r, grpc::StatusCode::INVALID_ARGUMENT, "out of order");
  r = req;  // ids out of the shard's range: checked after the copy
  const std::vector<int64_t> far = {0, 1, 99};
  region.Put(far, 128, r.mutable_features(0)->mutable_shm_ids());
  refused(r, grpc::StatusCode::INVALID_ARGUMENT, "");

  // Updates: through the channel as inline; a refused one applies nothing.
  const std::vector<float> before = Table(s.get(), "t");
  ember::v1::WorkerApplyGradientsRequest up = UpdateOfT("shm-1");
  up.set_channel_id(opened.channel_id());
  up.set_channel_seq(++seq);
  auto* g = up.mutable_gradients(0);
  region.Put(lengths, 0, g->mutable_feature()->mutable_shm_lengths());
  region.Put(ids, 64, g->mutable_feature()->mutable_shm_ids());
  region.Put(std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}, 2048, g->mutable_shm_grad());
  ember::v1::WorkerApplyGradientsRequest bad = up;
  bad.mutable_gradients(0)->mutable_shm_grad()->set_offset(1 << 20);
  ember::v1::WorkerApplyGradientsResponse ur;
  EXPECT_EQ(s->ApplyGradients(nullptr, &bad, &ur).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Table(s.get(), "t"), before);
  // That transfer's number is spent: the same control message again (a
  // replay: its slices may name bytes a later call has rewritten) is
  // refused before anything is read.
  bad = up;
  bad.set_request_id("shm-replayed");
  const grpc::Status replay = s->ApplyGradients(nullptr, &bad, &ur);
  EXPECT_EQ(replay.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(replay.error_message().find("out of order"), std::string::npos)
      << replay.error_message();
  EXPECT_EQ(Table(s.get(), "t"), before);
  up.set_channel_seq(++seq);
  ASSERT_TRUE(s->ApplyGradients(nullptr, &up, &ur).ok());
  // SGD at rate 1 (MakeService): rows 0 and 1 minus [1,2,3,4], row 3 minus
  // [5,6,7,8], from zero.
  const std::vector<float> after = Table(s.get(), "t");
  EXPECT_EQ(std::vector<float>(after.begin(), after.begin() + 4), (std::vector<float>{-1, -2, -3, -4}));
  EXPECT_EQ(std::vector<float>(after.begin() + 4, after.begin() + 8), (std::vector<float>{-1, -2, -3, -4}));
  EXPECT_EQ(std::vector<float>(after.begin() + 12, after.begin() + 16), (std::vector<float>{-5, -6, -7, -8}));
  up.set_channel_seq(++seq);  // a retry is a new transfer of the same request
  EXPECT_TRUE(s->ApplyGradients(nullptr, &up, &ur).ok());  // exactly once
  EXPECT_TRUE(ur.duplicate());

  ember::v1::CloseChannelRequest close;
  close.set_channel_id(opened.channel_id());
  ember::v1::CloseChannelResponse closed;
  EXPECT_TRUE(s->CloseChannel(nullptr, &close, &closed).ok());
  EXPECT_EQ(s->open_channels(), 0);
  EXPECT_EQ(s->CloseChannel(nullptr, &close, &closed).error_code(), grpc::StatusCode::NOT_FOUND);
  refused(req, grpc::StatusCode::UNAVAILABLE, "no shared-memory channel");
}

// A client shared buffer as client/shared_buffer.cc makes one: a memfd
// named "ember-buffer" (or `name`), sealed against shrinking (unless not
// `sealed`), its first 8 bytes the nonce. Every float starts at -1.
struct TestSharedBuffer {
  explicit TestSharedBuffer(size_t bytes, bool sealed = true, const char* name = "ember-buffer")
      : size(bytes) {
    fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, bytes), 0);
    if (sealed) {
      EXPECT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    }
    base = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    std::fill_n(reinterpret_cast<float*>(base), bytes / 4, -1.0f);
    nonce = 0x5eed0000u + static_cast<uint64_t>(fd);
    std::memcpy(base, &nonce, sizeof(nonce));
  }
  ~TestSharedBuffer() {
    munmap(base, size);
    close(fd);
  }
  ember::v1::SharedBuffer Proto(uint64_t id) const {
    ember::v1::SharedBuffer b;
    b.set_id(id);
    b.set_pid(getpid());
    b.set_fd(fd);
    b.set_size(size);
    b.set_nonce(nonce);
    return b;
  }
  const float* at(uint64_t byte) const { return reinterpret_cast<const float*>(base + byte); }
  ino_t inode() const {
    struct stat st;
    EXPECT_EQ(fstat(fd, &st), 0);
    return st.st_ino;
  }
  int fd;
  size_t size;
  char* base;
  uint64_t nonce;
};

// Mappings of output memfds in this process.
int OutputMappings() {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("memfd:ember-buffer") != std::string::npos) ++n;
  }
  return n;
}

// With the client's output buffer named, a lookup through a channel writes
// its placed rows straight there (at the placement's offset and stride,
// nothing between the rows touched, the channel's slice left alone); a
// buffer the worker cannot trust (no seal, another memfd, other bytes than
// the nonce, no such descriptor) is not mapped and the outputs go to the
// slice as without one; a placement outside the buffer or narrower than a
// row is refused. Mappings are bounded per channel and go with it. A
// backend of packed outputs only gets them placed too (the worker moves
// the rows).
void PlacedOutputs(bool packed_only) {
  auto s = MakeService(WorkerServiceOptions(), packed_only);
  TestRegion region(1 << 16);
  ember::v1::OpenChannelRequest open;
  open.set_shm_name(region.name);
  open.set_size(1 << 16);
  ember::v1::OpenChannelResponse opened;
  ASSERT_TRUE(s->OpenChannel(nullptr, &open, &opened).ok());
  const std::vector<int64_t> lengths = {2, 1}, ids = {0, 1, 3};
  // Rows made non-zero first (the table starts at zero): SGD at rate 1.
  ember::v1::WorkerApplyGradientsRequest up = UpdateOfT("nonzero");
  auto* g = up.mutable_gradients(0);
  g->mutable_feature()->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{1, 1, 1}));
  g->mutable_feature()->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{0, 1, 3}));
  g->set_grad(wire::Encode<float>(std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}));
  ember::v1::WorkerApplyGradientsResponse ur;
  ASSERT_TRUE(s->ApplyGradients(nullptr, &up, &ur).ok());
  const std::vector<float> want = InlineLookup(s.get(), lengths, ids);
  // Bag {0, 1}: -(1..4) - (5..8); bag {3}: -(9..12). By hand.
  ASSERT_EQ(want, (std::vector<float>{-6, -8, -10, -12, -9, -10, -11, -12}));

  uint64_t seq = 0;
  ember::v1::WorkerLookupRequest req = PooledLookup();
  req.set_channel_id(opened.channel_id());
  region.Put(lengths, 0, req.mutable_features(0)->mutable_shm_lengths());
  region.Put(ids, 64, req.mutable_features(0)->mutable_shm_ids());
  auto* slice = req.add_shm_outputs();
  slice->set_offset(1024);
  slice->set_size(8 * 4);
  const int own = OutputMappings();
  TestSharedBuffer buf(3 * 4096);
  ASSERT_EQ(OutputMappings(), own + 1);
  *req.mutable_out_buffer() = buf.Proto(1);
  auto* p = req.add_placements();
  p->set_offset(4096 + 8);  // rows 10 floats apart
  p->set_row_stride(10);

  // Placed: rows at 4104 and 4144, the 6 floats between and after untouched.
  auto lookup = [&](const ember::v1::WorkerLookupRequest& r, ember::v1::WorkerLookupResponse* resp) {
    std::fill_n(reinterpret_cast<float*>(region.base + 1024), 8, -1.0f);
    ember::v1::WorkerLookupRequest sent = r;
    sent.set_channel_seq(++seq);
    return s->Lookup(nullptr, &sent, resp);
  };
  auto slice_holds = [&](const std::vector<float>& v) {
    return std::vector<float>(reinterpret_cast<const float*>(region.base + 1024),
                              reinterpret_cast<const float*>(region.base + 1024) + 8) == v;
  };
  const int64_t placed_before = s->GetStats().placed_lookups;
  ember::v1::WorkerLookupResponse resp;
  ASSERT_TRUE(lookup(req, &resp).ok());
  EXPECT_TRUE(resp.placed());
  EXPECT_EQ(std::vector<float>(buf.at(4104), buf.at(4104) + 4),
            std::vector<float>(want.begin(), want.begin() + 4));
  EXPECT_EQ(std::vector<float>(buf.at(4144), buf.at(4144) + 4),
            std::vector<float>(want.begin() + 4, want.end()));
  EXPECT_EQ(std::vector<float>(buf.at(4120), buf.at(4144)), std::vector<float>(6, -1.0f));
  EXPECT_EQ(*buf.at(4160), -1.0f);
  EXPECT_EQ(*buf.at(4100), -1.0f);
  if (!packed_only) {  // (a packed backend pools into the slice first)
    EXPECT_TRUE(slice_holds(std::vector<float>(8, -1.0f))) << "the slice was written too";
  }
  EXPECT_EQ(s->GetStats().placed_lookups, placed_before + 1);
  EXPECT_EQ(OutputMappings(), own + 2);  // the worker's mapping
  // Again: the mapping is reused, not made twice.
  ASSERT_TRUE(lookup(req, &resp).ok());
  EXPECT_TRUE(resp.placed());
  EXPECT_EQ(OutputMappings(), own + 2);

  // Buffers the worker does not map: served through the slice.
  TestSharedBuffer unsealed(3 * 4096, /*sealed=*/false);
  TestSharedBuffer other_name(3 * 4096, true, "not-ember");
  std::vector<std::pair<std::string, ember::v1::SharedBuffer>> untrusted = {
      {"unsealed", unsealed.Proto(2)}, {"another memfd", other_name.Proto(3)}};
  untrusted.push_back({"wrong nonce", buf.Proto(4)});
  untrusted.back().second.set_nonce(buf.nonce + 1);
  untrusted.push_back({"no such descriptor", buf.Proto(5)});
  untrusted.back().second.set_fd(999999);
  untrusted.push_back({"larger than the file", buf.Proto(6)});
  untrusted.back().second.set_size(buf.size * 2);
  untrusted.push_back({"a pipe", buf.Proto(7)});
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  untrusted.back().second.set_fd(pipe_fds[0]);
  for (const auto& [why, b] : untrusted) {
    ember::v1::WorkerLookupRequest r = req;
    *r.mutable_out_buffer() = b;
    ASSERT_TRUE(lookup(r, &resp).ok()) << why;
    EXPECT_FALSE(resp.placed()) << why;
    EXPECT_TRUE(slice_holds(want)) << why;
  }
  close(pipe_fds[0]);
  close(pipe_fds[1]);

  // Malformed placements: refused.
  auto refused = [&](const ember::v1::WorkerLookupRequest& r, const std::string& why) {
    const grpc::Status st = lookup(r, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << why << ": " << st.error_message();
    EXPECT_NE(st.error_message().find(why), std::string::npos) << st.error_message();
  };
  ember::v1::WorkerLookupRequest r = req;
  r.mutable_placements(0)->set_row_stride(3);
  refused(r, "row stride 3");
  r = req;
  r.mutable_placements(0)->set_row_stride(uint64_t{1} << 40);
  refused(r, "row stride");
  r = req;
  r.mutable_placements(0)->set_offset(3 * 4096 - 40);  // the second row past the end
  refused(r, "outside");
  r = req;
  r.mutable_placements(0)->set_offset(4098);
  refused(r, "multiples of 4");
  r = req;
  r.mutable_placements(0)->set_offset(8);  // over the nonce
  refused(r, "header");
  r = req;
  r.add_placements();
  refused(r, "2 placement(s)");
  r = PooledLookup();  // inline
  r.mutable_features(0)->set_lengths(wire::Encode<int64_t>(lengths));
  r.mutable_features(0)->set_ids(wire::Encode<int64_t>(ids));
  *r.mutable_out_buffer() = buf.Proto(1);
  r.add_placements()->set_row_stride(4);
  const grpc::Status no_channel = s->Lookup(nullptr, &r, &resp);
  EXPECT_EQ(no_channel.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(no_channel.error_message().find("without a channel"), std::string::npos);
  // A placement of row stride 0 is not placed: that output goes to its slice.
  r = req;
  r.mutable_placements(0)->set_row_stride(0);
  ASSERT_TRUE(lookup(r, &resp).ok());
  EXPECT_TRUE(slice_holds(want));

  // At most kMaxBuffers buffers mapped per channel; none once it closes.
  std::vector<std::unique_ptr<TestSharedBuffer>> many;
  for (int i = 0; i < ShmChannels::kMaxBuffers + 3; ++i) {
    many.push_back(std::make_unique<TestSharedBuffer>(2 * 4096));
    r = req;
    *r.mutable_out_buffer() = many.back()->Proto(100 + i);
    ASSERT_TRUE(lookup(r, &resp).ok());
    EXPECT_TRUE(resp.placed());
  }
  const int mine = own + 2 + static_cast<int>(many.size());  // buf, unsealed, many
  EXPECT_EQ(OutputMappings(), mine + ShmChannels::kMaxBuffers);
  // A buffer the client closes is unmapped at the worker's next call (not
  // when the LRU gets to it: it is the most recently used).
  const std::string gone = " " + std::to_string(many.back()->inode()) + " ";
  many.pop_back();
  ASSERT_TRUE(lookup(req, &resp).ok());
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    EXPECT_EQ(line.find(gone), std::string::npos) << "still mapped: " << line;
  }
  ember::v1::CloseChannelRequest close_req;
  close_req.set_channel_id(opened.channel_id());
  ember::v1::CloseChannelResponse closed;
  ASSERT_TRUE(s->CloseChannel(nullptr, &close_req, &closed).ok());
  EXPECT_EQ(OutputMappings(), mine - 1) << "a closed channel's output buffers stayed mapped";
}

TEST(WorkerServiceTest, OutputsArePlacedInTheClientsBufferOrGoThroughTheChannel) {
  PlacedOutputs(/*packed_only=*/false);
}

TEST(WorkerServiceTest, PackedOutputBackendsGetTheirOutputsPlacedToo) {
  PlacedOutputs(/*packed_only=*/true);
}

// A lookup through a channel reads its ids in place when the backend checks
// them as it gathers (the CPU backend), and a copy otherwise: a client that
// rewrites an id in its region after sending the call changes the rows the
// first one reads, not the second. An id rewritten out of range is refused
// (INVALID_ARGUMENT), never read.
// Sets row r of table "t" (MakeService) to r + 1 in every column: SGD at
// rate 1 from 0.
void NumberRows(WorkerService* s) {
  ember::v1::WorkerApplyGradientsRequest up = UpdateOfT("rows");
  auto* g = up.mutable_gradients(0);
  g->mutable_feature()->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{1, 1, 1, 1}));
  g->mutable_feature()->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{0, 1, 2, 3}));
  std::vector<float> grad;
  for (int r = 0; r < 4; ++r) grad.insert(grad.end(), 4, -(r + 1.0f));
  g->set_grad(wire::Encode<float>(grad));
  ember::v1::WorkerApplyGradientsResponse ur;
  ASSERT_TRUE(s->ApplyGradients(nullptr, &up, &ur).ok());
}

void IdsRewrittenDuringALookup(bool packed_only) {
  TestRegion region(1 << 16);
  int64_t rewrite = -1;  // the value the "client" writes over ids[2]; -1: none
  auto s = MakeService(WorkerServiceOptions(), packed_only, [&] {
    if (rewrite >= 0) std::memcpy(region.base + 64 + 2 * 8, &rewrite, 8);
  });
  NumberRows(s.get());

  ember::v1::OpenChannelRequest open;
  open.set_shm_name(region.name);
  open.set_size(1 << 16);
  ember::v1::OpenChannelResponse opened;
  ASSERT_TRUE(s->OpenChannel(nullptr, &open, &opened).ok());
  uint64_t seq = 0;
  // Bags {0, 1} and {3}, as sent.
  auto lookup = [&](int64_t rewritten, std::vector<float>* got) {
    ember::v1::WorkerLookupRequest req = PooledLookup();
    req.set_channel_id(opened.channel_id());
    req.set_channel_seq(++seq);
    region.Put(std::vector<int64_t>{2, 1}, 0, req.mutable_features(0)->mutable_shm_lengths());
    region.Put(std::vector<int64_t>{0, 1, 3}, 64, req.mutable_features(0)->mutable_shm_ids());
    auto* out = req.add_shm_outputs();
    out->set_offset(1024);
    out->set_size(8 * 4);
    rewrite = rewritten;
    ember::v1::WorkerLookupResponse resp;
    const grpc::Status st = s->Lookup(nullptr, &req, &resp);
    got->assign(8, 0.0f);
    std::memcpy(got->data(), region.base + 1024, 32);
    return st;
  };
  const std::vector<float> first_bag(4, 1.0f + 2.0f);
  auto bags = [&](float second) {
    std::vector<float> want = first_bag;
    want.insert(want.end(), 4, second);
    return want;
  };
  std::vector<float> got;
  ASSERT_TRUE(lookup(-1, &got).ok());
  EXPECT_EQ(got, bags(4.0f));
  // Rewritten to row 2 (value 3) during the call.
  ASSERT_TRUE(lookup(2, &got).ok());
  EXPECT_EQ(got, bags(packed_only ? 4.0f : 3.0f)) << (packed_only ? "copied" : "in place");
  // Rewritten out of range: the copy never sees it; read in place, it is
  // refused.
  const grpc::Status st = lookup(int64_t{1} << 40, &got);
  if (packed_only) {
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(got, bags(4.0f));
  } else {
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find("1099511627776"), std::string::npos) << st.error_message();
  }
}

// A lookup's ids in the client's id buffer (its KeyedJaggedTensor): the
// worker maps the buffer and reads them there (in place with the CPU
// backend, copied out for one that checks ids first), giving what the same
// ids through the channel give. Misuse is refused with nothing applied; a
// buffer the worker cannot map is refused with kIdBufferRefused, the
// client's cue to send the ids through the channel.
void IdsFromTheClientsBuffer(bool packed_only) {
  auto s = MakeService(WorkerServiceOptions(), packed_only);
  NumberRows(s.get());
  TestRegion region(1 << 16);
  ember::v1::OpenChannelRequest open;
  open.set_shm_name(region.name);
  open.set_size(1 << 16);
  ember::v1::OpenChannelResponse opened;
  ASSERT_TRUE(s->OpenChannel(nullptr, &open, &opened).ok());
  TestSharedBuffer ids(1 << 14);
  const std::vector<int64_t> sent = {0, 1, 3};  // bags {0, 1} and {3}
  std::memcpy(ids.base + 4096, sent.data(), 24);
  uint64_t seq = 0;
  ember::v1::WorkerLookupRequest req = PooledLookup();
  req.set_channel_id(opened.channel_id());
  region.Put(std::vector<int64_t>{2, 1}, 0, req.mutable_features(0)->mutable_shm_lengths());
  req.mutable_features(0)->mutable_buffer_ids()->set_offset(4096);
  req.mutable_features(0)->mutable_buffer_ids()->set_size(24);
  *req.mutable_id_buffer() = ids.Proto(9);
  auto* out = req.add_shm_outputs();
  out->set_offset(1024);
  out->set_size(8 * 4);
  auto call = [&](ember::v1::WorkerLookupRequest r) {
    r.set_channel_seq(++seq);
    std::fill_n(reinterpret_cast<float*>(region.base + 1024), 8, -1.0f);
    ember::v1::WorkerLookupResponse resp;
    return s->Lookup(nullptr, &r, &resp);
  };
  const int64_t before = s->GetStats().id_buffer_lookups;
  const grpc::Status ok = call(req);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  std::vector<float> got(8);
  std::memcpy(got.data(), region.base + 1024, 32);
  EXPECT_EQ(got, (std::vector<float>{3, 3, 3, 3, 4, 4, 4, 4}));
  EXPECT_EQ(s->GetStats().id_buffer_lookups, before + 1);

  auto refused = [&](const ember::v1::WorkerLookupRequest& r, grpc::StatusCode code,
                     const std::string& why) {
    const grpc::Status st = call(r);
    EXPECT_EQ(st.error_code(), code) << why << ": " << st.error_message();
    EXPECT_NE(st.error_message().find(why), std::string::npos) << st.error_message();
  };
  ember::v1::WorkerLookupRequest r = req;
  r.mutable_features(0)->mutable_buffer_ids()->set_offset(0);
  refused(r, grpc::StatusCode::INVALID_ARGUMENT, "in its header");
  r = req;
  r.mutable_features(0)->mutable_buffer_ids()->set_offset((1 << 14) - 16);
  refused(r, grpc::StatusCode::INVALID_ARGUMENT, "outside");
  r = req;
  region.Put(sent, 64, r.mutable_features(0)->mutable_shm_ids());
  refused(r, grpc::StatusCode::INVALID_ARGUMENT, "ids given twice");
  r = req;
  r.clear_id_buffer();
  refused(r, grpc::StatusCode::INVALID_ARGUMENT, "only a lookup through a channel");
  r = req;
  r.set_channel_id(0);
  refused(r, grpc::StatusCode::INVALID_ARGUMENT, "without a channel");
  // An id out of range in the buffer: named.
  const int64_t far = 99;
  std::memcpy(ids.base + 4096 + 16, &far, 8);
  refused(req, grpc::StatusCode::INVALID_ARGUMENT, "99");
  std::memcpy(ids.base + 4096, sent.data(), 24);
  // Not the client's buffer (unsealed, or another name): refused so that
  // the client sends the ids instead.
  TestSharedBuffer unsealed(1 << 14, /*sealed=*/false);
  r = req;
  *r.mutable_id_buffer() = unsealed.Proto(10);
  refused(r, grpc::StatusCode::FAILED_PRECONDITION, kIdBufferRefused);
  EXPECT_TRUE(HasSignal(call(r), kSignalIdBufferRefused));  // what the client acts on
  TestSharedBuffer other(1 << 14, true, "ember-channel");
  *r.mutable_id_buffer() = other.Proto(11);
  refused(r, grpc::StatusCode::FAILED_PRECONDITION, kIdBufferRefused);
  // Other refusals carry no signal.
  r = req;
  r.mutable_features(0)->mutable_buffer_ids()->set_offset(0);
  EXPECT_FALSE(HasSignal(call(r), kSignalIdBufferRefused));
  EXPECT_EQ(s->GetStats().id_buffer_lookups, before + 1);

  // Updates never take ids from a buffer; nothing is applied.
  const std::vector<float> rows = Table(s.get(), "t");
  ember::v1::WorkerApplyGradientsRequest up = UpdateOfT("from-buffer");
  up.set_channel_id(opened.channel_id());
  up.set_channel_seq(++seq);
  auto* g = up.mutable_gradients(0);
  region.Put(std::vector<int64_t>{2, 1}, 0, g->mutable_feature()->mutable_shm_lengths());
  g->mutable_feature()->mutable_buffer_ids()->set_offset(4096);
  g->mutable_feature()->mutable_buffer_ids()->set_size(24);
  region.Put(std::vector<float>(8, 1.0f), 2048, g->mutable_shm_grad());
  ember::v1::WorkerApplyGradientsResponse ur;
  EXPECT_EQ(s->ApplyGradients(nullptr, &up, &ur).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Table(s.get(), "t"), rows);
}

TEST(WorkerServiceTest, LookupIdsAreReadFromTheClientsBuffer) {
  IdsFromTheClientsBuffer(/*packed_only=*/false);
}

TEST(WorkerServiceTest, LookupIdsAreCopiedFromTheClientsBufferForABackendThatChecksFirst) {
  IdsFromTheClientsBuffer(/*packed_only=*/true);
}

TEST(WorkerServiceTest, LookupIdsAreReadInPlaceWhenTheBackendChecksThemAsItGathers) {
  IdsRewrittenDuringALookup(/*packed_only=*/false);
}

TEST(WorkerServiceTest, LookupIdsAreCopiedForABackendThatChecksThemFirst) {
  IdsRewrittenDuringALookup(/*packed_only=*/true);
}

// A channel's region handed over as a memfd (the client's first choice on
// the worker's host) is opened through /proc only when it is a memfd named
// "ember-channel", sealed against shrinking (no SIGBUS, whatever the client
// does later), holding the nonce; it then serves like a named one.
TEST(WorkerServiceTest, ChannelsOverAMemfdMustBeSealedAndTheClients) {
  auto s = MakeService(false);
  auto open_of = [](const TestSharedBuffer& m) {
    ember::v1::OpenChannelRequest req;
    req.set_pid(getpid());
    req.set_memfd(m.fd);
    req.set_size(m.size);
    req.set_nonce(m.nonce);
    return req;
  };
  auto refused = [&](const ember::v1::OpenChannelRequest& req, grpc::StatusCode code,
                     const std::string& why) {
    ember::v1::OpenChannelResponse resp;
    const grpc::Status st = s->OpenChannel(nullptr, &req, &resp);
    EXPECT_EQ(st.error_code(), code) << why << ": " << st.error_message();
    EXPECT_NE(st.error_message().find(why), std::string::npos) << st.error_message();
  };
  TestSharedBuffer good(1 << 16, true, "ember-channel");
  TestSharedBuffer unsealed(1 << 16, false, "ember-channel");
  TestSharedBuffer other(1 << 16, true, "ember-buffer");
  refused(open_of(unsealed), grpc::StatusCode::FAILED_PRECONDITION, "sealed against shrinking");
  refused(open_of(other), grpc::StatusCode::FAILED_PRECONDITION, "not a memfd named ember-channel");
  ember::v1::OpenChannelRequest r = open_of(good);
  r.set_nonce(good.nonce + 1);
  refused(r, grpc::StatusCode::FAILED_PRECONDITION, "nonce");
  r = open_of(good);
  r.set_memfd(999999);
  refused(r, grpc::StatusCode::FAILED_PRECONDITION, "cannot be opened");
  r = open_of(good);
  r.set_size(good.size * 2);
  refused(r, grpc::StatusCode::FAILED_PRECONDITION, "at least");
  r = open_of(good);
  r.set_shm_name("/ember-x");
  refused(r, grpc::StatusCode::INVALID_ARGUMENT, "exactly one");
  EXPECT_EQ(s->open_channels(), 0);

  ember::v1::OpenChannelResponse opened;
  const ember::v1::OpenChannelRequest open = open_of(good);
  ASSERT_TRUE(s->OpenChannel(nullptr, &open, &opened).ok());
  EXPECT_EQ(s->open_channels(), 1);
  EXPECT_TRUE(opened.reads_id_buffers()) << "a memfd channel: the client's buffers open alike";
  // A lookup through it, as through a named region.
  const std::vector<int64_t> lengths = {2, 1}, ids = {0, 1, 3};
  ember::v1::WorkerLookupRequest req = PooledLookup();
  req.set_channel_id(opened.channel_id());
  req.set_channel_seq(1);
  auto put = [&](const std::vector<int64_t>& v, uint64_t at, ember::v1::ShmSlice* slice) {
    std::memcpy(good.base + at, v.data(), v.size() * 8);
    slice->set_offset(at);
    slice->set_size(v.size() * 8);
  };
  put(lengths, 64, req.mutable_features(0)->mutable_shm_lengths());
  put(ids, 128, req.mutable_features(0)->mutable_shm_ids());
  auto* out = req.add_shm_outputs();
  out->set_offset(1024);
  out->set_size(8 * 4);
  std::fill_n(reinterpret_cast<float*>(good.base + 1024), 8, -1.0f);
  ember::v1::WorkerLookupResponse resp;
  ASSERT_TRUE(s->Lookup(nullptr, &req, &resp).ok());
  EXPECT_EQ(std::vector<float>(good.at(1024), good.at(1024) + 8),
            InlineLookup(s.get(), lengths, ids));
}

// An OpenChannelRequest for a POSIX name or (file) a shm_dir file.
ember::v1::OpenChannelRequest OpenOf(const std::string& name, uint64_t size, bool file = false,
                                      uint64_t nonce = 0) {
  ember::v1::OpenChannelRequest req;
  if (file) {
    req.set_shm_file(name);
  } else {
    req.set_shm_name(name);
  }
  req.set_size(size);
  req.set_nonce(nonce);
  return req;
}

// Channels belong to who opened them and lapse when idle.
TEST(WorkerServiceTest, ChannelsHaveOwnersAndLapseWhenIdle) {
  TestRegion region(1 << 14);
  ShmChannels channels(absl::Milliseconds(50), 1 << 20, 2);
  auto id = channels.Open(OpenOf(region.name, 1 << 14), "Bearer a");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(channels.Use(*id, "Bearer b", 1).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(channels.Close(*id, "Bearer b").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(channels.Use(*id, "Bearer a", 1).ok());
  // Transfers in order only: a repeated or earlier number is refused.
  EXPECT_EQ(channels.Use(*id, "Bearer a", 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(channels.Use(*id, "Bearer a", 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(channels.Use(*id, "Bearer a", 5).ok());  // gaps are fine
  EXPECT_EQ(channels.Use(*id, "Bearer a", 4).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(channels.Open(OpenOf(region.name, 1 << 14), "Bearer a").ok());
  EXPECT_EQ(channels.Open(OpenOf(region.name, 1 << 14), "Bearer a").status().code(),
            absl::StatusCode::kResourceExhausted);  // at most 2
  absl::SleepFor(absl::Milliseconds(120));
  EXPECT_EQ(channels.Use(*id, "Bearer a", 6).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(channels.open_channels(), 0);
}

// Regions as files in a directory shared with the worker (--shm_dir, e.g.
// a volume two pods of one node mount), and the nonce that tells the
// client's region from another host's of the same name.
TEST(WorkerServiceTest, ChannelsInASharedDirectoryAndTheirNonce) {
  const std::string dir = ::testing::TempDir() + "/shm_dir_test_" + std::to_string(getpid());
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  const std::string file = "ember-test-" + std::to_string(getpid());
  const std::string path = dir + "/" + file;
  const int fd = open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 1 << 14), 0);
  const uint64_t nonce = 0x0123456789abcdefULL;
  ASSERT_EQ(pwrite(fd, &nonce, sizeof(nonce), 0), static_cast<ssize_t>(sizeof(nonce)));
  close(fd);
  ASSERT_EQ(symlink(path.c_str(), (dir + "/ember-link").c_str()), 0);

  ShmChannels shared(absl::Minutes(1), 1 << 20, 8, dir);
  auto id = shared.Open(OpenOf(file, 1 << 14, true, nonce), "Bearer a");
  ASSERT_TRUE(id.ok()) << id.status();
  auto region = shared.Use(*id, "Bearer a", 1);
  ASSERT_TRUE(region.ok());
  EXPECT_EQ(region->region()->size(), 1u << 14);
  auto refused = [&](const ember::v1::OpenChannelRequest& req, absl::StatusCode code,
                     const std::string& words) {
    const auto got = shared.Open(req, "Bearer a");
    EXPECT_EQ(got.status().code(), code) << got.status();
    EXPECT_THAT(std::string(got.status().message()), ::testing::HasSubstr(words));
  };
  // Another host's region of the same name: other bytes than the nonce.
  refused(OpenOf(file, 1 << 14, true, nonce + 1), absl::StatusCode::kFailedPrecondition,
          "nonce");
  refused(OpenOf("ember-missing", 1 << 14, true, nonce), absl::StatusCode::kNotFound,
          "this worker's host");
  // Nothing outside the directory, no links, no names that are not ours.
  refused(OpenOf("ember-x/../" + file, 1 << 14, true, nonce), absl::StatusCode::kInvalidArgument,
          "no other '/'");
  refused(OpenOf("../" + file, 1 << 14, true, nonce), absl::StatusCode::kInvalidArgument,
          "must be \"ember-...\"");
  refused(OpenOf("ember-link", 1 << 14, true, nonce), absl::StatusCode::kNotFound, "ember-link");
  refused(OpenOf(file, 1 << 15, true, nonce), absl::StatusCode::kInvalidArgument,
          "at least 32768 bytes");
  ember::v1::OpenChannelRequest both = OpenOf(file, 1 << 14, true, nonce);
  both.set_shm_name("/ember-x");
  refused(both, absl::StatusCode::kInvalidArgument, "exactly one");
  refused(OpenOf("", 1 << 14, true, nonce), absl::StatusCode::kInvalidArgument, "exactly one");
  // A worker without a shared directory takes POSIX names only.
  ShmChannels plain(absl::Minutes(1), 1 << 20, 8);
  EXPECT_EQ(plain.Open(OpenOf(file, 1 << 14, true, nonce), "Bearer a").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(shared.open_channels(), 1);
  unlink((dir + "/ember-link").c_str());
  unlink(path.c_str());
  rmdir(dir.c_str());
}


// The client's end of a link channel in these tests: its own copy of the
// region, joined to the worker's socket link as rank 1.
struct TestLinkClient {
  // Opens a link channel of `size` bytes on `s` ("socket"), joins it
  // unless `join` is false.
  TestLinkClient(WorkerService* s, size_t size, bool join = true) : region(size) {
    ember::v1::OpenChannelRequest open;
    open.set_link("socket");
    open.set_size(size);
    ember::v1::OpenChannelResponse opened;
    const grpc::Status st = s->OpenChannel(nullptr, &open, &opened);
    EXPECT_TRUE(st.ok()) << st.error_message();
    id = opened.channel_id();
    if (!join) return;
    auto l = cuda::SocketLinks()->Join(opened.link_id(), 1, 0, absl::Now() + absl::Seconds(10));
    EXPECT_TRUE(l.ok()) << l.status();
    if (!l.ok()) return;
    link = *std::move(l);
    memory = static_cast<char*>(*link->Allocate(size));
  }
  // Copies `v` to `at` of the region and names it in `slice`.
  template <typename T>
  void Put(const std::vector<T>& v, uint64_t at, ember::v1::ShmSlice* slice) {
    std::memcpy(region.data() + at, v.data(), v.size() * sizeof(T));
    slice->set_offset(at);
    slice->set_size(v.size() * sizeof(T));
  }
  // Sends bytes [0, n) of the region, named in `sent` (as a call does
  // before its message).
  void Send(uint64_t n, ember::v1::ShmSlice* sent) {
    sent->set_offset(0);
    sent->set_size(n);
    ASSERT_TRUE(link->CopyIn(memory, region.data(), n).ok());
    ASSERT_TRUE(link->Send(memory, n).ok());
  }
  // A pooled lookup of table t through the channel as transfer `seq`: bags
  // of `ids` (`lengths`) at bytes 0 and 64, its output (`rows` rows) at
  // 1024 and the reply covering it; the arrays sent.
  ember::v1::WorkerLookupRequest Lookup(uint64_t seq, const std::vector<int64_t>& lengths,
                                        const std::vector<int64_t>& ids) {
    ember::v1::WorkerLookupRequest req = PooledLookup();
    req.set_channel_id(id);
    req.set_channel_seq(seq);
    Put(lengths, 0, req.mutable_features(0)->mutable_shm_lengths());
    Put(ids, 64, req.mutable_features(0)->mutable_shm_ids());
    auto* out = req.add_shm_outputs();
    out->set_offset(1024);
    out->set_size(lengths.size() * 4 * 4);
    *req.mutable_link_reply() = *out;
    Send(128, req.mutable_link_sent());
    return req;
  }
  // Looks `ids` up on `s` through the channel as transfer `seq` (Lookup,
  // the call, the outputs received): the output, not what the region held
  // there before.
  std::vector<float> LookUpOn(WorkerService* s, uint64_t seq, const std::vector<int64_t>& lengths,
                              const std::vector<int64_t>& ids) {
    const size_t floats = lengths.size() * 4;
    std::memset(region.data() + 1024, 0x7f, floats * sizeof(float));  // not what comes back
    ember::v1::WorkerLookupRequest req = Lookup(seq, lengths, ids);
    ember::v1::WorkerLookupResponse resp;
    const grpc::Status st = s->Lookup(nullptr, &req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    if (!st.ok()) return {};
    EXPECT_TRUE(Receive(req.link_reply()).ok());
    std::vector<float> got(floats);
    std::memcpy(got.data(), region.data() + 1024, floats * sizeof(float));
    return got;
  }
  // An update of table t through the channel (request `request_id`, its
  // seq and link_sent left to the caller): bags of `ids` at bytes 0 and 64,
  // gradient rows [1..4] and [5..8] at 2048, 32 bytes in all past 2048.
  ember::v1::WorkerApplyGradientsRequest Update(const std::string& request_id,
                                                const std::vector<int64_t>& lengths,
                                                const std::vector<int64_t>& ids) {
    ember::v1::WorkerApplyGradientsRequest up = UpdateOfT(request_id);
    up.set_channel_id(id);
    auto* g = up.mutable_gradients(0);
    Put(lengths, 0, g->mutable_feature()->mutable_shm_lengths());
    Put(ids, 64, g->mutable_feature()->mutable_shm_ids());
    Put(std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}, 2048, g->mutable_shm_grad());
    return up;
  }
  // Receives `reply` into the region (as a call does after its answer).
  absl::Status Receive(const ember::v1::ShmSlice& reply) {
    char* m = memory + reply.offset();
    if (absl::Status s = link->Recv(m, reply.size()); !s.ok()) return s;
    if (absl::Status s = link->CopyOut(region.data() + reply.offset(), m, reply.size()); !s.ok()) {
      return s;
    }
    return link->Wait(absl::Now() + absl::Seconds(10));
  }
  std::vector<char> region;
  uint64_t id = 0;
  std::unique_ptr<cuda::PeerLink> link;
  char* memory = nullptr;
};

WorkerServiceOptions OfferingSocketLinks() {
  WorkerServiceOptions so;
  so.links.kinds = {cuda::SocketLinks()};
  so.links.transfer_timeout = absl::Milliseconds(500);
  return so;
}

// Lookups and updates through a link channel (a socket link: the NCCL
// channel's protocol without a GPU) give what the same calls inline give,
// exactly once; the region's bytes cross the link both ways.
TEST(WorkerServiceTest, LinkChannelsServeLikeInline) {
  auto s = MakeService(OfferingSocketLinks());
  TestLinkClient c(s.get(), 1 << 16);
  ASSERT_NE(c.link, nullptr);
  EXPECT_EQ(s->open_channels(), 1);
  const std::vector<int64_t> lengths = {2, 1}, ids = {0, 1, 3};
  const std::vector<float> want = InlineLookup(s.get(), lengths, ids);
  uint64_t seq = 0;
  for (int round = 0; round < 3; ++round) {  // the link stays in step call after call
    EXPECT_EQ(c.LookUpOn(s.get(), ++seq, lengths, ids), want) << "round " << round;
  }
  // An update, and its retry (a new transfer of the same request).
  ember::v1::WorkerApplyGradientsRequest up = c.Update("link-1", lengths, ids);
  ember::v1::WorkerApplyGradientsResponse ur;
  for (bool duplicate : {false, true}) {
    up.set_channel_seq(++seq);
    c.Send(2048 + 32, up.mutable_link_sent());
    const grpc::Status st = s->ApplyGradients(nullptr, &up, &ur);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(ur.duplicate(), duplicate);
  }
  // SGD at rate 1: rows 0 and 1 minus [1,2,3,4], row 3 minus [5,6,7,8].
  const std::vector<float> after = Table(s.get(), "t");
  EXPECT_EQ(std::vector<float>(after.begin(), after.begin() + 8),
            (std::vector<float>{-1, -2, -3, -4, -1, -2, -3, -4}));
  EXPECT_EQ(std::vector<float>(after.begin() + 12, after.end()),
            (std::vector<float>{-5, -6, -7, -8}));
  // And lookups of the updated rows (not zeros now): the same through the
  // link as inline.
  const std::vector<float> updated = InlineLookup(s.get(), lengths, ids);
  ASSERT_NE(updated, want);
  EXPECT_EQ(c.LookUpOn(s.get(), ++seq, lengths, ids), updated);
  ember::v1::CloseChannelRequest close;
  close.set_channel_id(c.id);
  ember::v1::CloseChannelResponse closed;
  EXPECT_TRUE(s->CloseChannel(nullptr, &close, &closed).ok());
  EXPECT_EQ(s->open_channels(), 0);
}

// A link channel's call refused as busy has its bytes taken off the link
// first: the refusal says so (kLinkBytesTaken), the channel stays open and
// in step, and the next call on it is served; no new link is joined.
TEST(WorkerServiceTest, BusyRefusalsKeepLinkChannelsInStep) {
  absl::Notification release;
  std::atomic<bool> hold{false};
  WorkerServiceOptions so = OfferingSocketLinks();
  so.max_queued_calls = 1;
  auto s = MakeService(so, false, [&] {
    if (hold) release.WaitForNotification();
  });
  TestLinkClient c(s.get(), 1 << 16);
  ASSERT_NE(c.link, nullptr);
  const std::vector<int64_t> lengths = {2, 1}, ids = {0, 1, 3};
  const std::vector<float> want = InlineLookup(s.get(), lengths, ids);
  EXPECT_EQ(c.LookUpOn(s.get(), 1, lengths, ids), want);
  hold = true;
  std::thread held([&] { InlineLookup(s.get(), lengths, ids); });
  while (s->GetStats().calls_in_progress < 1) std::this_thread::yield();
  ember::v1::WorkerLookupRequest req = c.Lookup(2, lengths, ids);
  ember::v1::WorkerLookupResponse resp;
  grpc::Status st = s->Lookup(nullptr, &req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(st.error_message().rfind(kWorkerBusy, 0), 0u) << st.error_message();
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr(kLinkBytesTaken));
  EXPECT_TRUE(HasSignal(st, kSignalWorkerBusy));
  EXPECT_TRUE(HasSignal(st, kSignalLinkBytesTaken));
  ember::v1::WorkerApplyGradientsRequest up = c.Update("busy", lengths, ids);
  up.set_channel_seq(3);
  c.Send(2048 + 32, up.mutable_link_sent());
  ember::v1::WorkerApplyGradientsResponse ur;
  st = s->ApplyGradients(nullptr, &up, &ur);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr(kLinkBytesTaken));
  hold = false;
  release.Notify();
  held.join();
  EXPECT_EQ(s->open_channels(), 1);
  EXPECT_EQ(s->GetStats().busy_refused, 2);
  EXPECT_EQ(Table(s.get(), "t"), std::vector<float>(16, 0.0f));  // nothing applied
  // The same channel, in step: the next lookup gets its own outputs.
  EXPECT_EQ(c.LookUpOn(s.get(), 4, lengths, ids), want);
  EXPECT_EQ(s->GetStats().link_channels_opened, 1);
  EXPECT_EQ(s->GetStats().link_busy_kept, 2);
}

// A reply the client never takes (it died after the call's answer) would
// hold the worker's link, and with NCCL the device, until the channel
// lapsed: the worker drops the channel once the reply is late.
TEST(WorkerServiceTest, LinkRepliesNoClientTakesAreGivenUp) {
  auto s = MakeService(OfferingSocketLinks());  // replies due within 500 ms
  constexpr int64_t kBags = 1 << 16;  // a 1 MiB reply: more than the socket holds
  TestLinkClient c(s.get(), 4 << 20);
  ASSERT_NE(c.link, nullptr);
  const std::vector<int64_t> lengths(kBags, 1), ids(kBags, 2);
  ember::v1::WorkerLookupRequest req = PooledLookup();
  req.set_channel_id(c.id);
  req.set_channel_seq(1);
  c.Put(lengths, 0, req.mutable_features(0)->mutable_shm_lengths());
  c.Put(ids, kBags * 8, req.mutable_features(0)->mutable_shm_ids());
  auto* out = req.add_shm_outputs();
  out->set_offset(2 * kBags * 8);
  out->set_size(kBags * 4 * 4);
  *req.mutable_link_reply() = *out;
  c.Send(2 * kBags * 8, req.mutable_link_sent());
  ember::v1::WorkerLookupResponse resp;
  ASSERT_TRUE(s->Lookup(nullptr, &req, &resp).ok());
  EXPECT_EQ(s->open_channels(), 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (s->open_channels() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(s->open_channels(), 0) << "a reply never taken kept its channel";
  // The client's side sees its link lost.
  EXPECT_FALSE(c.Receive(req.link_reply()).ok());
}

// A link channel's call that is refused, or whose bytes never come, loses
// the channel (its link may be out of step with the client's), and applies
// nothing; kinds not offered, and link channels that name a region, are
// refused when opened.
TEST(WorkerServiceTest, LinkChannelsAreLostOnMisuseAndApplyNothing) {
  {
    auto plain = MakeService(false);  // offers no links
    ember::v1::OpenChannelRequest open;
    open.set_link("socket");
    open.set_size(1 << 16);
    ember::v1::OpenChannelResponse opened;
    const grpc::Status st = plain->OpenChannel(nullptr, &open, &opened);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr("offers none"));
  }
  auto s = MakeService(OfferingSocketLinks());
  ember::v1::OpenChannelRequest open;
  ember::v1::OpenChannelResponse opened;
  open.set_size(1 << 16);
  open.set_link("nccl");
  grpc::Status st = s->OpenChannel(nullptr, &open, &opened);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(st.error_message(), ::testing::HasSubstr("offers \"socket\""));
  open.set_link("socket");
  open.set_shm_name("/ember-x");
  EXPECT_EQ(s->OpenChannel(nullptr, &open, &opened).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  open.clear_shm_name();
  open.set_size(100);
  EXPECT_EQ(s->OpenChannel(nullptr, &open, &opened).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s->open_channels(), 0);
  {  // link channels' memory is bounded: 2 of 64 KiB fit in 160 KiB, a third does not
    WorkerServiceOptions bounded = OfferingSocketLinks();
    bounded.links.max_bytes = 160 << 10;
    auto b = MakeService(bounded);
    TestLinkClient first(b.get(), 1 << 16), second(b.get(), 1 << 16);
    open.set_size(1 << 16);
    const grpc::Status third = b->OpenChannel(nullptr, &open, &opened);
    EXPECT_EQ(third.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(third.error_message(), ::testing::HasSubstr("--link_memory_mib"));
    EXPECT_EQ(b->open_channels(), 2);
  }

  const std::vector<float> before = Table(s.get(), "t");
  const std::vector<int64_t> lengths = {2, 1}, ids = {0, 1, 3};
  // An update through channel `c` as transfer `seq`, its bytes sent.
  auto update = [&](TestLinkClient& c, uint64_t seq, bool send = true) {
    ember::v1::WorkerApplyGradientsRequest up =
        c.Update(absl::StrCat("u", seq, "-", c.id), lengths, ids);
    up.set_channel_seq(seq);
    if (send) c.Send(2048 + 32, up.mutable_link_sent());
    return up;
  };
  auto lost = [&](const ember::v1::WorkerApplyGradientsRequest& up, grpc::StatusCode code,
                  const std::string& why) {
    ember::v1::WorkerApplyGradientsResponse ur;
    const grpc::Status got = s->ApplyGradients(nullptr, &up, &ur);
    EXPECT_EQ(got.error_code(), code) << why << ": " << got.error_message();
    EXPECT_THAT(got.error_message(), ::testing::HasSubstr(why));
    EXPECT_EQ(Table(s.get(), "t"), before) << why;
    EXPECT_EQ(s->open_channels(), 0) << why << ": the channel is lost";
  };
  {  // link_sent past the region
    TestLinkClient c(s.get(), 1 << 16);
    auto up = update(c, 1);
    up.mutable_link_sent()->set_size(1 << 20);
    lost(up, grpc::StatusCode::INVALID_ARGUMENT, "outside the shared region");
  }
  {  // a replayed transfer number
    TestLinkClient c(s.get(), 1 << 16);
    ember::v1::WorkerLookupRequest req = c.Lookup(2, lengths, ids);
    ember::v1::WorkerLookupResponse resp;
    ASSERT_TRUE(s->Lookup(nullptr, &req, &resp).ok());
    ASSERT_TRUE(c.Receive(req.link_reply()).ok());
    lost(update(c, 2), grpc::StatusCode::INVALID_ARGUMENT, "out of order");
  }
  {  // refused before its bytes were received: no request id
    TestLinkClient c(s.get(), 1 << 16);
    auto up = update(c, 1);
    up.set_request_id("");
    lost(up, grpc::StatusCode::INVALID_ARGUMENT, "request_id is empty");
  }
  {  // bytes that never come (the client died after sending the message)
    TestLinkClient c(s.get(), 1 << 16);
    ember::v1::WorkerApplyGradientsRequest up = UpdateOfT("never-sent");
    up.set_channel_id(c.id);
    up.set_channel_seq(1);
    up.mutable_link_sent()->set_size(4096);
    const absl::Time start = absl::Now();
    lost(up, grpc::StatusCode::UNAVAILABLE, "not done by the deadline");
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  }
  {  // a client that never joined the link
    TestLinkClient c(s.get(), 1 << 16, /*join=*/false);
    ember::v1::WorkerApplyGradientsRequest up = UpdateOfT("never-joined");
    up.set_channel_id(c.id);
    up.set_channel_seq(1);
    up.mutable_link_sent()->set_size(64);
    // "its link was not joined" once the worker's join attempt has timed
    // out, "still being joined" if the call's wait ends first (a loaded
    // machine can delay the join's timeout past the transfer's): both lose
    // the channel and apply nothing.
    lost(up, grpc::StatusCode::UNAVAILABLE, "joined");
  }
  {  // a link slice on an inline call
    ember::v1::WorkerLookupRequest req = PooledLookup();
    req.mutable_link_reply()->set_size(32);
    ember::v1::WorkerLookupResponse resp;
    EXPECT_EQ(s->Lookup(nullptr, &req, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {  // a reply reaching past the outputs (into bytes of the region the
     // outputs do not cover): refused, nothing sent back
    TestLinkClient c(s.get(), 1 << 16);
    ember::v1::WorkerLookupRequest req = c.Lookup(1, lengths, ids);
    req.mutable_link_reply()->set_size(4096);
    ember::v1::WorkerLookupResponse resp;
    const grpc::Status got = s->Lookup(nullptr, &req, &resp);
    EXPECT_EQ(got.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(got.error_message(), ::testing::HasSubstr("is not the outputs' bytes"));
    ASSERT_TRUE(c.link->Wait(absl::Now() + absl::Seconds(5)).ok());
    ember::v1::CloseChannelRequest close;  // as the client gives it up
    close.set_channel_id(c.id);
    ember::v1::CloseChannelResponse closed;
    EXPECT_TRUE(s->CloseChannel(nullptr, &close, &closed).ok());
  }
  // Refused after its bytes arrived (ids out of the shard): nothing
  // applied, and the worker's side of the link is still in step.
  TestLinkClient c(s.get(), 1 << 16);
  auto up = update(c, 1, /*send=*/false);
  c.Put(std::vector<int64_t>{0, 1, 99}, 4096, up.mutable_gradients(0)->mutable_feature()->mutable_shm_ids());
  c.Send(4096 + 24, up.mutable_link_sent());
  ember::v1::WorkerApplyGradientsResponse ur;
  EXPECT_EQ(s->ApplyGradients(nullptr, &up, &ur).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s->open_channels(), 1);
  up = update(c, 2);
  const grpc::Status fine = s->ApplyGradients(nullptr, &up, &ur);
  EXPECT_TRUE(fine.ok()) << fine.error_message();
  EXPECT_NE(Table(s.get(), "t"), before);
}
// ShardGradient.mean_lengths (a stepped update's row-split MEAN feature):
// refused by an ASYNC collection and when malformed; applied, the bag's
// gradient is scaled by 1/length (here after dividing by 1 trainer).
// Collection `name` at epoch 1 on `s`: one table "t" of 4 rows of 4
// columns, all zero, SGD at rate 1, pooled by `pooling`, trained as
// `training` says; a backup copy of `primary`'s when that is given.
void CreateTableT(WorkerService* s, const std::string& name, TableConfig::Pooling pooling,
                  const ember::v1::TrainingSpec& training, const std::string& primary = "") {
  ember::v1::CreateShardsRequest create;
  create.set_collection(name);
  create.set_epoch(1);
  *create.mutable_training() = training;
  auto* a = create.add_shards();
  a->mutable_ref()->set_table("t");
  TableConfig* t = a->mutable_table();
  t->set_name("t");
  t->set_num_embeddings(4);
  t->set_embedding_dim(4);
  t->set_pooling(pooling);
  t->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::SGD);
  t->mutable_optimizer()->set_learning_rate(1.0);
  t->mutable_initializer()->set_type(ember::v1::InitializerSpec::CONSTANT);
  a->set_rows(4);
  a->set_cols(4);
  if (!primary.empty()) a->mutable_replication()->set_primary(primary);
  ember::v1::CreateShardsResponse created;
  ASSERT_TRUE(s->CreateShards(nullptr, &create, &created).ok());
}

TEST(WorkerServiceTest, MeanLengthsAreForSteppedUpdatesAndScaleEachBag) {
  auto s = MakeService(WorkerServiceOptions());
  auto update = [](const std::string& collection, std::vector<int64_t> mean_lengths) {
    ember::v1::WorkerApplyGradientsRequest r = UpdateOfT("m-" + collection);
    r.set_collection(collection);
    auto* g = r.mutable_gradients(0);
    g->mutable_feature()->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{1, 2}));
    g->mutable_feature()->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{0, 1, 2}));
    g->set_grad(wire::Encode<float>(std::vector<float>{2, 2, 2, 2, 4, 4, 4, 4}));
    g->set_mean_lengths(wire::Encode<int64_t>(mean_lengths));
    r.set_step(0);
    r.set_rank(0);
    return r;
  };
  ember::v1::WorkerApplyGradientsResponse resp;
  auto refused = update("c", {2, 4});
  const grpc::Status async = s->ApplyGradients(nullptr, &refused, &resp);
  EXPECT_EQ(async.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(async.error_message(), ::testing::HasSubstr("only SYNC and BOUNDED updates take"));
  // The same table in a SYNC collection of one trainer.
  ember::v1::TrainingSpec sync;
  sync.set_mode(ember::v1::TrainingSpec::SYNC);
  sync.set_trainers(1);
  ASSERT_NO_FATAL_FAILURE(CreateTableT(s.get(), "sy", TableConfig::SUM, sync));
  for (const auto& [bad, why] : std::vector<std::pair<std::vector<int64_t>, std::string>>{
           {{2}, "one per bag (2), got 1"}, {{2, 1}, "mean_lengths[1] (1) is less than"}}) {
    auto r = update("sy", bad);
    const grpc::Status st = s->ApplyGradients(nullptr, &r, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << why;
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr(why));
  }
  auto good = update("sy", {2, 4});
  ASSERT_TRUE(s->ApplyGradients(nullptr, &good, &resp).ok());
  // SGD lr 1 from 0: row 0 -= 2 / 2; rows 1 and 2 -= 4 / 4; row 3 untouched.
  EXPECT_EQ(Table(s.get(), "t", "sy"), (std::vector<float>{-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0}));
}

// A retry after a re-cut merged shards (a live move's record for the rows
// of the sources that applied it, ImportRowsRequest.applied_for_rows) is
// applied to the other rows only; a MEAN bag keeps its whole length's
// factor, though some of its ids are left out. SGD at rate 1 from zero.
TEST(WorkerServiceTest, ARetryAfterAReCutReachesOnlyTheRowsThatLackedItWithItsMeanFactor) {
  auto s = MakeService(WorkerServiceOptions());
  ASSERT_NO_FATAL_FAILURE(
      CreateTableT(s.get(), "mc", TableConfig::MEAN, ember::v1::TrainingSpec()));
  // Rows 0 and 1 came from a source that applied "u".
  ember::v1::ImportRowsRequest record;
  record.set_collection("mc");
  record.set_epoch(1);
  record.mutable_shard()->set_table("t");
  record.set_applied_for_rows(true);
  record.set_row_begin(0);
  record.set_row_end(2);
  record.add_applied_ids(RequestIdHash("u"));
  record.add_applied_unix_ms(absl::ToUnixMillis(absl::Now()));
  ember::v1::ImportRowsResponse imported;
  ASSERT_TRUE(s->ImportRows(nullptr, &record, &imported).ok());
  // Bag 0: ids {0, 2, 3} (weights 1, 2, 0.5), gradient 3; bag 1: ids
  // {1, 3}, gradient 2.
  ember::v1::WorkerApplyGradientsRequest u;
  u.set_collection("mc");
  u.set_epoch(1);
  u.set_request_id("u");
  auto* g = u.add_gradients();
  g->mutable_feature()->mutable_shard()->set_table("t");
  g->mutable_feature()->set_pooling(TableConfig::MEAN);
  g->mutable_feature()->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{3, 2}));
  g->mutable_feature()->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{0, 2, 3, 1, 3}));
  g->mutable_feature()->set_weights(wire::Encode<float>(std::vector<float>{1, 2, 0.5, 1, 1}));
  g->set_grad(wire::Encode<float>(std::vector<float>{3, 3, 3, 3, 2, 2, 2, 2}));
  ember::v1::WorkerApplyGradientsResponse resp;
  ASSERT_TRUE(s->ApplyGradients(nullptr, &u, &resp).ok());
  EXPECT_FALSE(resp.duplicate());
  // Rows 0 and 1 untouched; row 2 -= 3 * 2 / 3; row 3 -= 3 * 0.5 / 3 + 2 / 2.
  EXPECT_EQ(Table(s.get(), "t", "mc"), (std::vector<float>{0, 0, 0, 0, 0, 0, 0, 0, -2, -2, -2, -2, -1.5, -1.5, -1.5, -1.5}));
  // Sent again: applied everywhere now.
  ASSERT_TRUE(s->ApplyGradients(nullptr, &u, &resp).ok());
  EXPECT_TRUE(resp.duplicate());
  // A trainer cannot mark other updates applied (step_ranks is a
  // primary's forward of a step): refused, nothing recorded.
  ember::v1::WorkerApplyGradientsRequest claims = u;
  claims.set_request_id("claims");
  claims.add_step_ranks()->set_request_id("someone-elses");
  const grpc::Status refused = s->ApplyGradients(nullptr, &claims, &resp);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  ember::v1::WorkerApplyGradientsRequest theirs = u;
  theirs.set_request_id("someone-elses");
  ember::v1::WorkerApplyGradientsResponse fresh;
  ASSERT_TRUE(s->ApplyGradients(nullptr, &theirs, &fresh).ok());
  EXPECT_FALSE(fresh.duplicate());
}

// A backup copy of a SYNC collection's shard: a lookup for step s waits
// until its primary forwarded step s - 1 (every step reaches every backup
// worker, parts or none); before any step at this epoch it asks the client
// to read the primary (kSignalReadPrimary). Forwards come only from the
// shard's primary; trainers' updates are refused.
TEST(WorkerServiceTest, ASyncBackupServesLookupsForTheStepsItsPrimaryForwarded) {
  auto s = MakeService(WorkerServiceOptions());
  ember::v1::TrainingSpec sync;
  sync.set_mode(ember::v1::TrainingSpec::SYNC);
  sync.set_trainers(2);
  sync.set_step_timeout_s(1);
  ASSERT_NO_FATAL_FAILURE(CreateTableT(s.get(), "sb", TableConfig::SUM, sync, "10.0.0.1:7000"));
  auto lookup = [&](int64_t step, std::vector<float>* out) {
    ember::v1::WorkerLookupRequest req = PooledLookup();
    req.set_collection("sb");
    req.set_step(step);
    auto* f = req.mutable_features(0);
    f->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{1}));
    f->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{2}));
    ember::v1::WorkerLookupResponse resp;
    const grpc::Status st = s->Lookup(nullptr, &req, &resp);
    if (st.ok() && out != nullptr) {
      EXPECT_TRUE(wire::Decode(resp.outputs(0), "out", out).ok());
    }
    return st;
  };
  auto forward = [&](const std::string& from, int64_t step, bool with_part) {
    ember::v1::WorkerApplyGradientsRequest r;
    r.set_collection("sb");
    r.set_epoch(1);
    r.set_request_id(absl::StrCat("step ", step, " from ", from));
    r.set_from_primary(from);
    r.set_step(step);
    for (int rank = 0; rank < 2; ++rank) {
      r.add_step_ranks()->set_request_id(absl::StrCat("rank", rank, "-", step));
    }
    if (with_part) {
      auto* g = r.add_gradients();
      g->mutable_feature()->mutable_shard()->set_table("t");
      g->mutable_feature()->set_pooling(TableConfig::SUM);
      g->mutable_feature()->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{1}));
      g->mutable_feature()->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{2}));
      g->set_grad(wire::Encode<float>(std::vector<float>{1, 1, 1, 1}));
    }
    ember::v1::WorkerApplyGradientsResponse resp;
    return s->ApplyGradients(nullptr, &r, &resp);
  };
  std::vector<float> out;
  EXPECT_TRUE(lookup(0, &out).ok());  // step 0 needs no step applied
  const grpc::Status unknown = lookup(2, nullptr);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::UNAVAILABLE) << unknown.error_message();
  EXPECT_TRUE(HasSignal(FromGrpc(unknown), kSignalReadPrimary)) << unknown.error_message();
  // Forwards from anyone but the primary are refused, nothing applied.
  const grpc::Status stranger = forward("10.0.0.9:7000", 0, true);
  EXPECT_EQ(stranger.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << stranger.error_message();
  ASSERT_TRUE(forward("10.0.0.1:7000", 0, false).ok());  // step 0: nothing for this copy
  ASSERT_TRUE(lookup(1, &out).ok());
  EXPECT_EQ(out, std::vector<float>(4, 0.0f));
  const absl::Time start = absl::Now();
  const grpc::Status ahead = lookup(2, nullptr);  // step 1 not forwarded: waits its timeout
  EXPECT_EQ(ahead.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << ahead.error_message();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(900));
  ASSERT_TRUE(forward("10.0.0.1:7000", 1, true).ok());
  ASSERT_TRUE(lookup(2, &out).ok());
  EXPECT_EQ(out, std::vector<float>(4, -1.0f));
  // A trainer's update straight to the backup is refused.
  ember::v1::WorkerApplyGradientsRequest direct;
  direct.set_collection("sb");
  direct.set_epoch(1);
  direct.set_request_id("direct");
  direct.set_step(2);
  direct.set_rank(0);
  auto* g = direct.add_gradients();
  g->mutable_feature()->mutable_shard()->set_table("t");
  g->mutable_feature()->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{1}));
  g->mutable_feature()->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{2}));
  g->set_grad(wire::Encode<float>(std::vector<float>{1, 1, 1, 1}));
  ember::v1::WorkerApplyGradientsResponse resp;
  const grpc::Status refused = s->ApplyGradients(nullptr, &direct, &resp);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << refused.error_message();
  ASSERT_TRUE(lookup(2, &out).ok());
  EXPECT_EQ(out, std::vector<float>(4, -1.0f));
  // A lookup waiting for a step is answered when the collection moves to
  // another epoch (FAILED_PRECONDITION: refresh the plan), not at the
  // step timeout.
  grpc::Status waited;
  std::thread waiter([&] { waited = lookup(3, nullptr); });
  absl::SleepFor(absl::Milliseconds(100));
  ember::v1::UpdateShardsRequest next;
  next.set_collection("sb");
  next.set_epoch(2);
  *next.mutable_training() = sync;
  ember::v1::UpdateShardsResponse updated;
  const absl::Time moved = absl::Now();
  ASSERT_TRUE(s->UpdateShards(nullptr, &next, &updated).ok());
  waiter.join();
  EXPECT_EQ(waited.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << waited.error_message();
  EXPECT_LT(absl::Now() - moved, absl::Milliseconds(500));
}

// A SYNC step every shard of a worker had applied stays applied at a new
// epoch: here shard "t" is the worker's own and "u" a backup promoted by
// the new epoch (its primary had forwarded step 0). Rank 1 sending step 0
// again (its answer lost with the dead primary) is answered as a retry at
// once, not held for rank 0, which has moved on; step 1 then runs as
// usual. A shard new at the epoch leaves the new barrier unseeded.
// A 4 x 4 table at SGD rate 1 from zero (a backup of `backs`' shard if
// given), and a gradient of 1s on its row 1: the step tests' shard and part.
ember::v1::ShardAssignment RowOneTable(const std::string& table, const std::string& backs) {
  ember::v1::ShardAssignment a;
  a.mutable_ref()->set_table(table);
  TableConfig* t = a.mutable_table();
  t->set_name(table);
  t->set_num_embeddings(4);
  t->set_embedding_dim(4);
  t->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::SGD);
  t->mutable_optimizer()->set_learning_rate(1.0);
  t->mutable_initializer()->set_type(ember::v1::InitializerSpec::CONSTANT);
  a.set_rows(4);
  a.set_cols(4);
  if (!backs.empty()) a.mutable_replication()->set_primary(backs);
  return a;
}

// Collection `name` at epoch 1: "t" its own, "u" a backup of `primary`'s shard.
void CreateOwnAndBacked(WorkerService* s, const std::string& name,
                        const ember::v1::TrainingSpec& training, const std::string& primary) {
  ember::v1::CreateShardsRequest create;
  create.set_collection(name);
  create.set_epoch(1);
  *create.mutable_training() = training;
  *create.add_shards() = RowOneTable("t", "");
  *create.add_shards() = RowOneTable("u", primary);
  ember::v1::CreateShardsResponse created;
  ASSERT_TRUE(s->CreateShards(nullptr, &create, &created).ok());
}

void AddRowOneGradient(ember::v1::WorkerApplyGradientsRequest* r, const std::string& table) {
  auto* g = r->add_gradients();
  g->mutable_feature()->mutable_shard()->set_table(table);
  g->mutable_feature()->set_pooling(TableConfig::SUM);
  g->mutable_feature()->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{1}));
  g->mutable_feature()->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{1}));
  g->set_grad(wire::Encode<float>(std::vector<float>{1, 1, 1, 1}));
}

// Rank `rank`'s update for `step`: row 1 of each of `tables`, under the
// request id "rank<rank>-<step>".
ember::v1::WorkerApplyGradientsRequest RankStepUpdate(const std::string& collection,
                                                      int64_t epoch, int64_t step, int rank,
                                                      const std::vector<std::string>& tables) {
  ember::v1::WorkerApplyGradientsRequest r;
  r.set_collection(collection);
  r.set_epoch(epoch);
  r.set_request_id(absl::StrCat("rank", rank, "-", step));
  r.set_request_digest(1000 + 10 * step + rank);
  r.set_step(step);
  r.set_rank(rank);
  for (const std::string& t : tables) AddRowOneGradient(&r, t);
  return r;
}

// `primary`'s forward of step 0 of `collection` at epoch 1, merged from
// ranks 0 and 1 (RankStepUpdate's ids and digests): row 1 of "u".
ember::v1::WorkerApplyGradientsRequest StepZeroOfU(const std::string& collection,
                                                   const std::string& primary) {
  ember::v1::WorkerApplyGradientsRequest forward;
  forward.set_collection(collection);
  forward.set_epoch(1);
  forward.set_request_id("step 0 of u");
  forward.set_from_primary(primary);
  forward.set_step(0);
  for (int rank = 0; rank < 2; ++rank) {
    auto* u = forward.add_step_ranks();
    u->set_request_id(absl::StrCat("rank", rank, "-0"));
    u->set_request_digest(1000 + rank);
    u->set_rank(rank);
  }
  AddRowOneGradient(&forward, "u");
  return forward;
}

// BOUNDED replicas: a backup keeps each rank's update its primary holds
// (hold), from that primary only, and never from a trainer. When it is
// promoted, the new barrier completes the steps its dead primary held: a
// rank whose update the primary acknowledged need not send it again, one
// whose update it had not sends it, and every table ends as one trainer
// sending the global batch would leave it.
TEST(WorkerServiceTest, APromotedBoundedBackupCompletesTheStepsItsPrimaryHeld) {
  auto s = MakeService(WorkerServiceOptions());
  ember::v1::TrainingSpec bounded;
  bounded.set_mode(ember::v1::TrainingSpec::BOUNDED);
  bounded.set_trainers(2);
  bounded.set_max_staleness(1);
  bounded.set_step_timeout_s(5);
  const std::string primary = "10.0.0.1:7000";
  ASSERT_NO_FATAL_FAILURE(CreateOwnAndBacked(s.get(), "bb", bounded, primary));
  auto assignment = RowOneTable;
  auto update = [](int64_t epoch, int64_t step, int rank, const std::vector<std::string>& tables) {
    return RankStepUpdate("bb", epoch, step, rank, tables);
  };
  auto send = [&](ember::v1::WorkerApplyGradientsRequest r) {
    ember::v1::WorkerApplyGradientsResponse resp;
    return s->ApplyGradients(nullptr, &r, &resp);
  };
  auto hold = [&](const std::string& from, int64_t step, int rank) {
    ember::v1::WorkerApplyGradientsRequest r = update(1, step, rank, {"u"});
    r.set_from_primary(from);
    r.set_hold(true);
    return r;
  };
  // Step 0: both ranks' parts of "t" here, held then applied; their parts
  // of "u" held by its primary, which sends them here.
  ASSERT_TRUE(send(update(1, 0, 0, {"t"})).ok());
  ASSERT_TRUE(send(update(1, 0, 1, {"t"})).ok());
  ASSERT_TRUE(send(hold(primary, 0, 0)).ok());
  ASSERT_TRUE(send(hold(primary, 0, 1)).ok());
  EXPECT_TRUE(send(hold(primary, 0, 1)).ok());  // sent again
  ember::v1::WorkerApplyGradientsRequest other = hold(primary, 0, 1);
  other.set_request_digest(7);
  EXPECT_EQ(send(other).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(send(hold("10.0.0.9:7000", 0, 0)).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ember::v1::WorkerApplyGradientsRequest from_trainer = update(1, 0, 0, {"t"});
  from_trainer.set_hold(true);
  EXPECT_EQ(send(from_trainer).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // The primary applies step 0 and forwards it merged (the ranks' halves).
  ember::v1::WorkerApplyGradientsRequest forward = StepZeroOfU("bb", primary);
  ASSERT_TRUE(send(forward).ok());
  // Step 1: both ranks' "t" here, applied; the primary holds rank 0's "u"
  // (kept here) and dies before rank 1's reaches it.
  ASSERT_TRUE(send(update(1, 1, 0, {"t"})).ok());
  ASSERT_TRUE(send(update(1, 1, 1, {"t"})).ok());
  ASSERT_TRUE(send(hold(primary, 1, 0)).ok());
  // Epoch 2: "u" promoted.
  ember::v1::UpdateShardsRequest promote;
  promote.set_collection("bb");
  promote.set_epoch(2);
  *promote.mutable_training() = bounded;
  *promote.add_create() = assignment("t", "");
  *promote.add_create() = assignment("u", "");
  ember::v1::UpdateShardsResponse updated;
  ASSERT_TRUE(s->UpdateShards(nullptr, &promote, &updated).ok());
  // Rank 1 sends step 1 again (its answer never came from the dead
  // primary); rank 0's, acknowledged, is here already. Its "t" part was
  // applied at epoch 1 and is not applied again.
  ASSERT_TRUE(send(update(2, 1, 1, {"t", "u"})).ok());
  ember::v1::WorkerApplyGradientsRequest again = update(2, 1, 0, {"t", "u"});
  ember::v1::WorkerApplyGradientsResponse resp;
  ASSERT_TRUE(s->ApplyGradients(nullptr, &again, &resp).ok());
  EXPECT_TRUE(resp.duplicate());
  for (const char* table : {"t", "u"}) {
    const std::vector<float> w = Table(s.get(), table, "bb");
    ASSERT_EQ(w.size(), 16u) << table;
    // Row 1: two steps of the two ranks' 1s, halved, at rate 1 from zero.
    EXPECT_EQ(w[4], -2.0f) << table;
    EXPECT_EQ(w[0], 0.0f) << table;
  }
}

TEST(WorkerServiceTest, ASyncStepAppliedEverywhereHereStaysAppliedAtANewEpoch) {
  auto s = MakeService(WorkerServiceOptions());
  ember::v1::TrainingSpec sync;
  sync.set_mode(ember::v1::TrainingSpec::SYNC);
  sync.set_trainers(2);
  sync.set_step_timeout_s(1);
  const std::string primary = "10.0.0.1:7000";
  ASSERT_NO_FATAL_FAILURE(CreateOwnAndBacked(s.get(), "ss", sync, primary));
  auto assignment = RowOneTable;
  auto contribution = [](int64_t epoch, int64_t step, int rank,
                         const std::vector<std::string>& tables) {
    return RankStepUpdate("ss", epoch, step, rank, tables);
  };
  // Step 0: both ranks' parts of "t" here; "u"'s came through its primary.
  std::vector<grpc::Status> got(2);
  {
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < 2; ++rank) {
      ranks.emplace_back([&, rank] {
        auto r = contribution(1, 0, rank, {"t"});
        ember::v1::WorkerApplyGradientsResponse resp;
        got[rank] = s->ApplyGradients(nullptr, &r, &resp);
      });
    }
    for (auto& t : ranks) t.join();
  }
  ASSERT_TRUE(got[0].ok() && got[1].ok()) << got[0].error_message() << got[1].error_message();
  ember::v1::WorkerApplyGradientsRequest forward = StepZeroOfU("ss", primary);
  ember::v1::WorkerApplyGradientsResponse fresp;
  ASSERT_TRUE(s->ApplyGradients(nullptr, &forward, &fresp).ok());
  // Epoch 2: "u" promoted.
  ember::v1::UpdateShardsRequest promote;
  promote.set_collection("ss");
  promote.set_epoch(2);
  *promote.mutable_training() = sync;
  *promote.add_create() = assignment("t", "");
  *promote.add_create() = assignment("u", "");
  ember::v1::UpdateShardsResponse updated;
  ASSERT_TRUE(s->UpdateShards(nullptr, &promote, &updated).ok());
  const absl::Time start = absl::Now();
  auto again = contribution(2, 0, 1, {"t", "u"});
  ember::v1::WorkerApplyGradientsResponse resp;
  const grpc::Status retried = s->ApplyGradients(nullptr, &again, &resp);
  EXPECT_TRUE(retried.ok()) << retried.error_message();
  EXPECT_TRUE(resp.duplicate());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500)) << "held for the other rank";
  // Step 1 as usual: both ranks, both tables.
  {
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < 2; ++rank) {
      ranks.emplace_back([&, rank] {
        auto r = contribution(2, 1, rank, {"t", "u"});
        ember::v1::WorkerApplyGradientsResponse r1;
        got[rank] = s->ApplyGradients(nullptr, &r, &r1);
      });
    }
    for (auto& t : ranks) t.join();
  }
  ASSERT_TRUE(got[0].ok() && got[1].ok()) << got[0].error_message() << got[1].error_message();
  for (const char* table : {"t", "u"}) {
    const std::vector<float> w = Table(s.get(), table, "ss");
    ASSERT_EQ(w.size(), 16u) << table;
    // Row 1: step 0 (t: the two ranks' 1s, halved; u: the forwarded 1),
    // then step 1 (the two ranks' 1s, halved), at rate 1 from zero.
    EXPECT_EQ(w[4], -2.0f) << table;
  }
  // A shard new at an epoch: no seed, so a resend of step 1 is held (and
  // aborted at the step timeout, rank 0 not sending it).
  ember::v1::UpdateShardsRequest grow = promote;
  grow.set_epoch(3);
  *grow.add_create() = assignment("v", "");
  ASSERT_TRUE(s->UpdateShards(nullptr, &grow, &updated).ok());
  auto late = contribution(3, 1, 1, {"t"});
  const grpc::Status held = s->ApplyGradients(nullptr, &late, &resp);
  EXPECT_FALSE(held.ok()) << "answered without the other rank";
}

// ImportRows' dynamic-table fields refused cleanly, nothing written:
// slot_meta or ids for a fixed shard, a dynamic shard's slots without their
// slot_meta or with too few or negative fields, repeated ids; then a good
// import by id reads back.
TEST(WorkerServiceTest, DynamicImportsRefuseMalformedFieldsAndChangeNothing) {
  auto b = backend::CreateCpuBackend(backend::CpuBackendOptions());
  ASSERT_TRUE(b.ok());
  auto s = std::make_unique<WorkerService>(backend::WithDynamicShards(*std::move(b)),
                                           WorkerServiceOptions());
  ember::v1::CreateShardsRequest create;
  create.set_collection("d");
  create.set_epoch(1);
  for (const char* name : {"fixed", "dyn"}) {
    auto* a = create.add_shards();
    a->mutable_ref()->set_table(name);
    TableConfig* t = a->mutable_table();
    t->set_name(name);
    t->set_num_embeddings(4);
    t->set_embedding_dim(4);
    if (std::string(name) == "dyn") t->mutable_dynamic()->set_capacity(4);
    a->set_rows(4);
    a->set_cols(4);
  }
  ember::v1::CreateShardsResponse created;
  ASSERT_TRUE(s->CreateShards(nullptr, &create, &created).ok());
  auto import = [&](const char* table, auto&& fill) {
    ember::v1::ImportRowsRequest req;
    req.set_collection("d");
    req.set_epoch(1);
    req.mutable_shard()->set_table(table);
    req.set_step(-1);
    fill(&req);
    ember::v1::ImportRowsResponse resp;
    return s->ImportRows(nullptr, &req, &resp);
  };
  auto slots = [&]() {
    ember::v1::ExportRowsRequest req;
    req.set_collection("d");
    req.mutable_shard()->set_table("dyn");
    req.set_row_end(4);
    ember::v1::ExportRowsResponse resp;
    EXPECT_TRUE(s->ExportRows(nullptr, &req, &resp).ok());
    return resp.slot_meta();
  };
  const std::string before = slots();
  const std::vector<float> row(4, 1.0f), rows(8, 1.0f);
  auto refused = [&](const grpc::Status& st, const std::string& words) {
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr(words));
  };
  refused(import("fixed", [&](ember::v1::ImportRowsRequest* r) {
            r->set_ids(wire::Encode<int64_t>({7}));
            r->set_weights(wire::Encode<float>(row));
          }),
          "is not a dynamic table's");
  refused(import("dyn", [&](ember::v1::ImportRowsRequest* r) {
            r->set_row_end(1);
            r->set_weights(wire::Encode<float>(row));
          }),
          "come with their slot_meta");
  refused(import("dyn", [&](ember::v1::ImportRowsRequest* r) {
            r->set_row_end(1);
            r->set_weights(wire::Encode<float>(row));
            r->set_slot_meta(wire::Encode<int64_t>({7, 1, 1}));  // 3 of 4 fields
          }),
          "not 4 per slot");
  refused(import("dyn", [&](ember::v1::ImportRowsRequest* r) {
            r->set_row_end(1);
            r->set_weights(wire::Encode<float>(row));
            r->set_slot_meta(wire::Encode<int64_t>({7, -1, 1, 0}));
          }),
          "must be >= 0");
  refused(import("dyn", [&](ember::v1::ImportRowsRequest* r) {
            r->set_ids(wire::Encode<int64_t>({7, 7}));
            r->set_weights(wire::Encode<float>(rows));
          }),
          "given twice");
  // Admission counts: not on a fixed shard; pairs with counts >= 1; a
  // refused one writes no slot either.
  auto counts = [&]() {  // the exact counts and the sketch, as a move reads them
    ember::v1::ExportRowsRequest req;
    req.set_collection("d");
    req.mutable_shard()->set_table("dyn");
    req.set_with_applied_ids(true);
    ember::v1::ExportRowsResponse resp;
    EXPECT_TRUE(s->ExportRows(nullptr, &req, &resp).ok());
    return resp;
  };
  auto pending = [&]() {
    std::vector<int64_t> got;
    EXPECT_TRUE(wire::Decode(counts().pending_counts(), "pending_counts", &got).ok());
    return got;
  };
  refused(import("fixed", [&](ember::v1::ImportRowsRequest* r) {
            r->set_pending_counts(wire::Encode<int64_t>({7, 1}));
          }),
          "is not a dynamic table's");
  refused(import("dyn", [&](ember::v1::ImportRowsRequest* r) {
            r->set_pending_counts(wire::Encode<int64_t>({7, 1, 8}));
          }),
          "not (id, count) pairs");
  refused(import("dyn", [&](ember::v1::ImportRowsRequest* r) {
            r->set_ids(wire::Encode<int64_t>({7}));
            r->set_weights(wire::Encode<float>(row));
            r->set_pending_counts(wire::Encode<int64_t>({8, 1}));
          }),
          "takes no slot_meta, pending_counts");
  refused(import("dyn", [&](ember::v1::ImportRowsRequest* r) {
            r->set_row_end(1);
            r->set_weights(wire::Encode<float>(row));
            r->set_slot_meta(wire::Encode<int64_t>({7, 1, 1, 1}));
            r->set_pending_counts(wire::Encode<int64_t>({8, 0}));
          }),
          "(>= 1)");
  EXPECT_EQ(slots(), before);
  EXPECT_TRUE(pending().empty());
  ASSERT_TRUE(import("dyn", [&](ember::v1::ImportRowsRequest* r) {
                r->set_pending_counts(wire::Encode<int64_t>({-8, 2, 9, 1}));
              }).ok());
  EXPECT_EQ(pending(), (std::vector<int64_t>{-8, 2, 9, 1}));
  // The sketch of the counts past the exact ones: not on a fixed shard, not
  // with ids, only whole; a good one replaces the shard's counts with the
  // exact ones it comes with (sent twice, as a retried copy call: counted
  // once) and is exported with them.
  std::vector<uint32_t> sketch(backend::kPendingSketchCounters, 0);
  sketch[5] = 3;
  sketch[65536 + 9] = 2;
  refused(import("fixed", [&](ember::v1::ImportRowsRequest* r) {
            r->set_pending_sketch(wire::Encode<uint32_t>(sketch));
          }),
          "is not a dynamic table's");
  refused(import("dyn", [&](ember::v1::ImportRowsRequest* r) {
            r->set_ids(wire::Encode<int64_t>({7}));
            r->set_weights(wire::Encode<float>(row));
            r->set_pending_sketch(wire::Encode<uint32_t>(sketch));
          }),
          "pending_sketch (those come with slots");
  refused(import("dyn", [&](ember::v1::ImportRowsRequest* r) {
            r->set_pending_sketch(wire::Encode<uint32_t>({1, 2, 3}));
          }),
          "pending_sketch: 3 counters");
  auto exported_sketch = [&]() {
    std::vector<uint32_t> got;
    EXPECT_TRUE(wire::Decode(counts().pending_sketch(), "pending_sketch", &got).ok());
    return got;
  };
  EXPECT_TRUE(exported_sketch().empty());  // never used
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(import("dyn", [&](ember::v1::ImportRowsRequest* r) {
                  r->set_pending_counts(wire::Encode<int64_t>({-8, 3}));
                  r->set_pending_sketch(wire::Encode<uint32_t>(sketch));
                }).ok());
  }
  EXPECT_EQ(exported_sketch(), sketch);
  EXPECT_EQ(pending(), (std::vector<int64_t>{-8, 3}));
  ASSERT_TRUE(import("dyn", [&](ember::v1::ImportRowsRequest* r) {
                r->set_ids(wire::Encode<int64_t>({-7}));
                r->set_weights(wire::Encode<float>(row));
              }).ok());
  std::vector<int64_t> meta;
  ASSERT_TRUE(wire::Decode(slots(), "slot_meta", &meta).ok());
  EXPECT_EQ(meta[0], -7);  // slot 0 holds it now
}

}  // namespace
}  // namespace worker
}  // namespace ember
