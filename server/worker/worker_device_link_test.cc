// A worker with the CUDA backend serving link channels over NCCL links, all
// on the host CUDA runtime (cuda/host_runtime.h) with the stand-in NCCL
// (link/fake_nccl.h): a call's ids, weights and gradients stay in the
// link's device memory, where the backend checks and reads them, and only
// the lengths come to the host. Checked against the same calls inline (on
// a second worker for updates), with bad values in device memory refused
// and nothing applied.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "link/fake_nccl.h"
#include "link/nccl_api.h"
#include "link/peer_link.h"
#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/dynamic/dynamic_backend.h"
#include "server/backend/forwarding_backend.h"
#include "server/common/wire.h"
#include "server/worker/worker_service.h"

namespace ember {
namespace worker {
namespace {

using ember::v1::TableConfig;

constexpr int64_t kRows = 8, kDim = 4;

// Records where each call's inputs were (FeatureRequest::on_device).
class RecordingBackend : public backend::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status Lookup(absl::Span<const backend::LookupRequest> r) override {
    if (!r.empty()) {
      lookup_on_device = r[0].feature.on_device;
      lookup_keyed = r[0].feature.keyed;
    }
    return ForwardingBackend::Lookup(r);
  }
  absl::Status ApplyGradients(absl::Span<const backend::GradientRequest> r) override {
    if (!r.empty()) update_on_device = r[0].feature.on_device;
    return ForwardingBackend::ApplyGradients(r);
  }
  std::atomic<int> lookup_on_device{-1}, update_on_device{-1}, lookup_keyed{-1};
};

cuda::PeerLinks* Nccl() {
  static cuda::PeerLinks* links = cuda::NcclLinksOver(cuda::FakeNccl()).release();
  return links;
}

// A worker on host CUDA device 0 offering NCCL links, holding collection
// "c": table "t" (SUM, kRows x kDim, TorchRec's default initialisation,
// SGD at rate 1), trained as `training` says (default: ASYNC). *recorder is
// its backend. `dynamic`: t is a dynamic table of capacity kRows (admitted
// on the first update, LRU), its shards over the CUDA backend through
// WithDynamicShards as a worker's factory makes them.
std::unique_ptr<WorkerService> MakeWorker(RecordingBackend** recorder, bool skip_nonfinite = false,
                                          const ember::v1::TrainingSpec& training = {},
                                          bool dynamic = false) {
  backend::CudaBackendOptions o;
  o.device = 0;
  o.scratch_bytes = 1 << 20;
  auto b = backend::CreateCudaBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return nullptr;
  auto rec = std::make_unique<RecordingBackend>(*std::move(b));
  *recorder = rec.get();
  WorkerServiceOptions so;
  so.links.kinds = {Nccl()};
  so.links.device = 0;
  so.links.transfer_timeout = absl::Seconds(5);
  so.skip_nonfinite = skip_nonfinite;
  std::unique_ptr<backend::EmbeddingBackend> served = std::move(rec);
  if (dynamic) served = backend::WithDynamicShards(std::move(served));
  auto s = std::make_unique<WorkerService>(std::move(served), so);
  ember::v1::CreateShardsRequest req;
  req.set_collection("c");
  req.set_epoch(1);
  *req.mutable_training() = training;
  auto* a = req.add_shards();
  a->mutable_ref()->set_table("t");
  TableConfig* t = a->mutable_table();
  t->set_name("t");
  t->set_num_embeddings(dynamic ? 0 : kRows);
  if (dynamic) t->mutable_dynamic()->set_capacity(kRows);
  t->set_embedding_dim(kDim);
  t->set_pooling(TableConfig::SUM);
  t->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::SGD);
  t->mutable_optimizer()->set_learning_rate(1.0);
  a->set_rows(kRows);
  a->set_cols(kDim);
  ember::v1::CreateShardsResponse resp;
  const grpc::Status st = s->CreateShards(nullptr, &req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return s;
}

std::vector<float> Table(WorkerService* s) {
  ember::v1::ExportRowsRequest req;
  req.set_collection("c");
  req.mutable_shard()->set_table("t");
  req.set_row_end(kRows);
  ember::v1::ExportRowsResponse resp;
  EXPECT_TRUE(s->ExportRows(nullptr, &req, &resp).ok());
  std::vector<float> w;
  EXPECT_TRUE(wire::Decode(resp.weights(), "weights", &w).ok());
  return w;
}

// An update of collection "c" (epoch 1) as request `request_id`, no
// gradients yet.
ember::v1::WorkerApplyGradientsRequest UpdateOf(const std::string& request_id) {
  ember::v1::WorkerApplyGradientsRequest up;
  up.set_collection("c");
  up.set_epoch(1);
  up.set_request_id(request_id);
  return up;
}

// One feature of table t: bags of `ids` (`lengths`), per-id `weights` (or
// none).
struct Bags {
  std::vector<int64_t> lengths, ids;
  std::vector<float> weights;
};

// The client's end of an NCCL link channel, on host CUDA device 1: its copy
// of the region, laid out by the calls below from byte 0 on, 256-aligned.
class LinkClient {
 public:
  explicit LinkClient(WorkerService* s) : region_(kSize) {
    ember::v1::OpenChannelRequest open;
    open.set_link("nccl");
    open.set_size(kSize);
    ember::v1::OpenChannelResponse opened;
    const grpc::Status st = s->OpenChannel(nullptr, &open, &opened);
    EXPECT_TRUE(st.ok()) << st.error_message();
    id_ = opened.channel_id();
    auto l = Nccl()->Join(opened.link_id(), 1, /*device=*/1, absl::Now() + absl::Seconds(10));
    EXPECT_TRUE(l.ok()) << l.status();
    if (!l.ok()) return;
    link_ = *std::move(l);
    auto m = link_->Allocate(kSize);
    EXPECT_TRUE(m.ok()) << m.status();
    if (m.ok()) memory_ = static_cast<char*>(*m);
  }
  bool ok() const { return memory_ != nullptr; }

