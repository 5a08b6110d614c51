// What the parity suite (server/backend/backend_parity_test.cc) does not
// cover: the factory's failure codes, the name, the memory limit, a
// hand-computed fused step, concurrency. Where no GPU is usable every test
// checks the UNAVAILABLE answer and skips the rest. Built twice: against
// the CUDA runtime (cuda_backend_test) and against the host CUDA runtime
// (cuda_backend_on_host_test, EMBER_CUDA_ON_HOST), where it always runs.
#include "server/backend/cuda/cuda_backend.h"

#if __has_include(<cuda_runtime_api.h>)
#include <cuda_runtime_api.h>
#endif

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "cuda/device_query.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/backend/concurrency_checks.h"
#include "server/backend/key_value/key_value_backend.h"

#ifdef EMBER_CUDA_ON_HOST
#include "cuda/host_runtime.h"
#endif

namespace ember {
namespace backend {
namespace {


// The backend, or null after checking that its absence is UNAVAILABLE.
std::unique_ptr<EmbeddingBackend> MakeOrExpectUnavailable(const CudaBackendOptions& options) {
  auto be = CreateCudaBackend(options);
  if (be.ok()) return std::move(*be);
  EXPECT_EQ(be.status().code(), absl::StatusCode::kUnavailable) << be.status();
  EXPECT_FALSE(be.status().message().empty());
  return nullptr;
}

ShardSpec MakeSpec(int64_t rows, int64_t dim) {
  ShardSpec s;
  s.table = "t";
  s.rows = rows;
  s.dim = dim;
  s.table_rows = rows;
  s.optimizer.learning_rate = 0.5f;
  s.initializer.seed = 3;
  return s;
}

TEST(CudaBackendTest, NameOrUnavailable) {
  auto be = MakeOrExpectUnavailable({});
  if (be == nullptr) GTEST_SKIP() << "no usable GPU";
  EXPECT_THAT(be->Name(), testing::StartsWith("cuda/"));
  EXPECT_GT(be->Name().size(), 5u);
}

// Shard creation runs apart from the data calls (its own stream and
// staging; concurrency_checks.h).
TEST(CudaBackendTest, CreatingALargeShardDoesNotStallCallsOnOthers) {
  CudaBackendOptions o;
  o.memory_limit_bytes = int64_t{2} << 30;
  auto be = MakeOrExpectUnavailable(o);
  if (be == nullptr) GTEST_SKIP() << "no usable GPU";
  backend::ExpectCreationDoesNotStallCalls(be.get());
}

// Calls from several threads overlap (double-buffered staging: one call
// stages while the previous one's kernels run) and give what serial calls
// give: with the default scratch and batches of up to 3,000 bags (outputs
// of up to 1.6 MB, downloaded in several chunks), and with a small scratch
// where most calls run in pieces.
TEST(CudaBackendTest, ConcurrentCallsMatchSerialOnes) {
  if (MakeOrExpectUnavailable({}) == nullptr) GTEST_SKIP() << "no usable GPU";
#ifdef EMBER_CUDA_ON_HOST
  // The host runtime runs warps as fibers: fewer, smaller calls (the
  // downloads still go in several chunks at the largest).
  constexpr int kRounds = 8;
  constexpr int64_t kLargeBatch = 2100;
#else
  constexpr int kRounds = 40;
  constexpr int64_t kLargeBatch = 3000;
#endif
  for (const auto& [scratch, max_batch] :
       {std::pair<int64_t, int64_t>{kDefaultCudaScratchBytes, kLargeBatch},
        {int64_t{64} << 10, 300}}) {
    SCOPED_TRACE(scratch);
    backend::ExpectConcurrentCallsMatchSerial(
        [scratch = scratch] {
          CudaBackendOptions o;
          o.scratch_bytes = scratch;
          return MakeOrExpectUnavailable(o);
        },
        kRounds, max_batch);
  }
}

TEST(CudaBackendTest, RejectsBadOptions) {
  CudaBackendOptions o;
  o.device = -1;
  const absl::StatusCode want =
      cuda::BuiltWithCuda() ? absl::StatusCode::kInvalidArgument : absl::StatusCode::kUnavailable;
  EXPECT_EQ(CreateCudaBackend(o).status().code(), want);
  o.device = 0;
  o.memory_limit_bytes = -1;
  EXPECT_EQ(CreateCudaBackend(o).status().code(), want);
  o.memory_limit_bytes = 0;
  o.scratch_bytes = kMinCudaScratchBytes - 1;
  EXPECT_EQ(CreateCudaBackend(o).status().code(), want);
  o.scratch_bytes = kMinCudaScratchBytes;
  o.memory_limit_bytes = kMinCudaScratchBytes;  // nothing left for shards
  EXPECT_EQ(CreateCudaBackend(o).status().code(), want);
  o.memory_limit_bytes = 0;
  o.mapped_memory_limit_bytes = -1;
  EXPECT_EQ(CreateCudaBackend(o).status().code(), want);
  o.mapped_memory_limit_bytes = 0;
  o.device = 1 << 20;  // no machine has that many
  EXPECT_EQ(CreateCudaBackend(o).status().code(), absl::StatusCode::kUnavailable);
}

TEST(CudaBackendTest, MemoryLimit) {
  CudaBackendOptions o;
  o.scratch_bytes = kMinCudaScratchBytes;
  o.memory_limit_bytes = kMinCudaScratchBytes + 1000;  // 1000 bytes for shards
  auto be = MakeOrExpectUnavailable(o);
  if (be == nullptr) GTEST_SKIP() << "no usable GPU";
  auto a = be->CreateShard(MakeSpec(10, 8));  // 320 bytes
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(be->CreateShard(MakeSpec(100, 8)).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(be->DropShard(*a).ok());
  EXPECT_TRUE(be->CreateShard(MakeSpec(25, 8)).ok());  // 800 bytes once the first is gone
  EXPECT_EQ(be->AvailableBytes(), 200);
}

// fused_uvm (ShardSpec::host_mapped): the rows and state are in host
// memory mapped into the device, counted against the mapped budget and not
// the device's, and the shard answers exactly as one in device memory
// (lookups, an update, exports and imports). On the host runtime the
// blocks are checked to be mapped allocations (cuda::HostMappedBytes).
TEST(CudaBackendTest, MappedShardsLiveInHostMemory) {
  CudaBackendOptions o;
  o.scratch_bytes = int64_t{1} << 20;
  o.memory_limit_bytes = o.scratch_bytes + 1000;  // 1000 bytes for shards
  o.mapped_memory_limit_bytes = 2000;
  auto be = MakeOrExpectUnavailable(o);
  if (be == nullptr) GTEST_SKIP() << "no usable GPU";
  EXPECT_TRUE(be->MapsHostMemory());
  ShardSpec spec = MakeSpec(25, 8);  // 25 x (32 + 4) = 900 bytes
  spec.optimizer.type = OptimizerType::kRowwiseAdagrad;
  spec.optimizer.initial_accumulator_value = 0.25f;
  ShardSpec mapped_spec = spec;
  mapped_spec.host_mapped = true;
#ifdef EMBER_CUDA_ON_HOST
  const size_t mapped_before = cuda::HostMappedBytes();
#endif
  auto dev = be->CreateShard(spec);
  ASSERT_TRUE(dev.ok()) << dev.status();
  auto mapped = be->CreateShard(mapped_spec);
  ASSERT_TRUE(mapped.ok()) << mapped.status();  // past the device's 100 bytes left
  EXPECT_EQ(be->AvailableBytes(), 100);
  EXPECT_EQ(be->AvailableMappedBytes(), 1100);
#ifdef EMBER_CUDA_ON_HOST
  EXPECT_EQ(cuda::HostMappedBytes() - mapped_before, 900u);
#endif
  EXPECT_TRUE(be->GetShardSpec(*mapped)->host_mapped);
  ShardSpec big = mapped_spec;  // 1800 bytes with 1100 left
  big.rows = big.table_rows = 50;
  auto too_big = be->CreateShard(big);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted) << too_big.status();
  EXPECT_EQ(be->AvailableMappedBytes(), 1100);
  ShardSpec both = mapped_spec;
  both.cache_rows = 5;
  EXPECT_EQ(be->CreateShard(both).status().code(), absl::StatusCode::kInvalidArgument);

  // The same calls on both shards give the same bits.
  std::vector<int64_t> lengths = {3, 0, 2}, ids = {4, 4, 17, 24, 0};
  std::vector<float> weights = {0.5f, -1.0f, 2.0f, 1.5f, 0.25f};
  auto feature = [&](ShardId id) {
    FeatureRequest f;
    f.shard = id;
    f.pooling = Pooling::kSum;
    f.lengths = lengths;
    f.ids = ids;
    f.weights = weights;
    return f;
  };
  std::vector<float> grad(3 * 8);
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = 0.125f * static_cast<float>(i % 7) - 0.3f;
  auto run = [&](ShardId id, std::vector<float>* out, std::vector<float>* w,
                 std::vector<float>* st) {
    out->assign(3 * 8, 0.0f);
    absl::Status s = be->Lookup({LookupRequest{feature(id), absl::MakeSpan(*out)}});
    ASSERT_TRUE(s.ok()) << s;
    for (int step = 0; step < 2; ++step) {
      s = be->ApplyGradients({GradientRequest{feature(id), grad}});
      ASSERT_TRUE(s.ok()) << s;
    }
    w->assign(25 * 8, 0.0f);
    st->assign(25, 0.0f);
    s = be->ExportRows(id, 0, 25, absl::MakeSpan(*w), absl::MakeSpan(*st));
    ASSERT_TRUE(s.ok()) << s;
  };
  std::vector<float> out_d, w_d, st_d, out_m, w_m, st_m;
  run(*dev, &out_d, &w_d, &st_d);
  run(*mapped, &out_m, &w_m, &st_m);
  EXPECT_EQ(out_m, out_d);
  EXPECT_EQ(w_m, w_d);
  EXPECT_EQ(st_m, st_d);
  EXPECT_NE(st_m[4], 0.25f);  // the update reached the mapped state
  // Rows written and read anywhere in the mapped shard.
  std::vector<int64_t> at = {24, 3};
  std::vector<float> in_w(2 * 8, 1.5f), in_s = {2.0f, 3.0f}, got_w(2 * 8), got_s(2);
  ASSERT_TRUE(be->ImportRowsAt(*mapped, at, in_w, in_s).ok());
  ASSERT_TRUE(be->ExportRowsAt(*mapped, at, absl::MakeSpan(got_w), absl::MakeSpan(got_s)).ok());
  EXPECT_EQ(got_w, in_w);
  EXPECT_EQ(got_s, in_s);

  ASSERT_TRUE(be->DropShard(*mapped).ok());
  EXPECT_EQ(be->AvailableMappedBytes(), 2000);
  EXPECT_EQ(be->AvailableBytes(), 100);
#ifdef EMBER_CUDA_ON_HOST
  EXPECT_EQ(cuda::HostMappedBytes(), mapped_before);
#endif
}

// fused_uvm_caching on the adapter itself: the key_value wrapper's cache
// (a shard in device memory) over a fused_uvm shard, through the CUDA
// backend's row copies in and out of mapped memory. Lookups, Adam updates
// that evict changed rows, and the rows read back equal a shard held whole
// in device memory bit for bit.
TEST(CudaBackendTest, FusedUvmCachingEqualsTheShardInDeviceMemory) {
  CudaBackendOptions o;
  o.scratch_bytes = int64_t{1} << 20;
  auto whole = MakeOrExpectUnavailable(o);
  if (whole == nullptr) GTEST_SKIP() << "no usable GPU";
  auto made = CreateCudaBackend(o);
  ASSERT_TRUE(made.ok()) << made.status();
  auto cached = WithKeyValueShards(*std::move(made), KeyValueOptions());
  ASSERT_TRUE(cached->CachesOverHostMemory());
  ShardSpec spec = MakeSpec(64, 8);
  spec.optimizer.type = OptimizerType::kAdam;
  ShardSpec uvm = spec;
  uvm.host_mapped = true;
  uvm.cache_rows = 6;
  auto wid = whole->CreateShard(spec);
  auto cid = cached->CreateShard(uvm);
  ASSERT_TRUE(wid.ok() && cid.ok()) << wid.status() << cid.status();
  std::mt19937_64 rng(5);
  for (int step = 0; step < 12; ++step) {
    std::vector<int64_t> lengths = {2, 1, 3}, ids(6);
    for (int64_t& id : ids) id = static_cast<int64_t>(rng() % 64);
    std::vector<float> grad(3 * 8);
    for (float& g : grad) g = static_cast<float>(static_cast<int64_t>(rng() % 200) - 100) / 64.0f;
    std::vector<float> out_w(3 * 8), out_c(3 * 8);
    FeatureRequest f;
    f.pooling = Pooling::kMean;
    f.lengths = lengths;
    f.ids = ids;
    f.shard = *wid;
    ASSERT_TRUE(whole->Lookup({LookupRequest{f, absl::MakeSpan(out_w)}}).ok());
    ASSERT_TRUE(whole->ApplyGradients({GradientRequest{f, grad}}).ok());
    f.shard = *cid;
    ASSERT_TRUE(cached->Lookup({LookupRequest{f, absl::MakeSpan(out_c)}}).ok());
    ASSERT_TRUE(cached->ApplyGradients({GradientRequest{f, grad}}).ok());
    EXPECT_EQ(out_c, out_w) << "step " << step;
  }
  std::vector<float> w_w(64 * 8), st_w(64 * 16), w_c(64 * 8), st_c(64 * 16);
  ASSERT_TRUE(whole->ExportRows(*wid, 0, 64, absl::MakeSpan(w_w), absl::MakeSpan(st_w)).ok());
  ASSERT_TRUE(cached->ExportRows(*cid, 0, 64, absl::MakeSpan(w_c), absl::MakeSpan(st_c)).ok());
  EXPECT_EQ(w_c, w_w);
  EXPECT_EQ(st_c, st_w);
  auto tier = cached->GetTierStats(*cid);
  ASSERT_TRUE(tier.ok()) << tier.status();
  EXPECT_GT(tier->write_backs, 0);  // changed rows went back to host memory
  EXPECT_GT(tier->disk_reads, 0);   // and came from it
}

// Two requests on one shard in one call, row 1 in both: SGD must apply the
// summed gradient once. Worked by hand: SUM bag {1, 1} with grad 1 gives
// row 1 a gradient of 2; MEAN bag {1, 2} with grad 4 gives rows 1 and 2 a
// gradient of 2 each. Row 1 moves by lr * 4, row 2 by lr * 2.
TEST(CudaBackendTest, DuplicatesAcrossRequestsAreMergedOnce) {
  auto be = MakeOrExpectUnavailable({});
  if (be == nullptr) GTEST_SKIP() << "no usable GPU";
  const ShardSpec spec = MakeSpec(4, 4);
  auto id = be->CreateShard(spec);
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<float> w0(16), none;
  ASSERT_TRUE(be->ExportRows(*id, 0, 4, absl::MakeSpan(w0), absl::MakeSpan(none)).ok());

  // Lookup: SUM of {1, 1} is twice row 1.
  std::vector<int64_t> len_a = {2}, ids_a = {1, 1}, len_b = {2}, ids_b = {1, 2};
  FeatureRequest fa, fb;
  fa.shard = fb.shard = *id;
  fa.pooling = Pooling::kSum;
  fa.lengths = len_a;
  fa.ids = ids_a;
  fb.pooling = Pooling::kMean;
  fb.lengths = len_b;
  fb.ids = ids_b;
  std::vector<float> out_a(4), out_b(4);
  ASSERT_TRUE(be->Lookup({LookupRequest{fa, absl::MakeSpan(out_a)},
                          LookupRequest{fb, absl::MakeSpan(out_b)}})
                  .ok());
  for (int c = 0; c < 4; ++c) {
    EXPECT_FLOAT_EQ(out_a[c], 2 * w0[4 + c]);
    EXPECT_FLOAT_EQ(out_b[c], (w0[4 + c] + w0[8 + c]) * 0.5f);
  }

  std::vector<float> grad_a(4, 1.0f), grad_b(4, 4.0f);
  ASSERT_TRUE(be->ApplyGradients({GradientRequest{fa, grad_a}, GradientRequest{fb, grad_b}}).ok());
  std::vector<float> w1(16);
  ASSERT_TRUE(be->ExportRows(*id, 0, 4, absl::MakeSpan(w1), absl::MakeSpan(none)).ok());
  for (int c = 0; c < 4; ++c) {
    EXPECT_EQ(w1[c], w0[c]);
    EXPECT_FLOAT_EQ(w1[4 + c], w0[4 + c] - 0.5f * 4);
    EXPECT_FLOAT_EQ(w1[8 + c], w0[8 + c] - 0.5f * 2);
    EXPECT_EQ(w1[12 + c], w0[12 + c]);
  }
  EXPECT_EQ(*be->ExportStep(*id), 1);
}

// Outputs on the device (LookupRequest::output_on_device, what a worker
// does with a link channel's device memory): the same values as through
// the host, never through it; a call mixing the two is refused.
TEST(CudaBackendTest, OutputsGoStraightToDeviceMemory) {
#if __has_include(<cuda_runtime_api.h>)
  auto be = MakeOrExpectUnavailable({});
  if (be == nullptr) GTEST_SKIP() << "no usable GPU";
  EXPECT_EQ(be->OutputMemory(), EmbeddingBackend::Memory::kCudaDevice);
  auto id = be->CreateShard(MakeSpec(8, 8));
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<int64_t> len_a = {2, 0, 1}, ids_a = {1, 7, 3}, len_b = {3}, ids_b = {0, 2, 2};
  const FeatureRequest fa{*id, Pooling::kSum, len_a, ids_a, {}};
  const FeatureRequest fb{*id, Pooling::kMean, len_b, ids_b, {}};
  std::vector<float> want(4 * 8);
  ASSERT_TRUE(be->Lookup({LookupRequest{fa, absl::MakeSpan(want.data(), 24)},
                          LookupRequest{fb, absl::MakeSpan(want.data() + 24, 8)}})
                  .ok());
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), want.size() * sizeof(float)),
            cudaSuccess);
  LookupRequest a{fa, absl::MakeSpan(device, 24)}, b{fb, absl::MakeSpan(device + 24, 8)};
  a.output_on_device = b.output_on_device = true;
  ASSERT_TRUE(be->Lookup({a, b}).ok());
  std::vector<float> got(want.size(), -1.0f);
  ASSERT_EQ(cudaMemcpyAsync(got.data(), device, got.size() * sizeof(float),
                            cudaMemcpyDeviceToHost, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  EXPECT_EQ(got, want);
  b.output_on_device = false;
  b.output = absl::MakeSpan(got.data() + 24, 8);
  const absl::Status mixed = be->Lookup({a, b});
  EXPECT_EQ(mixed.code(), absl::StatusCode::kInvalidArgument) << mixed;
  EXPECT_EQ(cudaFree(device), cudaSuccess);
#else
  GTEST_SKIP() << "built without the CUDA toolkit";
#endif
}

// A lookup with outputs on the device that the smallest scratch must cut
// into pieces (as a large call through an NCCL link channel is): every
// piece's outputs land in device memory, the last one's too, with the
// values a lookup through the host gives.
TEST(CudaBackendTest, DeviceOutputsOfACallCutInPieces) {
#if __has_include(<cuda_runtime_api.h>)
  CudaBackendOptions o;
  o.scratch_bytes = kMinCudaScratchBytes;
  auto be = MakeOrExpectUnavailable(o);
  if (be == nullptr) GTEST_SKIP() << "no usable GPU";
  auto id = be->CreateShard(MakeSpec(1000, 16));
  ASSERT_TRUE(id.ok()) << id.status();
  const int64_t bags = 3000;
  std::vector<int64_t> lengths(bags, 5), ids(bags * 5), none_lengths(700, 1), none_ids(700);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 7919) % 1000);
  for (size_t i = 0; i < none_ids.size(); ++i) none_ids[i] = static_cast<int64_t>(i % 1000);
  const FeatureRequest pooled{*id, Pooling::kSum, lengths, ids, {}};
  const FeatureRequest per_id{*id, Pooling::kNone, none_lengths, none_ids, {}};
  const size_t pooled_floats = bags * 16, total = pooled_floats + none_ids.size() * 16;
  std::vector<float> want(total);
  ASSERT_TRUE(be->Lookup({LookupRequest{pooled, absl::MakeSpan(want.data(), pooled_floats)},
                          LookupRequest{per_id, absl::MakeSpan(want.data() + pooled_floats,
                                                               total - pooled_floats)}})
                  .ok());
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), total * sizeof(float)), cudaSuccess);
  std::vector<float> got(total, -1.0f);  // poison: every float must be written
  ASSERT_EQ(cudaMemcpyAsync(device, got.data(), total * sizeof(float), cudaMemcpyHostToDevice,
                            nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  LookupRequest a{pooled, absl::MakeSpan(device, pooled_floats)};
  LookupRequest b{per_id, absl::MakeSpan(device + pooled_floats, total - pooled_floats)};
  a.output_on_device = b.output_on_device = true;
  ASSERT_TRUE(be->Lookup({a, b}).ok());
  ASSERT_EQ(cudaMemcpyAsync(got.data(), device, total * sizeof(float), cudaMemcpyDeviceToHost,
                            nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  EXPECT_EQ(got, want);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
#else
  GTEST_SKIP() << "built without the CUDA toolkit";
#endif
}

// Inputs in device memory (FeatureRequest::on_device) with the outputs in
// device memory too, as a worker lays out an NCCL link's memory: the same
// values as from the host; an output over the call's ids is refused (a
// later piece of the call would read earlier outputs as its ids).
TEST(CudaBackendTest, DeviceInputsAndOutputsMayNotOverlap) {
#if __has_include(<cuda_runtime_api.h>)
  auto be = MakeOrExpectUnavailable({});
  if (be == nullptr) GTEST_SKIP() << "no usable GPU";
  auto id = be->CreateShard(MakeSpec(8, 8));
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<int64_t> lengths = {2, 0, 1}, ids = {1, 7, 3};
  std::vector<float> want(3 * 8);
  ASSERT_TRUE(
      be->Lookup({LookupRequest{FeatureRequest{*id, Pooling::kSum, lengths, ids, {}},
                                absl::MakeSpan(want)}})
          .ok());
  // One block: outputs at 0, ids at 512 bytes.
  char* device = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device), 4096), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(device + 512, ids.data(), ids.size() * sizeof(int64_t),
                            cudaMemcpyHostToDevice, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  FeatureRequest f{*id, Pooling::kSum, lengths,
                   absl::MakeConstSpan(reinterpret_cast<const int64_t*>(device + 512), ids.size()),
                   {}};
  f.on_device = true;
  LookupRequest r{f, absl::MakeSpan(reinterpret_cast<float*>(device), want.size())};
  r.output_on_device = true;
  ASSERT_TRUE(be->Lookup({r}).ok());
  std::vector<float> got(want.size());
  ASSERT_EQ(cudaMemcpyAsync(got.data(), device, got.size() * sizeof(float),
                            cudaMemcpyDeviceToHost, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  EXPECT_EQ(got, want);
  // The output's last row over the ids.
  r.output = absl::MakeSpan(reinterpret_cast<float*>(device + 448), want.size());
  const absl::Status overlap = be->Lookup({r});
  EXPECT_EQ(overlap.code(), absl::StatusCode::kInvalidArgument) << overlap;
  EXPECT_THAT(std::string(overlap.message()), ::testing::HasSubstr("overlaps the call's ids"));
  // Device inputs to a host output: fine (only device memory is read).
  LookupRequest host_out{f, absl::MakeSpan(got)};
  std::fill(got.begin(), got.end(), -1.0f);
  ASSERT_TRUE(be->Lookup({host_out}).ok());
  EXPECT_EQ(got, want);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
#else
  GTEST_SKIP() << "built without the CUDA toolkit";
#endif
}

}  // namespace
}  // namespace backend
}  // namespace ember