  // A lookup of `features` through the channel (outputs after the inputs),
  // sent; the call is the caller's, then Reply().
  ember::v1::WorkerLookupRequest Lookup(const std::vector<Bags>& features) {
    ember::v1::WorkerLookupRequest req;
    req.set_collection("c");
    req.set_epoch(1);
    req.set_channel_id(id_);
    req.set_channel_seq(++seq_);
    at_ = 0;
    for (const Bags& b : features) Feature(b, req.add_features());
    const uint64_t first = at_;
    for (const Bags& b : features) {
      auto* out = req.add_shm_outputs();
      out->set_offset(at_);
      out->set_size(b.lengths.size() * kDim * sizeof(float));
      at_ += out->size();
    }
    req.mutable_link_reply()->set_offset(first);
    req.mutable_link_reply()->set_size(at_ - first);
    Send(first, req.mutable_link_sent());
    return req;
  }
  // An update of `features` with gradients `grads` (one per feature)
  // through the channel, as request `request_id`, sent.
  ember::v1::WorkerApplyGradientsRequest Update(const std::string& request_id,
                                                const std::vector<Bags>& features,
                                                const std::vector<std::vector<float>>& grads) {
    ember::v1::WorkerApplyGradientsRequest up = UpdateOf(request_id);
    up.set_channel_id(id_);
    up.set_channel_seq(++seq_);
    at_ = 0;
    for (size_t i = 0; i < features.size(); ++i) {
      auto* g = up.add_gradients();
      Feature(features[i], g->mutable_feature());
      Put(grads[i], g->mutable_shm_grad());
    }
    Send(at_, up.mutable_link_sent());
    return up;
  }
  // Receives a lookup's reply: the outputs of its features, in order.
  std::vector<float> Reply(const ember::v1::WorkerLookupRequest& req) {
    const ember::v1::ShmSlice& r = req.link_reply();
    char* m = memory_ + r.offset();
    absl::Status s = link_->Recv(m, r.size());
    if (s.ok()) s = link_->CopyOut(region_.data() + r.offset(), m, r.size());
    if (s.ok()) s = link_->Wait(absl::Now() + absl::Seconds(10));
    EXPECT_TRUE(s.ok()) << s;
    std::vector<float> out(r.size() / sizeof(float));
    std::memcpy(out.data(), region_.data() + r.offset(), r.size());
    return out;
  }

 private:
  static constexpr size_t kSize = 1 << 16;

  template <typename T>
  void Put(const std::vector<T>& v, ember::v1::ShmSlice* slice) {
    if (v.empty()) return;
    std::memcpy(region_.data() + at_, v.data(), v.size() * sizeof(T));
    slice->set_offset(at_);
    slice->set_size(v.size() * sizeof(T));
    at_ = (at_ + slice->size() + 255) / 256 * 256;
  }
  void Feature(const Bags& b, ember::v1::ShardFeature* f) {
    f->mutable_shard()->set_table("t");
    f->set_pooling(TableConfig::SUM);
    Put(b.lengths, f->mutable_shm_lengths());
    Put(b.ids, f->mutable_shm_ids());
    Put(b.weights, f->mutable_shm_weights());
  }
  // Sends bytes [0, n) of the region, named in `sent`.
  void Send(uint64_t n, ember::v1::ShmSlice* sent) {
    sent->set_offset(0);
    sent->set_size(n);
    absl::Status s = link_->CopyIn(memory_, region_.data(), n);
    if (s.ok()) s = link_->Send(memory_, n);
    EXPECT_TRUE(s.ok()) << s;
  }

  std::vector<char> region_;
  uint64_t id_ = 0, seq_ = 0, at_ = 0;
  std::unique_ptr<cuda::PeerLink> link_;
  char* memory_ = nullptr;
};

// A feature of t with its arrays in the message.
void Inline(const Bags& b, ember::v1::ShardFeature* f) {
  f->mutable_shard()->set_table("t");
  f->set_pooling(TableConfig::SUM);
  f->set_lengths(wire::Encode<int64_t>(b.lengths));
  f->set_ids(wire::Encode<int64_t>(b.ids));
  if (!b.weights.empty()) f->set_weights(wire::Encode<float>(b.weights));
}

// The same lookup inline: the outputs in order.
std::vector<float> InlineLookup(WorkerService* s, const std::vector<Bags>& features) {
  ember::v1::WorkerLookupRequest req;
  req.set_collection("c");
  req.set_epoch(1);
  for (const Bags& b : features) Inline(b, req.add_features());
  ember::v1::WorkerLookupResponse resp;
  const grpc::Status st = s->Lookup(nullptr, &req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  std::vector<float> all;
  for (const std::string& o : resp.outputs()) {
    std::vector<float> out;
    EXPECT_TRUE(wire::Decode(o, "out", &out).ok());
    all.insert(all.end(), out.begin(), out.end());
  }
  return all;
}

// The same update inline.
grpc::Status InlineUpdate(WorkerService* s, const std::string& request_id,
                          const std::vector<Bags>& features,
                          const std::vector<std::vector<float>>& grads) {
  ember::v1::WorkerApplyGradientsRequest up = UpdateOf(request_id);
  for (size_t i = 0; i < features.size(); ++i) {
    auto* g = up.add_gradients();
    Inline(features[i], g->mutable_feature());
    g->set_grad(wire::Encode<float>(grads[i]));
  }
  ember::v1::WorkerApplyGradientsResponse resp;
  return s->ApplyGradients(nullptr, &up, &resp);
}

// Two features of t in one call: weighted bags {1, 7}, {}, {3}, and bags
// {0, 0, 5}, {6}; their gradients.
const std::vector<Bags> kFeatures = {{{2, 0, 1}, {1, 7, 3}, {0.5f, 2.0f, -1.0f}},
                                     {{3, 1}, {0, 0, 5, 6}, {}}};
const std::vector<std::vector<float>> kGrads = {
    {1, 2, 3, 4, 5, 6, 7, 8, -1, -2, -3, -4}, {0.5f, 0.5f, 0.5f, 0.5f, 1, 0, -1, 2}};

TEST(WorkerDeviceLinkTest, InputsStayInTheLinksDeviceMemoryAndServeLikeInline) {
  RecordingBackend* rec = nullptr;
  auto s = MakeWorker(&rec);
  RecordingBackend* ref_rec = nullptr;
  auto ref = MakeWorker(&ref_rec);
  ASSERT_NE(s, nullptr);
  ASSERT_NE(ref, nullptr);
  LinkClient c(s.get());
  ASSERT_TRUE(c.ok());
  for (int step = 0; step < 3; ++step) {
    const std::vector<float> want = InlineLookup(ref.get(), kFeatures);
    ASSERT_EQ(want.size(), 5u * kDim);
    ember::v1::WorkerLookupRequest req = c.Lookup(kFeatures);
    ember::v1::WorkerLookupResponse resp;
    const grpc::Status st = s->Lookup(nullptr, &req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(rec->lookup_on_device, 1);
    EXPECT_EQ(c.Reply(req), want) << "step " << step;
    // The update through the link, and inline on the reference worker.
    ember::v1::WorkerApplyGradientsRequest up = c.Update(absl::StrCat("u", step), kFeatures, kGrads);
    ember::v1::WorkerApplyGradientsResponse ur;
    const grpc::Status ust = s->ApplyGradients(nullptr, &up, &ur);
    ASSERT_TRUE(ust.ok()) << ust.error_message();
    EXPECT_EQ(rec->update_on_device, 1);
    const grpc::Status rst = InlineUpdate(ref.get(), absl::StrCat("u", step), kFeatures, kGrads);
    ASSERT_TRUE(rst.ok()) << rst.error_message();
    EXPECT_EQ(ref_rec->update_on_device, 0);
    EXPECT_EQ(Table(s.get()), Table(ref.get())) << "step " << step;
  }
  // SGD at rate 1 moved rows 1 (by 0.5 * [1..4]) and 0 (twice by 0.5).
  EXPECT_NE(Table(s.get()), std::vector<float>(kRows * kDim, 0.0f));
}

TEST(WorkerDeviceLinkTest, BadValuesInDeviceMemoryAreRefusedAndNothingApplied) {
  RecordingBackend* rec = nullptr;
  auto s = MakeWorker(&rec);
  ASSERT_NE(s, nullptr);
  LinkClient c(s.get());
  ASSERT_TRUE(c.ok());
  const std::vector<float> before = Table(s.get());
  auto refused_lookup = [&](const std::vector<Bags>& f, const std::string& words) {
    ember::v1::WorkerLookupRequest req = c.Lookup(f);
    ember::v1::WorkerLookupResponse resp;
    const grpc::Status st = s->Lookup(nullptr, &req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr(words));
  };
  auto refused_update = [&](const std::vector<Bags>& f, const std::vector<std::vector<float>>& g,
                            const std::string& words) {
    ember::v1::WorkerApplyGradientsRequest up = c.Update("bad", f, g);
    ember::v1::WorkerApplyGradientsResponse ur;
    const grpc::Status st = s->ApplyGradients(nullptr, &up, &ur);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_THAT(st.error_message(), ::testing::HasSubstr(words));
  };
  std::vector<Bags> f = kFeatures;
  f[1].ids[2] = kRows;  // the second request's third id
  refused_lookup(f, "lookup request 1 (table 't'): id 8 at position 2 is outside [0, 8)");
  refused_update(f, kGrads, "gradient request 1 (table 't'): id 8 at position 2");
  f = kFeatures;
  f[0].ids[0] = -3;
  refused_lookup(f, "id -3 at position 0");
  f = kFeatures;
  f[0].weights[1] = std::numeric_limits<float>::infinity();
  refused_lookup(f, "weights[1] is inf");
  refused_update(f, kGrads, "weights[1] is inf");
  std::vector<std::vector<float>> g = kGrads;
  g[1][6] = std::nanf("");
  refused_update(kFeatures, g, "gradient request 1 (table 't'): gradient[6] is nan");
  // Shapes are checked on the host: lengths that do not sum to the ids.
  f = kFeatures;
  f[0].lengths = {2, 0, 2};
  refused_lookup(f, "lengths sum to 4 but there are 3 ids");
  EXPECT_EQ(Table(s.get()), before);
  // The channel is still in step: the good update applies.
  ember::v1::WorkerApplyGradientsRequest up = c.Update("good", kFeatures, kGrads);
  ember::v1::WorkerApplyGradientsResponse ur;
  const grpc::Status st = s->ApplyGradients(nullptr, &up, &ur);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_NE(Table(s.get()), before);
}

// With skip_nonfinite the worker reads the gradients itself: updates take
// the host path (still through the link), and what NaN/Inf touches is left
// out.
TEST(WorkerDeviceLinkTest, SkipNonFiniteUpdatesComeToTheHost) {
  RecordingBackend* rec = nullptr;
  auto s = MakeWorker(&rec, /*skip_nonfinite=*/true);
  ASSERT_NE(s, nullptr);
  LinkClient c(s.get());
  ASSERT_TRUE(c.ok());
  const std::vector<float> before = Table(s.get());
  std::vector<std::vector<float>> g = kGrads;
  g[0][0] = std::nanf("");  // bag 0 of feature 0: ids 1 and 7 left out
  ember::v1::WorkerApplyGradientsRequest up = c.Update("skip", kFeatures, g);
  ember::v1::WorkerApplyGradientsResponse ur;
  const grpc::Status st = s->ApplyGradients(nullptr, &up, &ur);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(rec->update_on_device, 0);
  const std::vector<float> after = Table(s.get());
  for (int64_t col = 0; col < kDim; ++col) {
    EXPECT_EQ(after[1 * kDim + col], before[1 * kDim + col]) << "row 1 was left out";
    EXPECT_EQ(after[7 * kDim + col], before[7 * kDim + col]) << "row 7 was left out";
    EXPECT_NE(after[5 * kDim + col], before[5 * kDim + col]) << "row 5 was updated";
  }
  // Lookups still read the link's device memory.
  ember::v1::WorkerLookupRequest req = c.Lookup(kFeatures);
  ember::v1::WorkerLookupResponse resp;
  ASSERT_TRUE(s->Lookup(nullptr, &req, &resp).ok());
  EXPECT_EQ(rec->lookup_on_device, 1);
  EXPECT_EQ(c.Reply(req).size(), 5u * kDim);
}

// SYNC over NCCL links: each rank's update comes to the host whole (it is
// held until the step is complete, after the link's memory is reused), and
// the step applies as one trainer sending both ranks' bags, with MEAN's
// division by 2; a lookup for the next step through the link reads it.
TEST(WorkerDeviceLinkTest, SyncStepsHoldTheRanksUpdatesOnTheHost) {
  ember::v1::TrainingSpec sync;
  sync.set_mode(ember::v1::TrainingSpec::SYNC);
  sync.set_trainers(2);
  RecordingBackend* rec = nullptr;
  auto s = MakeWorker(&rec, /*skip_nonfinite=*/false, sync);
  RecordingBackend* ref_rec = nullptr;
  auto ref = MakeWorker(&ref_rec);
  ASSERT_NE(s, nullptr);
  ASSERT_NE(ref, nullptr);
  LinkClient c0(s.get()), c1(s.get());
  ASSERT_TRUE(c0.ok());
  ASSERT_TRUE(c1.ok());
  const std::vector<float> initial = Table(s.get());
  const Bags b0 = kFeatures[1];                      // bags {0, 0, 5}, {6}
  const Bags b1 = {{2, 3, 0}, {1, 0, 0, 7, 5}, {}};  // bags {1, 0}, {0, 7, 5}, {}
  const std::vector<float> g0 = kGrads[1];
  const std::vector<float> g1 = {1, 2, 3, 4, -4, -3, -2, -1, 8, 8, 8, 8};
  for (int step = 0; step < 2; ++step) {
    auto stepped = [&](LinkClient& c, const Bags& b, const std::vector<float>& g, int rank) {
      ember::v1::WorkerApplyGradientsRequest up =
          c.Update(absl::StrCat("s", step, "r", rank), {b}, {g});
      up.set_step(step);
      up.set_rank(rank);
      return up;
    };
    ember::v1::WorkerApplyGradientsRequest up0 = stepped(c0, b0, g0, 0);
    ember::v1::WorkerApplyGradientsRequest up1 = stepped(c1, b1, g1, 1);
    grpc::Status st0;
    std::thread rank0([&] {
      ember::v1::WorkerApplyGradientsResponse r;
      st0 = s->ApplyGradients(nullptr, &up0, &r);
    });
    ember::v1::WorkerApplyGradientsResponse r1;
    const grpc::Status st1 = s->ApplyGradients(nullptr, &up1, &r1);
    rank0.join();
    ASSERT_TRUE(st0.ok()) << st0.error_message();
    ASSERT_TRUE(st1.ok()) << st1.error_message();
    EXPECT_EQ(rec->update_on_device, 0);
    // The reference: one trainer, the global batch (rank 0's bags, then
    // rank 1's), its gradients halved.
    Bags global = b0;
    global.lengths.insert(global.lengths.end(), b1.lengths.begin(), b1.lengths.end());
    global.ids.insert(global.ids.end(), b1.ids.begin(), b1.ids.end());
    std::vector<float> grad = g0;
    grad.insert(grad.end(), g1.begin(), g1.end());
    for (float& x : grad) x *= 0.5f;
    const grpc::Status rst = InlineUpdate(ref.get(), absl::StrCat("g", step), {global}, {grad});
    ASSERT_TRUE(rst.ok()) << rst.error_message();
    EXPECT_EQ(Table(s.get()), Table(ref.get())) << "step " << step;
    // Rank 0 reads for the next step through its link.
    ember::v1::WorkerLookupRequest req = c0.Lookup(kFeatures);
    req.set_step(step + 1);
    ember::v1::WorkerLookupResponse resp;
    const grpc::Status lst = s->Lookup(nullptr, &req, &resp);
    ASSERT_TRUE(lst.ok()) << lst.error_message();
    EXPECT_EQ(rec->lookup_on_device, 1);
    EXPECT_EQ(c0.Reply(req), InlineLookup(ref.get(), kFeatures)) << "step " << step;
  }
  EXPECT_NE(Table(s.get()), initial);
}

// A dynamic table over a link: lookup ids stay in the link's device memory
// (found there, keyed, in the backend's copy of the index), an update comes
// to the host for its bookkeeping (admission, eviction); lookups answer as
// the same calls inline on a second worker, through admissions and LRU
// evictions of 64-bit ids.
TEST(WorkerDeviceLinkTest, DynamicTablesFindLookupIdsOnTheDeviceAndUpdateOnTheHost) {
  RecordingBackend* rec = nullptr;
  auto s = MakeWorker(&rec, /*skip_nonfinite=*/false, {}, /*dynamic=*/true);
  RecordingBackend* ref_rec = nullptr;
  auto ref = MakeWorker(&ref_rec, /*skip_nonfinite=*/false, {}, /*dynamic=*/true);
  ASSERT_NE(s, nullptr);
  ASSERT_NE(ref, nullptr);
  LinkClient c(s.get());
  ASSERT_TRUE(c.ok());
  const int64_t big = int64_t{1} << 61;
  const std::vector<int64_t> universe = {-7, big, -big, 123456789012345, 5, 0, 77, big + 1,
                                         -3, 9, 31, 4242};
  for (int step = 0; step < 6; ++step) {
    // 12 ids over 8 rows: later steps evict.
    Bags b;
    for (int bag = 0; bag < 3; ++bag) {
      b.lengths.push_back(2);
      b.ids.push_back(universe[(step * 2 + bag) % universe.size()]);
      b.ids.push_back(universe[(step * 5 + bag * 3 + 1) % universe.size()]);
    }
    std::vector<float> g(3 * kDim);
    for (size_t k = 0; k < g.size(); ++k) g[k] = 0.25f * static_cast<float>((k + step) % 7) - 0.5f;
    ember::v1::WorkerApplyGradientsRequest up = c.Update(absl::StrCat("d", step), {b}, {g});
    ember::v1::WorkerApplyGradientsResponse r;
    const grpc::Status st = s->ApplyGradients(nullptr, &up, &r);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(rec->update_on_device, 0);
    const grpc::Status rst = InlineUpdate(ref.get(), absl::StrCat("d", step), {b}, {g});
    ASSERT_TRUE(rst.ok()) << rst.error_message();
    Bags probe;  // every id of the universe, one bag each: held or not
    for (const int64_t id : universe) {
      probe.lengths.push_back(1);
      probe.ids.push_back(id);
    }
    ember::v1::WorkerLookupRequest req = c.Lookup({probe});
    ember::v1::WorkerLookupResponse resp;
    const grpc::Status lst = s->Lookup(nullptr, &req, &resp);
    ASSERT_TRUE(lst.ok()) << lst.error_message();
    EXPECT_EQ(rec->lookup_on_device, 1);
    EXPECT_EQ(rec->lookup_keyed, 1);
    const std::vector<float> got = c.Reply(req), want = InlineLookup(ref.get(), {probe});
    EXPECT_EQ(got, want) << "step " << step;
    EXPECT_NE(std::count(want.begin(), want.end(), 0.0f), static_cast<long>(want.size()));
  }
}

}  // namespace
}  // namespace worker
}  // namespace ember
