// One parity suite for every backend available, against a naive
// double-precision reference written here from the formulas in
// embedding_backend.h. The CUDA backend joins the parameter list when built.
#include <algorithm>
#include <cmath>
#include <limits>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "math/half.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cpu/cpu_kernels.h"
#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/cuda/emulated_backend.h"
#include "server/backend/dynamic/dynamic_backend.h"
#include "server/backend/embedding_backend.h"
#include "server/backend/forwarding_backend.h"

#if __has_include(<cuda_runtime_api.h>)
#include <cuda_runtime_api.h>
#endif

namespace ember {
namespace backend {
namespace {

// Small enough that most of the suite's gradient calls and its larger
// lookups are cut into pieces; large enough for its largest bag and all but
// the hottest row (HotRowsMatchFormulas expects that call refused).
constexpr size_t kSplitScratchBytes = 8 << 10;
// On a GPU CUB's temporary storage (the radix sort's histograms) takes more
// of a small scratch than the emulation's stand-in does.
constexpr size_t kCudaSplitScratchBytes = 64 << 10;

struct BackendParam {
  std::string name;
  std::function<absl::StatusOr<std::unique_ptr<EmbeddingBackend>>()> make;
  size_t scratch_bytes = 0;  // a fixed scratch calls are cut to fit; 0: none
  // The dims it takes are multiples of this: 1 for the CPU backend (any
  // dim, as TorchRec's CPU modules), kCudaColumnMultiple for the CUDA
  // kernels and their emulation.
  int column_multiple = kCudaColumnMultiple;
};

#if __has_include(<cuda_runtime_api.h>)
// A backend reading its inputs from device memory (FeatureRequest::
// on_device), as a worker hands it a link channel's: each call's ids,
// weights and gradients are copied into device memory first.
class DeviceInputsBackend : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

  absl::Status Lookup(absl::Span<const LookupRequest> requests) override {
    Copies c;
    std::vector<LookupRequest> r(requests.begin(), requests.end());
    for (LookupRequest& x : r) c.Move(&x.feature);
    if (!c.status.ok()) return c.status;
    return inner()->Lookup(r);
  }
  absl::Status ApplyGradients(absl::Span<const GradientRequest> requests) override {
    Copies c;
    std::vector<GradientRequest> r(requests.begin(), requests.end());
    for (GradientRequest& x : r) {
      c.Move(&x.feature);
      x.grad = c.Copy(x.grad);
    }
    if (!c.status.ok()) return c.status;
    return inner()->ApplyGradients(r);
  }

 private:
  // Device copies, freed with it.
  struct Copies {
    std::vector<void*> blocks;
    absl::Status status;
    ~Copies() {
      for (void* p : blocks) cudaFree(p);
    }
    template <typename T>
    absl::Span<const T> Copy(absl::Span<const T> host) {
      if (host.empty() || !status.ok()) return {};
      void* p = nullptr;
      const size_t bytes = host.size() * sizeof(T);
      if (cudaMalloc(&p, bytes) != cudaSuccess ||
          cudaMemcpyAsync(p, host.data(), bytes, cudaMemcpyHostToDevice, nullptr) != cudaSuccess ||
          cudaStreamSynchronize(nullptr) != cudaSuccess) {
        status = absl::InternalError("device copy of a test input failed");
      }
      if (p != nullptr) blocks.push_back(p);
      return absl::Span<const T>(static_cast<const T*>(p), host.size());
    }
    void Move(FeatureRequest* f) {
      f->ids = Copy(f->ids);
      f->weights = Copy(f->weights);
      f->on_device = true;
    }
  };
};
#endif

// A backend whose every shard is created fused_uvm (ShardSpec::
// host_mapped: rows and state in host memory mapped into the device).
class MappedShardsBackend : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::StatusOr<ShardId> CreateShard(const ShardSpec& spec) override {
    ShardSpec mapped = spec;
    mapped.host_mapped = true;
    return inner()->CreateShard(mapped);
  }
};

// The CUDA backend as `name`, whole and (`name`_split) with a scratch of
// `split_bytes`, so small that most calls run in pieces; both again
// (`name`_device_inputs...) reading their inputs from device memory; and
// whole with every shard fused_uvm (`name`_uvm).
void AddCudaBackend(const std::string& name, size_t split_bytes, std::vector<BackendParam>* out) {
  auto make = [](size_t scratch_bytes, bool device_inputs)
      -> absl::StatusOr<std::unique_ptr<EmbeddingBackend>> {
    backend::CudaBackendOptions o;
    if (scratch_bytes > 0) o.scratch_bytes = static_cast<int64_t>(scratch_bytes);
    auto be = backend::CreateCudaBackend(o);
#if __has_include(<cuda_runtime_api.h>)
    if (be.ok() && device_inputs) {
      return std::unique_ptr<EmbeddingBackend>(new DeviceInputsBackend(*std::move(be)));
    }
#endif
    return be;
  };
#if __has_include(<cuda_runtime_api.h>)
  const std::vector<bool> input_kinds = {false, true};  // host, device
#else
  const std::vector<bool> input_kinds = {false};
#endif
  for (const bool device_inputs : input_kinds) {
    const std::string n = device_inputs ? name + "_device_inputs" : name;
    out->push_back({n, [make, device_inputs] { return make(0, device_inputs); }});
    out->push_back({n + "_split",
                    [make, split_bytes, device_inputs] { return make(split_bytes, device_inputs); },
                    split_bytes});
  }
  out->push_back({name + "_uvm", [make]() -> absl::StatusOr<std::unique_ptr<EmbeddingBackend>> {
                    auto be = make(0, false);
                    if (!be.ok()) return be.status();
                    return std::unique_ptr<EmbeddingBackend>(
                        new MappedShardsBackend(*std::move(be)));
                  }});
}

std::vector<BackendParam> AvailableBackends() {
  std::vector<BackendParam> out;
#ifdef EMBER_CUDA_ON_HOST
  // backend_parity_on_host_test: the CUDA backend's adapter itself, on the
  // host CUDA runtime (cuda/host_runtime.h), which needs no temporary
  // storage for CUB. The others run in backend_parity_test.
  AddCudaBackend("cuda_on_host", kSplitScratchBytes, &out);
  return out;
#endif
  for (const std::string isa : {"scalar", "avx2", "avx512"}) {
    if (!RowKernelsFor(isa).ok()) continue;  // this CPU lacks it
    for (int threads : {1, 3}) {
      CpuBackendOptions o;
      o.isa = isa;
      o.num_threads = threads;
      out.push_back(
          {absl::StrCat("cpu_", isa, "_", threads, "t"), [o] { return CreateCpuBackend(o); }, 0, 1});
    }
  }
  // The CUDA kernels' algorithms on the CPU (kernel_bodies.h with HostWarp),
  // in every build.
  out.push_back({"cuda_emulated", [] {
                   return absl::StatusOr<std::unique_ptr<EmbeddingBackend>>(
                       backend::CreateEmulatedCudaBackend());
                 }});
  // The same with a scratch so small that most calls run in pieces
  // (server/backend/cuda/call_split.h), as calls larger than a GPU's scratch do.
  out.push_back({"cuda_emulated_split", [] {
                   backend::EmulatedCudaOptions o;
                   o.scratch_bytes = kSplitScratchBytes;
                   return absl::StatusOr<std::unique_ptr<EmbeddingBackend>>(
                       backend::CreateEmulatedCudaBackend(o));
                 },
                 kSplitScratchBytes});
  // The CUDA backend joins wherever a GPU is visible (never in CI here).
  if (backend::CreateCudaBackend({}).ok()) AddCudaBackend("cuda", kCudaSplitScratchBytes, &out);
  return out;
}

// A jagged feature built in the test.
struct Jagged {
  std::vector<int64_t> lengths, ids;
  std::vector<float> weights;
};

Jagged RandomJagged(std::mt19937& rng, int batch, int64_t rows, int max_len, bool weighted) {
  Jagged j;
  for (int b = 0; b < batch; ++b) {
    const int len = (rng() % 4 == 0) ? 0 : static_cast<int>(rng() % (max_len + 1));
    j.lengths.push_back(len);
    for (int k = 0; k < len; ++k) {
      // Small id range sometimes, to force duplicates within and across bags.
      j.ids.push_back(static_cast<int64_t>(rng() % (rng() % 2 ? std::min<int64_t>(rows, 5) : rows)));
      if (weighted) j.weights.push_back(std::uniform_real_distribution<float>(-2, 2)(rng));
    }
  }
  return j;
}

FeatureRequest Feature(ShardId shard, Pooling p, const Jagged& j) {
  FeatureRequest f;
  f.shard = shard;
  f.pooling = p;
  f.lengths = j.lengths;
  f.ids = j.ids;
  f.weights = j.weights;
  return f;
}

// Reference shard state in double.
struct RefShard {
  ShardSpec spec;
  std::vector<double> w, state;  // [rows, dim], [rows, width]
  int64_t width = 0;
  int64_t step = 0;
};

std::vector<float> Export(EmbeddingBackend* be, ShardId id, const ShardSpec& spec,
                          std::vector<float>* state = nullptr) {
  std::vector<float> w(spec.rows * spec.dim);
  std::vector<float> st(spec.rows * OptimizerStateWidth(spec.optimizer.type, spec.dim));
  EXPECT_TRUE(be->ExportRows(id, 0, spec.rows, absl::MakeSpan(w), absl::MakeSpan(st)).ok());
  if (state) *state = st;
  return w;
}

RefShard MakeRef(EmbeddingBackend* be, ShardId id, const ShardSpec& spec) {
  RefShard r;
  r.spec = spec;
  r.width = OptimizerStateWidth(spec.optimizer.type, spec.dim);
  std::vector<float> st;
  std::vector<float> w = Export(be, id, spec, &st);
  r.w.assign(w.begin(), w.end());
  r.state.assign(st.begin(), st.end());
  return r;
}

std::vector<double> RefLookup(const RefShard& s, Pooling p, const Jagged& j) {
  const int64_t dim = s.spec.dim;
  std::vector<double> out;
  size_t k = 0;
  for (int64_t len : j.lengths) {
    if (p == Pooling::kNone) {
      for (int64_t i = 0; i < len; ++i, ++k) {
        for (int64_t c = 0; c < dim; ++c) out.push_back(s.w[j.ids[k] * dim + c]);
      }
      continue;
    }
    std::vector<double> acc(dim, 0.0);
    for (int64_t i = 0; i < len; ++i, ++k) {
      const double wt = j.weights.empty() ? 1.0 : j.weights[k];
      for (int64_t c = 0; c < dim; ++c) acc[c] += wt * s.w[j.ids[k] * dim + c];
    }
    if (p == Pooling::kMean && len > 0) {
      for (double& v : acc) v /= len;
    }
    out.insert(out.end(), acc.begin(), acc.end());
  }
  return out;
}

// Adds each id's gradient contribution to `merged` (row -> grad).
void RefExpand(const RefShard& s, Pooling p, const Jagged& j, const std::vector<float>& grad,
               std::map<int64_t, std::vector<double>>* merged) {
  const int64_t dim = s.spec.dim;
  size_t k = 0;
  for (size_t b = 0; b < j.lengths.size(); ++b) {
    const int64_t len = j.lengths[b];
    for (int64_t i = 0; i < len; ++i, ++k) {
      double scale = 1.0;
      const float* src;
      if (p == Pooling::kNone) {
        src = grad.data() + k * dim;
      } else {
        src = grad.data() + b * dim;
        if (!j.weights.empty()) scale = j.weights[k];
        if (p == Pooling::kMean) scale /= len;
      }
      auto& g = (*merged)[j.ids[k]];
      g.resize(dim, 0.0);
      for (int64_t c = 0; c < dim; ++c) g[c] += scale * src[c];
    }
  }
}

void RefUpdate(RefShard* s, std::map<int64_t, std::vector<double>>& merged) {
  const OptimizerConfig& o = s->spec.optimizer;
  const int64_t dim = s->spec.dim;
  ++s->step;  // every call that names the shard counts, ids or not
  for (auto& [row, g] : merged) {
    double* w = &s->w[row * dim];
    double* st = s->width ? &s->state[row * s->width] : nullptr;
    // FBGEMM's weight decay: L2 enters the gradient; DECOUPLE shrinks the
    // weight (Adagrad variants) or joins Adam's step. The default is
    // DECOUPLE for Adam and L2 otherwise; SGD has none.
    const double wd = o.type == OptimizerType::kSgd ? 0 : o.weight_decay;
    const bool decouple = o.weight_decay_mode == WeightDecayMode::kDecouple ||
                          (o.weight_decay_mode == WeightDecayMode::kDefault &&
                           o.type == OptimizerType::kAdam);
    if (!decouple) {
      for (int64_t c = 0; c < dim; ++c) g[c] += wd * w[c];
    }
    const double keep = decouple ? 1 - o.learning_rate * wd : 1;
    switch (o.type) {
      case OptimizerType::kSgd:
        for (int64_t c = 0; c < dim; ++c) w[c] -= o.learning_rate * g[c];
        break;
      case OptimizerType::kAdagrad:
        for (int64_t c = 0; c < dim; ++c) {
          st[c] += g[c] * g[c];
          w[c] = keep * w[c] - o.learning_rate * g[c] / (std::sqrt(st[c]) + o.eps);
        }
        break;
      case OptimizerType::kRowwiseAdagrad: {
        double sq = 0;
        for (double v : g) sq += v * v;
        st[0] += sq / dim;
        for (int64_t c = 0; c < dim; ++c) {
          w[c] = keep * w[c] - o.learning_rate * g[c] / (std::sqrt(st[0]) + o.eps);
        }
        break;
      }
      case OptimizerType::kAdam: {
        const double c1 = 1 - std::pow(o.beta1, s->step), c2 = 1 - std::pow(o.beta2, s->step);
        for (int64_t c = 0; c < dim; ++c) {
          st[c] = o.beta1 * st[c] + (1 - o.beta1) * g[c];
          st[dim + c] = o.beta2 * st[dim + c] + (1 - o.beta2) * g[c] * g[c];
          w[c] -= o.learning_rate * ((st[c] / c1) / (std::sqrt(st[dim + c] / c2) + o.eps) +
                                     (decouple ? wd * w[c] : 0.0));
        }
        break;
      }
    }
  }
}

ShardSpec MakeSpec(int64_t rows, int64_t dim, WeightType wt = WeightType::kFp32,
                   OptimizerType opt = OptimizerType::kSgd) {
  ShardSpec s;
  s.table = "t";
  s.rows = rows;
  s.dim = dim;
  s.table_rows = rows;
  s.weight_type = wt;
  s.optimizer.type = opt;
  s.optimizer.learning_rate = 0.05f;
  s.optimizer.eps = 1e-6f;
  s.initializer.seed = 42;
  return s;
}

// Relative tolerance of stored weights by type (fp16: 11-bit mantissa,
// bf16: 8-bit), applied to the magnitude of the values compared.
double WeightTolerance(WeightType t) {
  switch (t) {
    case WeightType::kFp16:
      return 2e-3;
    case WeightType::kBf16:
      return 1.6e-2;
    default:
      return 2e-5;
  }
}

class BackendParityTest : public testing::TestWithParam<BackendParam> {
 protected:
  void SetUp() override {
    auto be = GetParam().make();
    ASSERT_TRUE(be.ok()) << be.status();
    be_ = std::move(*be);
  }
  std::unique_ptr<EmbeddingBackend> be_;
};

TEST_P(BackendParityTest, PooledAndSequenceLookupsMatchReference) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 24; ++trial) {
    const WeightType wt = static_cast<WeightType>(trial % 3);
    const int column_multiple = GetParam().column_multiple;
    const int64_t rows = 1 + rng() % 300;
    const int64_t dim = column_multiple * (1 + rng() % (160 / column_multiple));
    const ShardSpec spec = MakeSpec(rows, dim, wt);
    auto id = be_->CreateShard(spec);
    ASSERT_TRUE(id.ok()) << id.status();
    const RefShard ref = MakeRef(be_.get(), *id, spec);
    for (Pooling p : {Pooling::kSum, Pooling::kMean, Pooling::kNone}) {
      const bool weighted = p != Pooling::kNone && rng() % 2;
      const int batch = static_cast<int>(rng() % 20);  // 0: a feature with no bags
      const Jagged j = RandomJagged(rng, batch, rows, 30, weighted);
      const FeatureRequest f = Feature(*id, p, j);
      std::vector<float> out(OutputSize(f, dim), -7.0f);
      ASSERT_TRUE(be_->Lookup({LookupRequest{f, absl::MakeSpan(out)}}).ok());
      const std::vector<double> want = RefLookup(ref, p, j);
      ASSERT_EQ(out.size(), want.size());
      for (size_t i = 0; i < out.size(); ++i) {
        EXPECT_NEAR(out[i], want[i], 1e-5 * (1 + std::abs(want[i])) * 31)
            << "trial " << trial << " pooling " << static_cast<int>(p) << " at " << i;
      }
    }
  }
}

// A shard past 2 MiB (the CPU backend's huge-page allocation) with long
// bags, so prefetching runs across bag boundaries and to the last id.
TEST_P(BackendParityTest, LargeShardLongBagsMatchReference) {
  std::mt19937 rng(7);
  for (WeightType wt : {WeightType::kFp32, WeightType::kBf16}) {
    const ShardSpec spec = MakeSpec(20000, 68, wt);  // 5.4 MB fp32; 68 = 64 + a 4-column tail
    auto id = be_->CreateShard(spec);
    ASSERT_TRUE(id.ok()) << id.status();
    const RefShard ref = MakeRef(be_.get(), *id, spec);
    for (Pooling p : {Pooling::kSum, Pooling::kMean, Pooling::kNone}) {
      const Jagged j = RandomJagged(rng, 300, spec.rows, 40, p == Pooling::kMean);
      const FeatureRequest f = Feature(*id, p, j);
      std::vector<float> out(OutputSize(f, spec.dim), -7.0f);
      ASSERT_TRUE(be_->Lookup({LookupRequest{f, absl::MakeSpan(out)}}).ok());
      const std::vector<double> want = RefLookup(ref, p, j);
      ASSERT_EQ(out.size(), want.size());
      for (size_t i = 0; i < out.size(); ++i) {
        ASSERT_NEAR(out[i], want[i], 1e-5 * (1 + std::abs(want[i])) * 41)
            << "pooling " << static_cast<int>(p) << " at " << i;
      }
    }
  }
}

// Lookups into rows of a wider matrix (output_stride, as the in-process
// collection pools into a KeyedTensor's columns and a worker into a
// client's): exactly what packed lookups write, at the stride, and nothing
// between the rows, also for calls cut in pieces (the bags and ids
// overflow the split instances' scratch), beside a packed request in the
// same call. Bad strides are refused with nothing written. Backends that
// write packed rows only refuse any stride.
TEST_P(BackendParityTest, StridedOutputsMatchPackedOnes) {
  std::mt19937 rng(12);
  // Rows at matrix + 7 + r * 33; 19 columns where the backend takes any dim
  // (the last 3 gathered one by one must stop at the row's end too).
  const int64_t dim = GetParam().column_multiple == 1 ? 19 : 20, stride = 33, at = 7;
  // The fp32 pass has 14,000 bags: 1.1 MB of outputs, which the CUDA
  // backend downloads in more than one 1 MiB chunk, the first ending
  // inside a row.
  for (WeightType wt : {WeightType::kFp32, WeightType::kFp16}) {
    const ShardSpec spec = MakeSpec(3000, dim, wt);
    auto id = be_->CreateShard(spec);
    ASSERT_TRUE(id.ok()) << id.status();
    const int bags = wt == WeightType::kFp32 ? 14000 : 700;
    const Jagged pooled = RandomJagged(rng, bags, spec.rows, wt == WeightType::kFp32 ? 3 : 16,
                                       /*weighted=*/true);
    const Jagged per_id = RandomJagged(rng, 300, spec.rows, 6, /*weighted=*/false);
    const FeatureRequest fp = Feature(*id, Pooling::kSum, pooled);
    const FeatureRequest fn = Feature(*id, Pooling::kNone, per_id);
    std::vector<float> want_p(OutputSize(fp, dim)), want_n(OutputSize(fn, dim));
    ASSERT_TRUE(be_->Lookup({LookupRequest{fp, absl::MakeSpan(want_p)},
                             LookupRequest{fn, absl::MakeSpan(want_n)}})
                    .ok());
    const int64_t rows = static_cast<int64_t>(want_p.size()) / dim;
    std::vector<float> matrix(rows * stride + at, -7.5f), packed(want_n.size(), -7.5f);
    LookupRequest strided{fp, absl::MakeSpan(matrix.data() + at, (rows - 1) * stride + dim)};
    strided.output_stride = stride;
    const absl::Status st =
        be_->Lookup({strided, LookupRequest{fn, absl::MakeSpan(packed)}});
    if (!be_->WritesStridedOutputs()) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_THAT(std::string(st.message()), testing::HasSubstr("packed outputs"));
      EXPECT_TRUE(std::all_of(matrix.begin(), matrix.end(), [](float x) { return x == -7.5f; }));
      continue;
    }
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(packed, want_n);
    for (int64_t i = 0; i < static_cast<int64_t>(matrix.size()); ++i) {
      const int64_t r = (i - at) / stride, c = (i - at) % stride;
      if (i >= at && c < dim && r < rows) {
        ASSERT_EQ(matrix[i], want_p[r * dim + c]) << "row " << r << " col " << c;
      } else {
        ASSERT_EQ(matrix[i], -7.5f) << "element " << i << " between rows was written";
      }
    }
    // Refused: a stride below the dim, a buffer that stops short of the
    // last row's end; nothing written, the packed request beside it neither.
    const std::vector<float> before = matrix;
    LookupRequest narrow = strided;
    narrow.output_stride = dim - 1;
    LookupRequest short_buffer = strided;
    short_buffer.output = short_buffer.output.subspan(0, short_buffer.output.size() - 1);
    for (const LookupRequest& bad : {narrow, short_buffer}) {
      std::fill(packed.begin(), packed.end(), -7.5f);
      const absl::Status s = be_->Lookup({LookupRequest{fn, absl::MakeSpan(packed)}, bad});
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_EQ(matrix, before);
      EXPECT_TRUE(std::all_of(packed.begin(), packed.end(), [](float x) { return x == -7.5f; }));
    }
  }
}

// Adam's step counts calls that name the shard, even with no ids (so a
// row-wise shard that got no ids in a batch stays in step with the table),
// and such a call changes no weight.
TEST_P(BackendParityTest, StepCountsCallsWithNoIds) {
  const ShardSpec spec = MakeSpec(6, 4, WeightType::kFp32, OptimizerType::kAdam);
  auto id = be_->CreateShard(spec);
  ASSERT_TRUE(id.ok());
  const std::vector<float> before = Export(be_.get(), *id, spec);
  Jagged j;
  j.lengths = {0, 0};
  const std::vector<float> grad(2 * 4, 1.0f);
  ASSERT_TRUE(be_->ApplyGradients({GradientRequest{Feature(*id, Pooling::kSum, j), grad}}).ok());
  ASSERT_TRUE(be_->ApplyGradients({GradientRequest{Feature(*id, Pooling::kSum, j), grad}}).ok());
  EXPECT_EQ(*be_->ExportStep(*id), 2);
  EXPECT_EQ(Export(be_.get(), *id, spec), before);
}

TEST_P(BackendParityTest, MeanOfEmptyBagIsZeroAndEmptyFeatureIsFine) {
  const ShardSpec spec = MakeSpec(10, 8);
  auto id = be_->CreateShard(spec);
  ASSERT_TRUE(id.ok());
  Jagged j;
  j.lengths = {0, 2, 0};
  j.ids = {3, 3};
  const FeatureRequest f = Feature(*id, Pooling::kMean, j);
  std::vector<float> out(3 * 8, 9.0f);
  ASSERT_TRUE(be_->Lookup({LookupRequest{f, absl::MakeSpan(out)}}).ok());
  const std::vector<float> w = Export(be_.get(), *id, spec);
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(out[c], 0.0f);
    EXPECT_FLOAT_EQ(out[8 + c], w[3 * 8 + c]);
    EXPECT_EQ(out[16 + c], 0.0f);
  }
  Jagged none;  // no bags at all
  std::vector<float> empty;
  EXPECT_TRUE(be_->Lookup({LookupRequest{Feature(*id, Pooling::kSum, none), absl::MakeSpan(empty)}}).ok());
}

TEST_P(BackendParityTest, FusedCallOverManyShardsAndFeatures) {
  std::mt19937 rng(2);
  std::vector<ShardSpec> specs = {MakeSpec(50, 16), MakeSpec(7, 4, WeightType::kFp16),
                                  MakeSpec(300, 64, WeightType::kBf16)};
  std::vector<ShardId> ids;
  std::vector<RefShard> refs;
  for (const auto& s : specs) {
    auto id = be_->CreateShard(s);
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
    refs.push_back(MakeRef(be_.get(), *id, s));
  }
  std::vector<Jagged> js;
  std::vector<std::pair<int, Pooling>> which;
  for (int k = 0; k < 9; ++k) {
    const int s = k % 3;
    const Pooling p = static_cast<Pooling>(k / 3);
    which.push_back({s, p});
    js.push_back(RandomJagged(rng, 16, specs[s].rows, 12, p != Pooling::kNone && k % 2));
  }
  std::vector<std::vector<float>> outs(js.size());
  std::vector<LookupRequest> reqs;
  for (size_t k = 0; k < js.size(); ++k) {
    const FeatureRequest f = Feature(ids[which[k].first], which[k].second, js[k]);
    outs[k].resize(OutputSize(f, specs[which[k].first].dim));
    reqs.push_back({f, absl::MakeSpan(outs[k])});
  }
  ASSERT_TRUE(be_->Lookup(reqs).ok());
  for (size_t k = 0; k < js.size(); ++k) {
    const auto want = RefLookup(refs[which[k].first], which[k].second, js[k]);
    ASSERT_EQ(want.size(), outs[k].size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(outs[k][i], want[i], 1e-4 * (1 + std::abs(want[i]))) << k << " " << i;
    }
  }
}

// Several optimizer steps, two features on the same shard in each call (so
// duplicates cross requests), compared with the formulas in double.
TEST_P(BackendParityTest, OptimizerStepsMatchFormulas) {
  std::mt19937 rng(3);
  for (OptimizerType opt : {OptimizerType::kSgd, OptimizerType::kAdagrad,
                            OptimizerType::kRowwiseAdagrad, OptimizerType::kAdam}) {
   for (WeightDecayMode mode :
        {WeightDecayMode::kDefault, WeightDecayMode::kL2, WeightDecayMode::kDecouple}) {
    if (opt == OptimizerType::kSgd && mode != WeightDecayMode::kDefault) continue;
    for (WeightType wt : {WeightType::kFp32, WeightType::kFp16, WeightType::kBf16}) {
     // dim 10 where the backend takes it: row-wise Adagrad's mean is over
     // the table's 10 columns, and no padding column is stored or stepped.
     for (int64_t dim : {int64_t{12}, int64_t{10}}) {
      if (dim % GetParam().column_multiple != 0) continue;
      ShardSpec spec = MakeSpec(40, dim, wt, opt);
      if (opt != OptimizerType::kSgd) spec.optimizer.weight_decay = 0.05f;
      spec.optimizer.weight_decay_mode = mode;
      if (opt == OptimizerType::kAdagrad) spec.optimizer.initial_accumulator_value = 0.1f;
      auto id = be_->CreateShard(spec);
      if (opt == OptimizerType::kAdagrad && mode == WeightDecayMode::kDefault) {
        // FBGEMM's EXACT_ADAGRAD has no weight decay: a mode must be named.
        EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
        continue;
      }
      ASSERT_TRUE(id.ok()) << id.status();
      RefShard ref = MakeRef(be_.get(), *id, spec);
      for (int step = 0; step < 4; ++step) {
        std::vector<Jagged> js;
        std::vector<Pooling> ps = {Pooling::kSum, static_cast<Pooling>(1 + step % 2)};
        std::vector<std::vector<float>> grads;
        std::vector<GradientRequest> reqs;
        std::map<int64_t, std::vector<double>> merged;
        for (Pooling p : ps) js.push_back(RandomJagged(rng, 10, spec.rows, 8, p != Pooling::kNone && step % 2));
        for (size_t k = 0; k < js.size(); ++k) {
          const FeatureRequest f = Feature(*id, ps[k], js[k]);
          std::vector<float> g(OutputSize(f, spec.dim));
          for (float& v : g) v = std::uniform_real_distribution<float>(-1, 1)(rng);
          grads.push_back(std::move(g));
        }
        for (size_t k = 0; k < js.size(); ++k) {
          reqs.push_back({Feature(*id, ps[k], js[k]), grads[k]});
          RefExpand(ref, ps[k], js[k], grads[k], &merged);
        }
        ASSERT_TRUE(be_->ApplyGradients(reqs).ok());
        RefUpdate(&ref, merged);
        // Re-read the stored (rounded) weights into the reference, so each
        // step's comparison measures one step's error.
        std::vector<float> st;
        const std::vector<float> w = Export(be_.get(), *id, spec, &st);
        const double tol = WeightTolerance(wt);
        for (size_t i = 0; i < w.size(); ++i) {
          ASSERT_NEAR(w[i], ref.w[i], tol * (std::abs(ref.w[i]) + 1e-2))
              << "opt " << static_cast<int>(opt) << " decay mode " << static_cast<int>(mode)
              << " type " << static_cast<int>(wt) << " step " << step << " elem " << i;
          ref.w[i] = w[i];
        }
        for (size_t i = 0; i < st.size(); ++i) {
          ASSERT_NEAR(st[i], ref.state[i], 1e-4 * (std::abs(ref.state[i]) + 1e-3)) << i;
          ref.state[i] = st[i];
        }
      }
      EXPECT_EQ(*be_->ExportStep(*id), 4);
     }
    }
   }
  }
}

// Hot rows: one row in thousands of bags and others repeated just under, at
// and over the CUDA backend's 32-occurrence chunk (its long runs are summed
// in chunks by several warps), across two requests of one call, for every
// optimizer, against the double-precision formulas.
TEST_P(BackendParityTest, HotRowsMatchFormulas) {
  std::mt19937 rng(11);
  for (OptimizerType opt : {OptimizerType::kSgd, OptimizerType::kAdagrad,
                            OptimizerType::kRowwiseAdagrad, OptimizerType::kAdam}) {
    for (int64_t dim : {int64_t{36}, int64_t{132}}) {
      ShardSpec spec = MakeSpec(50, dim, WeightType::kFp32, opt);
      auto id = be_->CreateShard(spec);
      ASSERT_TRUE(id.ok()) << id.status();
      RefShard ref = MakeRef(be_.get(), *id, spec);
      // Row 7 x 5000, rows 1..4 x 31, 32, 33 and 64, the rest once or twice.
      std::vector<int64_t> bag_ids;
      for (int k = 0; k < 5000; ++k) bag_ids.push_back(7);
      const int repeats[] = {31, 32, 33, 64};
      for (int r = 1; r <= 4; ++r) {
        for (int k = 0; k < repeats[r - 1]; ++k) bag_ids.push_back(r);
      }
      for (int64_t r = 10; r < spec.rows; ++r) bag_ids.push_back(r);
      std::shuffle(bag_ids.begin(), bag_ids.end(), rng);
      Jagged a, b;  // two requests, bags of 1..4 ids
      for (size_t k = 0; k < bag_ids.size();) {
        Jagged& j = (k < bag_ids.size() / 2) ? a : b;
        const size_t len = std::min<size_t>(1 + rng() % 4, bag_ids.size() - k);
        j.lengths.push_back(static_cast<int64_t>(len));
        for (size_t i = 0; i < len; ++i) j.ids.push_back(bag_ids[k++]);
      }
      std::map<int64_t, std::vector<double>> merged;
      std::vector<std::vector<float>> grads;
      for (const Jagged* j : {&a, &b}) {
        std::vector<float> g(j->lengths.size() * dim);
        for (float& v : g) v = std::uniform_real_distribution<float>(-0.05f, 0.05f)(rng);
        grads.push_back(std::move(g));
      }
      const absl::Status applied = be_->ApplyGradients(
          {{Feature(*id, Pooling::kSum, a), grads[0]}, {Feature(*id, Pooling::kMean, b), grads[1]}});
      const size_t scratch = GetParam().scratch_bytes;
      if (scratch > 0 && size_t{5000} * dim * sizeof(float) > scratch) {
        // Row 7's 5000 gradient rows alone exceed the scratch: refused, and
        // nothing changed.
        EXPECT_EQ(applied.code(), absl::StatusCode::kResourceExhausted) << applied;
        std::vector<float> st;
        const std::vector<float> w = Export(be_.get(), *id, spec, &st);
        for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(w[i], ref.w[i]) << i;
        for (size_t i = 0; i < st.size(); ++i) ASSERT_EQ(st[i], ref.state[i]) << i;
        continue;
      }
      ASSERT_TRUE(applied.ok()) << applied;
      RefExpand(ref, Pooling::kSum, a, grads[0], &merged);
      RefExpand(ref, Pooling::kMean, b, grads[1], &merged);
      RefUpdate(&ref, merged);
      std::vector<float> st;
      const std::vector<float> w = Export(be_.get(), *id, spec, &st);
      for (size_t i = 0; i < w.size(); ++i) {
        ASSERT_NEAR(w[i], ref.w[i], 1e-4 * (std::abs(ref.w[i]) + 1e-2))
            << "opt " << static_cast<int>(opt) << " dim " << dim << " row " << i / dim;
      }
      for (size_t i = 0; i < st.size(); ++i) {
        ASSERT_NEAR(st[i], ref.state[i], 1e-4 * (std::abs(ref.state[i]) + 1e-3)) << i;
      }
    }
  }
}

// Half-precision tables round updates stochastically: an SGD update of a
// twentieth of a bf16 ulp moves the weights on average (by the same mean as
// in fp32), and is lost entirely with stochastic_rounding off.
TEST_P(BackendParityTest, StochasticRoundingKeepsSmallUpdatesOnAverage) {
  for (bool stochastic : {true, false}) {
    ShardSpec spec = MakeSpec(64, 64, WeightType::kBf16, OptimizerType::kSgd);
    spec.initializer.type = InitializerType::kConstant;
    spec.initializer.value = 1.0f;
    spec.optimizer.learning_rate = 1.0f;
    spec.optimizer.stochastic_rounding = stochastic;
    auto id = be_->CreateShard(spec);
    ASSERT_TRUE(id.ok()) << id.status();
    Jagged j;
    for (int64_t r = 0; r < spec.rows; ++r) {
      j.lengths.push_back(1);
      j.ids.push_back(r);
    }
    // Each step: w -= 0.0004 (bf16's ulp at 1 is 2^-7 = 0.0078).
    const std::vector<float> grad(spec.rows * spec.dim, 0.0004f);
    const int steps = 10;
    for (int k = 0; k < steps; ++k) {
      ASSERT_TRUE(be_->ApplyGradients({{Feature(*id, Pooling::kSum, j), grad}}).ok());
    }
    const std::vector<float> w = Export(be_.get(), *id, spec);
    double mean = 0;
    for (float v : w) mean += v;
    mean /= static_cast<double>(w.size());
    if (stochastic) {
      EXPECT_NEAR(mean, 1.0 - steps * 0.0004, 0.0008) << "mean of " << w.size();
    } else {
      EXPECT_EQ(mean, 1.0);  // every update rounds back to 1
    }
  }
}

// The rounding noise depends on the global row and column, not on the
// sharding: a table updated as one shard or as four (two row ranges x two
// column ranges) ends with the same bits.
TEST_P(BackendParityTest, StochasticRoundingIsTheSameWhateverTheSharding) {
  for (WeightType wt : {WeightType::kFp16, WeightType::kBf16}) {
    const int64_t rows = 30, dim = 16;
    ShardSpec whole = MakeSpec(rows, dim, wt, OptimizerType::kAdam);
    whole.optimizer.weight_decay = 0.01f;
    auto wid = be_->CreateShard(whole);
    ASSERT_TRUE(wid.ok()) << wid.status();
    struct Part {
      ShardSpec spec;
      ShardId id;
    };
    std::vector<Part> parts;
    for (int64_t r0 : {int64_t{0}, int64_t{18}}) {
      for (int64_t c0 : {int64_t{0}, int64_t{8}}) {
        ShardSpec p = whole;
        p.row_offset = r0;
        p.rows = r0 == 0 ? 18 : rows - 18;
        p.col_offset = c0;
        p.dim = 8;
        auto id = be_->CreateShard(p);
        ASSERT_TRUE(id.ok()) << id.status();
        parts.push_back({p, *id});
      }
    }
    std::mt19937 rng(9);
    for (int step = 0; step < 3; ++step) {
      Jagged j = RandomJagged(rng, 12, rows, 5, false);
      std::vector<float> g(j.lengths.size() * dim);
      for (float& v : g) v = std::uniform_real_distribution<float>(-1, 1)(rng);
      ASSERT_TRUE(be_->ApplyGradients({{Feature(*wid, Pooling::kSum, j), g}}).ok());
      for (const Part& p : parts) {
        // The part's ids (local rows), bag by bag, and its gradient columns.
        Jagged pj;
        size_t k = 0;
        for (int64_t len : j.lengths) {
          int64_t n = 0;
          for (int64_t i = 0; i < len; ++i, ++k) {
            const int64_t r = j.ids[k] - p.spec.row_offset;
            if (r >= 0 && r < p.spec.rows) {
              pj.ids.push_back(r);
              ++n;
            }
          }
          pj.lengths.push_back(n);
        }
        std::vector<float> pg;
        for (size_t b = 0; b < j.lengths.size(); ++b) {
          for (int64_t c = 0; c < p.spec.dim; ++c) pg.push_back(g[b * dim + p.spec.col_offset + c]);
        }
        ASSERT_TRUE(be_->ApplyGradients({{Feature(p.id, Pooling::kSum, pj), pg}}).ok());
      }
    }
    const std::vector<float> w = Export(be_.get(), *wid, whole);
    for (const Part& p : parts) {
      const std::vector<float> pw = Export(be_.get(), p.id, p.spec);
      for (int64_t r = 0; r < p.spec.rows; ++r) {
        for (int64_t c = 0; c < p.spec.dim; ++c) {
          ASSERT_EQ(FloatBits(pw[r * p.spec.dim + c]),
                    FloatBits(w[(p.spec.row_offset + r) * dim + p.spec.col_offset + c]))
              << "type " << static_cast<int>(wt) << " row " << p.spec.row_offset + r << " col "
              << p.spec.col_offset + c;
        }
      }
    }
  }
}

// Bad input: the right code, and weights and state unchanged.
TEST_P(BackendParityTest, BadInputChangesNothing) {
  ShardSpec spec = MakeSpec(20, 8, WeightType::kFp32, OptimizerType::kAdam);
  auto id = be_->CreateShard(spec);
  ASSERT_TRUE(id.ok());
  std::vector<float> st0;
  const std::vector<float> w0 = Export(be_.get(), *id, spec, &st0);
  Jagged good;
  good.lengths = {2, 1};
  good.ids = {1, 2, 3};
  std::vector<float> grad(2 * 8, 0.5f);
  auto expect_bad = [&](const Jagged& j, Pooling p, size_t grad_size, absl::StatusCode code,
                        const std::string& needle, ShardId shard) {
    std::vector<float> g(grad_size, 0.5f);
    // A valid request first in the same call: it must not be applied either.
    std::vector<GradientRequest> reqs = {{Feature(*id, Pooling::kSum, good), grad},
                                         {Feature(shard, p, j), g}};
    absl::Status s = be_->ApplyGradients(reqs);
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_THAT(std::string(s.message()), testing::HasSubstr(needle));
    std::vector<float> out(grad_size);
    s = be_->Lookup({LookupRequest{Feature(shard, p, j), absl::MakeSpan(out)}});
    EXPECT_EQ(s.code(), code) << s;
  };
  Jagged j = good;
  j.ids[1] = 20;
  expect_bad(j, Pooling::kSum, 16, absl::StatusCode::kInvalidArgument, "id 20 at position 1 is outside [0, 20)", *id);
  j.ids[1] = -1;
  expect_bad(j, Pooling::kSum, 16, absl::StatusCode::kInvalidArgument, "outside", *id);
  j = good;
  j.lengths = {2, 2};
  expect_bad(j, Pooling::kSum, 16, absl::StatusCode::kInvalidArgument, "lengths sum to 4 but there are 3 ids", *id);
  j.lengths = {4, -1};
  expect_bad(j, Pooling::kSum, 16, absl::StatusCode::kInvalidArgument, "negative", *id);
  j = good;
  j.weights = {1.0f};
  expect_bad(j, Pooling::kSum, 16, absl::StatusCode::kInvalidArgument, "1 weights for 3 ids", *id);
  j.weights = {1, 1, 1};
  expect_bad(j, Pooling::kNone, 24, absl::StatusCode::kInvalidArgument, "pooled", *id);
  expect_bad(good, Pooling::kSum, 15, absl::StatusCode::kInvalidArgument, "expected 16", *id);
  expect_bad(good, Pooling::kNone, 16, absl::StatusCode::kInvalidArgument, "expected 24", *id);
  expect_bad(good, Pooling::kSum, 16, absl::StatusCode::kNotFound, "no shard with id 99", 99);
  std::vector<float> st1;
  const std::vector<float> w1 = Export(be_.get(), *id, spec, &st1);
  EXPECT_EQ(w0, w1);
  EXPECT_EQ(st0, st1);
  EXPECT_EQ(*be_->ExportStep(*id), 0);
  // Export/import range and size checks.
  std::vector<float> buf(8), sbuf(16);
  EXPECT_EQ(be_->ExportRows(*id, 19, 21, absl::MakeSpan(buf), absl::MakeSpan(sbuf)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(be_->ImportRows(*id, 0, 1, buf, absl::MakeConstSpan(sbuf.data(), 3)).code(),
            absl::StatusCode::kInvalidArgument);
}

// Two bad values in one call: every backend and path names the same one,
// the first in ValidateRequests' order (request by request: weights, ids,
// then the gradient), though the second request's bad id comes first in a
// pass over all the ids.
TEST_P(BackendParityTest, TheFirstOfTwoBadValuesIsNamed) {
  const ShardSpec spec = MakeSpec(20, 8, WeightType::kFp32, OptimizerType::kSgd);
  auto id = be_->CreateShard(spec);
  ASSERT_TRUE(id.ok());
  const std::vector<float> w0 = Export(be_.get(), *id, spec);
  Jagged nan_weight, bad_id;
  nan_weight.lengths = {2, 1};
  nan_weight.ids = {1, 2, 3};
  nan_weight.weights = {1.0f, std::nanf(""), 1.0f};
  bad_id.lengths = {1, 2};
  bad_id.ids = {4, 25, 6};
  std::vector<float> out_a(16), out_b(16);
  absl::Status s =
      be_->Lookup({LookupRequest{Feature(*id, Pooling::kSum, nan_weight), absl::MakeSpan(out_a)},
                   LookupRequest{Feature(*id, Pooling::kSum, bad_id), absl::MakeSpan(out_b)}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), testing::HasSubstr("request 0 (table 't'): weights[1] is nan"));
  // Both in one request: its weights come before its ids.
  Jagged both = nan_weight;
  both.ids[2] = 25;
  s = be_->Lookup({LookupRequest{Feature(*id, Pooling::kSum, both), absl::MakeSpan(out_a)}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), testing::HasSubstr("request 0 (table 't'): weights[1] is nan"));
  // The other way round: request 0's bad id before request 1's NaN weight.
  s = be_->Lookup({LookupRequest{Feature(*id, Pooling::kSum, bad_id), absl::MakeSpan(out_b)},
                   LookupRequest{Feature(*id, Pooling::kSum, nan_weight), absl::MakeSpan(out_a)}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), testing::HasSubstr("request 0 (table 't'): id 25 at position 1"));
  // A NaN gradient in request 0, a bad id in request 1.
  Jagged good = nan_weight;
  good.weights.clear();
  std::vector<float> nan_grad(16, 0.5f), grad(16, 0.5f);
  nan_grad[9] = std::nanf("");
  s = be_->ApplyGradients({{Feature(*id, Pooling::kSum, good), nan_grad},
                           {Feature(*id, Pooling::kSum, bad_id), grad}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), testing::HasSubstr("request 0 (table 't'): gradient[9] is nan"));
  s = be_->ApplyGradients({{Feature(*id, Pooling::kSum, bad_id), grad},
                           {Feature(*id, Pooling::kSum, good), nan_grad}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), testing::HasSubstr("request 0 (table 't'): id 25 at position 1"));
  EXPECT_EQ(Export(be_.get(), *id, spec), w0);
}

// Bad values far into large requests (past the CUDA backend's first staged
// pieces of 8,192 ids / 16,384 floats, and in the second request of the
// call): refused with the exact position, nothing applied, Adam's step
// unchanged.
TEST_P(BackendParityTest, BadValuesDeepInLargeRequestsChangeNothing) {
  const ShardSpec spec = MakeSpec(1000, 8, WeightType::kFp32, OptimizerType::kAdam);
  auto id = be_->CreateShard(spec);
  ASSERT_TRUE(id.ok());
  std::vector<float> st0;
  const std::vector<float> w0 = Export(be_.get(), *id, spec, &st0);
  Jagged big;
  const int bags = 5000, per_bag = 4;  // 20,000 ids, 40,000 gradient floats
  for (int b = 0; b < bags; ++b) {
    big.lengths.push_back(per_bag);
    for (int k = 0; k < per_bag; ++k) big.ids.push_back((b * 7 + k * 13) % 1000);
  }
  big.weights.assign(big.ids.size(), 0.5f);
  const std::vector<float> grad(bags * 8, 0.25f);
  auto expect_refused = [&](const Jagged& second, const std::vector<float>& second_grad,
                            const std::string& needle) {
    std::vector<GradientRequest> reqs = {{Feature(*id, Pooling::kSum, big), grad},
                                         {Feature(*id, Pooling::kSum, second), second_grad}};
    absl::Status s = be_->ApplyGradients(reqs);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), testing::HasSubstr(needle));
    if (second_grad == grad) {  // the values are in the ids or weights: lookups refuse too
      std::vector<float> out_a(grad.size()), out_b(grad.size());
      s = be_->Lookup({LookupRequest{Feature(*id, Pooling::kSum, big), absl::MakeSpan(out_a)},
                       LookupRequest{Feature(*id, Pooling::kSum, second), absl::MakeSpan(out_b)}});
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()), testing::HasSubstr(needle));
    }
  };
  Jagged j = big;
  j.ids[15000] = 1000;
  expect_refused(j, grad, "request 1 (table 't'): id 1000 at position 15000 is outside [0, 1000)");
  j = big;
  j.ids[19999] = -5;
  expect_refused(j, grad, "id -5 at position 19999");
  j = big;
  j.weights[12345] = std::numeric_limits<float>::infinity();
  expect_refused(j, grad, "weights[12345] is inf");
  std::vector<float> g = grad;
  g[39999] = std::nanf("");
  expect_refused(big, g, "gradient[39999] is nan");
  g = grad;
  g[16384] = -std::numeric_limits<float>::infinity();
  expect_refused(big, g, "gradient[16384] is -inf");
  std::vector<float> st1;
  const std::vector<float> w1 = Export(be_.get(), *id, spec, &st1);
  EXPECT_EQ(w0, w1);
  EXPECT_EQ(st0, st1);
  EXPECT_EQ(*be_->ExportStep(*id), 0);
  // The same call without the bad values is applied.
  ASSERT_TRUE(be_->ApplyGradients({{Feature(*id, Pooling::kSum, big), grad}}).ok());
  EXPECT_NE(Export(be_.get(), *id, spec, &st1), w0);
  EXPECT_EQ(*be_->ExportStep(*id), 1);
}

// With stochastic rounding off, half-precision weights round to nearest
// even wherever they are written: rows imported from fp32 (ties among
// them) and the rows an SGD step updates (half.h's rounding of the fp32
// step), over 16-column blocks and a tail (dim 36).
TEST_P(BackendParityTest, HalfPrecisionRoundsToNearestWithStochasticRoundingOff) {
  std::mt19937 rng(21);
  for (WeightType wt : {WeightType::kFp16, WeightType::kBf16}) {
    ShardSpec spec = MakeSpec(20, 36, wt, OptimizerType::kSgd);
    spec.optimizer.stochastic_rounding = false;
    spec.optimizer.learning_rate = 0.1f;
    auto id = be_->CreateShard(spec);
    ASSERT_TRUE(id.ok()) << id.status();
    const auto nearest = [wt](float v) {
      return wt == WeightType::kFp16 ? Fp16ToFloat(FloatToFp16(v)) : Bf16ToFloat(FloatToBf16(v));
    };
    std::vector<float> w(spec.rows * spec.dim);
    for (float& v : w) v = std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
    w[0] = 1.0f + 1.0f / 2048;  // fp16 ties: to the even neighbour, 1 ...
    w[1] = 1.0f + 3.0f / 2048;  // ... and 1 + 4/2048
    w[2] = 1.0f + 1.0f / 256;   // a bf16 tie: 1
    w[3] = -3.0e-6f;            // an fp16 subnormal
    w[40] = 65519.0f;           // fp16: the largest finite half, 65504
    ASSERT_TRUE(be_->ImportRows(*id, 0, spec.rows, w, {}).ok());
    const std::vector<float> imported = Export(be_.get(), *id, spec);
    for (size_t i = 0; i < w.size(); ++i) {
      ASSERT_EQ(FloatBits(imported[i]), FloatBits(nearest(w[i]))) << "import, element " << i;
    }
    Jagged j;
    for (int64_t r = 0; r < spec.rows; ++r) {
      j.lengths.push_back(1);
      j.ids.push_back(r);
    }
    std::vector<float> grad(w.size());
    for (float& g : grad) g = std::uniform_real_distribution<float>(-0.05f, 0.05f)(rng);
    ASSERT_TRUE(be_->ApplyGradients({{Feature(*id, Pooling::kSum, j), grad}}).ok());
    const std::vector<float> updated = Export(be_.get(), *id, spec);
    for (size_t i = 0; i < w.size(); ++i) {
      const float step = 0.1f * grad[i];  // SGD: w - lr * g, rounded once each
      ASSERT_EQ(FloatBits(updated[i]), FloatBits(nearest(imported[i] - step)))
          << "update, element " << i;
    }
  }
}

// An import of a value the table's type cannot hold was stored as Inf: its
// lookups returned Inf and its checkpoints did not restore. Refused, naming
// the row, column and value, with nothing written.
TEST_P(BackendParityTest, ImportOverflowingTheWeightTypeIsRefused) {
  struct Case {
    WeightType type;
    float value;
  } cases[] = {{WeightType::kFp16, 1e6f}, {WeightType::kFp16, 65520.0f},
               {WeightType::kFp16, -65520.0f}, {WeightType::kBf16, 3.4e38f}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.value);
    const ShardSpec spec = MakeSpec(6, 8, c.type, OptimizerType::kSgd);
    auto id = be_->CreateShard(spec);
    ASSERT_TRUE(id.ok()) << id.status();
    const std::vector<float> before = Export(be_.get(), *id, spec);
    std::vector<float> w(spec.rows * spec.dim, 0.5f);
    w[3 * spec.dim + 5] = c.value;
    const absl::Status s = be_->ImportRows(*id, 0, spec.rows, w, {});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("row 3 column 5"), std::string::npos) << s;
    EXPECT_NE(s.message().find("overflows"), std::string::npos) << s;
    EXPECT_EQ(Export(be_.get(), *id, spec), before);
    ASSERT_TRUE(be_->DropShard(*id).ok());
  }
}

// An update whose result a table's type or its optimizer state cannot hold
// is refused whole: the cases (fp16 SGD, fp32 Adagrad, row-wise
// Adagrad, bf16 Adam), each after a valid request on another shard in the
// same call, which is not applied either; the message names the table, the
// global row and column, and the value the double-precision reference
// expects there.
TEST_P(BackendParityTest, UpdateOverflowIsRefusedAndChangesNothing) {
  struct Case {
    WeightType type;
    OptimizerType opt;
    float lr, grad;
    bool state;  // the state overflows, not the weight
  } cases[] = {{WeightType::kFp16, OptimizerType::kSgd, 1.0f, 1e5f, false},
               {WeightType::kFp32, OptimizerType::kSgd, 1e30f, 1e10f, false},
               {WeightType::kFp32, OptimizerType::kAdagrad, 0.05f, 2e19f, true},
               {WeightType::kFp32, OptimizerType::kRowwiseAdagrad, 0.05f, 6e19f, true},
               {WeightType::kBf16, OptimizerType::kAdam, 0.05f, 3e38f, true}};
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("type ", static_cast<int>(c.type), " opt ",
                              static_cast<int>(c.opt)));
    const ShardSpec ok_spec = MakeSpec(10, 8, WeightType::kFp32, OptimizerType::kSgd);
    ShardSpec spec = MakeSpec(12, 8, c.type, c.opt);
    spec.table = "big";
    spec.row_offset = 100;
    spec.col_offset = 16;
    spec.table_rows = 200;
    spec.optimizer.learning_rate = c.lr;
    if (c.opt == OptimizerType::kAdagrad) spec.optimizer.weight_decay_mode = WeightDecayMode::kL2;
    auto ok_id = be_->CreateShard(ok_spec);
    auto id = be_->CreateShard(spec);
    ASSERT_TRUE(ok_id.ok() && id.ok());
    std::vector<float> ok_st0, st0;
    const std::vector<float> ok_w0 = Export(be_.get(), *ok_id, ok_spec, &ok_st0);
    const std::vector<float> w0 = Export(be_.get(), *id, spec, &st0);
    Jagged good;
    good.lengths = {1, 1};
    good.ids = {2, 3};
    const std::vector<float> good_grad(2 * 8, 0.5f);
    // Rows 4 and 7; row 7 gets the large gradient in column 5.
    Jagged bad;
    bad.lengths = {1, 1};
    bad.ids = {4, 7};
    std::vector<float> bad_grad(2 * 8, 0.25f);
    bad_grad[8 + 5] = c.grad;
    const std::vector<GradientRequest> reqs = {
        {Feature(*ok_id, Pooling::kSum, good), good_grad},
        {Feature(*id, Pooling::kSum, bad), bad_grad}};
    const absl::Status s = be_->ApplyGradients(reqs);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    const std::string m(s.message());
    EXPECT_THAT(m, testing::HasSubstr("table 'big': row 107"));
    EXPECT_THAT(m, testing::HasSubstr("nothing of the call was applied"));
    if (c.state) {
      // Element 5 of the state row (Adagrad), its only one (row-wise), or
      // v's (Adam: m first).
      const int64_t k = c.opt == OptimizerType::kRowwiseAdagrad ? 0
                        : c.opt == OptimizerType::kAdam         ? 8 + 5
                                                                : 5;
      EXPECT_THAT(m, testing::HasSubstr(absl::StrCat("optimizer state[", k, "] would become inf")));
    } else {
      const float expected = w0[7 * 8 + 5] - c.lr * c.grad;
      EXPECT_THAT(m, testing::HasSubstr(absl::StrCat("column 21: the weight would become ",
                                                     expected)));
    }
    std::vector<float> ok_st1, st1;
    EXPECT_EQ(Export(be_.get(), *ok_id, ok_spec, &ok_st1), ok_w0);
    EXPECT_EQ(ok_st1, ok_st0);
    EXPECT_EQ(Export(be_.get(), *id, spec, &st1), w0);
    EXPECT_EQ(st1, st0);
    EXPECT_EQ(*be_->ExportStep(*id), 0);
    EXPECT_EQ(*be_->ExportStep(*ok_id), 0);
    EXPECT_EQ(be_->OverflowSkippedRows(), 0);
    ASSERT_TRUE(be_->DropShard(*id).ok());
    ASSERT_TRUE(be_->DropShard(*ok_id).ok());
  }
}

// fp16 weights walked towards the limit by SGD calls of random gradients,
// each call judged by the double-precision reference: refused (and nothing
// changed) exactly when some row's new weight would pass 65504, applied and
// matching the formulas otherwise; whatever was applied exports and
// imports again (a checkpoint restores). The shard's bounds pass from
// "cannot overflow" through measurement to row-by-row checks on the way.
TEST_P(BackendParityTest, UpdatesNearTheLimitAreJudgedRowByRow) {
  std::mt19937 rng(5);
  ShardSpec spec = MakeSpec(16, 8, WeightType::kFp16, OptimizerType::kSgd);
  spec.optimizer.learning_rate = 1.0f;
  spec.optimizer.stochastic_rounding = false;
  auto id = be_->CreateShard(spec);
  ASSERT_TRUE(id.ok());
  RefShard ref = MakeRef(be_.get(), *id, spec);
  int refused = 0, applied = 0;
  for (int call = 0; call < 60; ++call) {
    SCOPED_TRACE(call);
    Jagged j = RandomJagged(rng, 6, spec.rows, 3, false);
    const FeatureRequest f = Feature(*id, Pooling::kSum, j);
    std::vector<float> g(OutputSize(f, spec.dim));
    // Mostly pushing weights down (towards -65504), in steps of up to 6000.
    for (float& v : g) v = std::uniform_real_distribution<float>(-500, 3000)(rng);
    std::map<int64_t, std::vector<double>> merged;
    RefExpand(ref, Pooling::kSum, j, g, &merged);
    RefShard next = ref;
    RefUpdate(&next, merged);
    bool overflow = false, close = false;
    for (const double w : next.w) {
      overflow |= std::abs(w) > 65504;
      close |= std::abs(std::abs(w) - 65504) < 64;  // rounding decides: not asked
    }
    if (close) continue;
    const absl::Status s = be_->ApplyGradients({GradientRequest{f, g}});
    const std::vector<float> w = Export(be_.get(), *id, spec);
    if (overflow) {
      ++refused;
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()), testing::HasSubstr("largest finite fp16 value 65504"));
      for (size_t i = 0; i < w.size(); ++i) ASSERT_EQ(w[i], static_cast<float>(ref.w[i])) << i;
      // Pull the table back from the limit now and then.
      if (refused % 3 == 0) {
        std::vector<float> pulled(w.size());
        for (size_t i = 0; i < w.size(); ++i) pulled[i] = w[i] / 4;
        ASSERT_TRUE(be_->ImportRows(*id, 0, spec.rows, pulled, {}).ok());
        ref = MakeRef(be_.get(), *id, spec);
      }
      continue;
    }
    ++applied;
    ASSERT_TRUE(s.ok()) << s;
    for (size_t i = 0; i < w.size(); ++i) {
      ASSERT_TRUE(std::isfinite(w[i])) << i;
      ASSERT_NEAR(w[i], next.w[i], 2e-3 * (std::abs(next.w[i]) + 1e-2)) << i;
      next.w[i] = w[i];
    }
    ref = next;
  }
  EXPECT_GE(refused, 3);
  EXPECT_GT(applied, 10);
  ShardSpec copy_spec = spec;
  auto copy = be_->CreateShard(copy_spec);
  ASSERT_TRUE(copy.ok());
  const std::vector<float> w = Export(be_.get(), *id, spec);
  ASSERT_TRUE(be_->ImportRows(*copy, 0, spec.rows, w, {}).ok());
  EXPECT_EQ(Export(be_.get(), *copy, spec), w);
}

// Three ways bounds could have let an overflow through unchecked (found in
// review): a call naming a shard without ids must leave its bounds alone;
// what is stored may round a gap above the fp32 result; and a square that
// vanishes in fp32 leaves g / eps unbounded.
TEST_P(BackendParityTest, BoundsHoldThroughEmptyCallsRoundingAndVanishingSquares) {
  auto refused_or_finite = [&](ShardId id, const ShardSpec& spec, const GradientRequest& r,
                               bool must_refuse) -> bool {
    std::vector<float> st0;
    const std::vector<float> w0 = Export(be_.get(), id, spec, &st0);
    const absl::Status s = be_->ApplyGradients({r});
    std::vector<float> st1;
    const std::vector<float> w1 = Export(be_.get(), id, spec, &st1);
    if (must_refuse) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    }
    if (!s.ok()) {
      EXPECT_EQ(w1, w0);
      EXPECT_EQ(st1, st0);
    }
    EXPECT_TRUE(std::all_of(w1.begin(), w1.end(), [](float v) { return std::isfinite(v); }));
    EXPECT_TRUE(std::all_of(st1.begin(), st1.end(), [](float v) { return std::isfinite(v); }));
    return s.ok();
  };
  {
    // Adam whose imported state breaks |m| <= C sqrt(v): m = 1000, v = 0.
    ShardSpec spec = MakeSpec(4, 8, WeightType::kFp16, OptimizerType::kAdam);
    spec.optimizer.learning_rate = 0.01f;
    auto id = be_->CreateShard(spec);
    ASSERT_TRUE(id.ok());
    std::vector<float> w(4 * 8, 0.0f), st(4 * 16, 0.0f);
    for (int c = 0; c < 8; ++c) st[c] = 1000.0f;
    ASSERT_TRUE(be_->ImportRows(*id, 0, 4, w, st).ok());
    Jagged none;
    none.lengths = {0};
    std::vector<float> zero(8, 0.0f);
    ASSERT_TRUE(be_->ApplyGradients({GradientRequest{Feature(*id, Pooling::kSum, none), zero}})
                    .ok());  // a step, no rows
    Jagged one;
    one.lengths = {1};
    one.ids = {0};
    const std::vector<float> g(8, 1e-3f);
    // t = 2: m^ = 900 / 0.19, sqrt(v^) = 7.07e-4: lr * u = 6.7e4, past fp16.
    refused_or_finite(*id, spec, {Feature(*id, Pooling::kSum, one), g}, /*must_refuse=*/true);
  }
  {
    // fp16 at 65472, SGD at rate 1 with stochastic rounding: 65472 + 16
    // is half a gap below 65504, stored as 65504 on about half the rows;
    // 15 more passes the limit exactly there.
    ShardSpec spec = MakeSpec(64, 4, WeightType::kFp16, OptimizerType::kSgd);
    spec.optimizer.learning_rate = 1.0f;
    auto id = be_->CreateShard(spec);
    ASSERT_TRUE(id.ok());
    ASSERT_TRUE(be_->ImportRows(*id, 0, 64, std::vector<float>(64 * 4, 65472.0f), {}).ok());
    Jagged all;
    for (int64_t r = 0; r < 64; ++r) {
      all.lengths.push_back(1);
      all.ids.push_back(r);
    }
    ASSERT_TRUE(refused_or_finite(*id, spec,
                                  {Feature(*id, Pooling::kSum, all),
                                   std::vector<float>(64 * 4, -16.0f)},
                                  false));
    const std::vector<float> w = Export(be_.get(), *id, spec);
    const bool any_at_limit = std::count(w.begin(), w.end(), 65504.0f) > 0;
    EXPECT_TRUE(any_at_limit);  // 256 fair coins
    const std::vector<float> g(64 * 4, -15.0f);
    EXPECT_EQ(refused_or_finite(*id, spec, {Feature(*id, Pooling::kSum, all), g}, any_at_limit),
              !any_at_limit);
  }
  {
    // Adagrad, eps 1e-30, nothing accumulated: g = 1e-23 squares to 0 in
    // fp32, and lr * g / eps = 1e5.
    ShardSpec spec = MakeSpec(4, 8, WeightType::kFp16, OptimizerType::kAdagrad);
    spec.optimizer.learning_rate = 0.01f;
    spec.optimizer.eps = 1e-30f;
    spec.optimizer.weight_decay_mode = WeightDecayMode::kL2;
    auto id = be_->CreateShard(spec);
    ASSERT_TRUE(id.ok());
    Jagged one;
    one.lengths = {1};
    one.ids = {2};
    refused_or_finite(*id, spec, {Feature(*id, Pooling::kSum, one), std::vector<float>(8, 1e-23f)},
                      /*must_refuse=*/true);
  }
}

TEST_P(BackendParityTest, ExportImportRoundTrip) {
  const ShardSpec spec = MakeSpec(30, 8, WeightType::kBf16, OptimizerType::kRowwiseAdagrad);
  auto a = be_->CreateShard(spec);
  ShardSpec other = spec;
  other.initializer.seed = 7;
  auto b = be_->CreateShard(other);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<float> st;
  const std::vector<float> w = Export(be_.get(), *a, spec, &st);
  for (float& v : st) v = 0.25f;
  ASSERT_TRUE(be_->ImportRows(*b, 0, spec.rows, w, st).ok());
  std::vector<float> st2;
  EXPECT_EQ(Export(be_.get(), *b, spec, &st2), w);
  EXPECT_EQ(st2, st);
}

TEST_P(BackendParityTest, RowsAtAnyPositionsMatchRowRangesAndBadOnesChangeNothing) {
  // ExportRowsAt / ImportRowsAt (the CPU backend's one pass, the others'
  // default a row at a time) against ExportRows / ImportRows of each row.
  for (const WeightType type : {WeightType::kFp32, WeightType::kFp16}) {
    const ShardSpec spec = MakeSpec(20, 8, type, OptimizerType::kAdagrad);
    auto a = be_->CreateShard(spec);
    ASSERT_TRUE(a.ok());
    const int64_t width = OptimizerStateWidth(spec.optimizer.type, spec.dim);
    const std::vector<int64_t> rows = {17, 3, 0, 19, 8};
    std::vector<float> w(rows.size() * spec.dim), st(rows.size() * width);
    for (size_t k = 0; k < w.size(); ++k) w[k] = 0.125f * static_cast<float>(k % 29) - 1.0f;
    for (size_t k = 0; k < st.size(); ++k) st[k] = 0.5f + static_cast<float>(k % 7);
    ASSERT_TRUE(be_->ImportRowsAt(*a, rows, w, st).ok());
    for (size_t k = 0; k < rows.size(); ++k) {  // each row, read back by range
      std::vector<float> rw(spec.dim), rs(width);
      ASSERT_TRUE(be_->ExportRows(*a, rows[k], rows[k] + 1, absl::MakeSpan(rw),
                                  absl::MakeSpan(rs))
                      .ok());
      for (int64_t c = 0; c < spec.dim; ++c) {
        EXPECT_EQ(rw[c], w[k * spec.dim + c]) << "row " << rows[k] << " col " << c;
      }
      EXPECT_EQ(rs, std::vector<float>(st.begin() + k * width, st.begin() + (k + 1) * width));
    }
    std::vector<float> back_w(w.size()), back_st(st.size());
    ASSERT_TRUE(be_->ExportRowsAt(*a, rows, absl::MakeSpan(back_w), absl::MakeSpan(back_st)).ok());
    EXPECT_EQ(back_w, w);
    EXPECT_EQ(back_st, st);
    // Refused whole: a row outside the shard, buffers of the wrong size, a
    // NaN in the last row's values.
    std::vector<float> st_before;
    const std::vector<float> before = Export(be_.get(), *a, spec, &st_before);
    std::vector<float> nan_w = w;
    nan_w.back() = std::nanf("");
    EXPECT_EQ(be_->ImportRowsAt(*a, {1, 20}, absl::MakeConstSpan(w).first(2 * spec.dim),
                                absl::MakeConstSpan(st).first(2 * width))
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(be_->ImportRowsAt(*a, {1, -1}, absl::MakeConstSpan(w).first(2 * spec.dim),
                                absl::MakeConstSpan(st).first(2 * width))
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(be_->ImportRowsAt(*a, rows, absl::MakeConstSpan(w).first(spec.dim), st).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(be_->ImportRowsAt(*a, rows, nan_w, st).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(be_->ExportRowsAt(*a, {20}, absl::MakeSpan(back_w).first(spec.dim),
                                absl::MakeSpan(back_st).first(width))
                  .code(),
              absl::StatusCode::kInvalidArgument);
    std::vector<float> st_after;
    EXPECT_EQ(Export(be_.get(), *a, spec, &st_after), before);
    EXPECT_EQ(st_after, st_before);
  }
  // Many rows at once (more than a split scratch holds: the CUDA backend
  // moves them in chunks), in a shuffled order, against the whole shard
  // read by range.
  const ShardSpec spec = MakeSpec(400, 8, WeightType::kFp16, OptimizerType::kAdagrad);
  auto a = be_->CreateShard(spec);
  ASSERT_TRUE(a.ok());
  std::vector<int64_t> rows(300);
  for (size_t k = 0; k < rows.size(); ++k) rows[k] = static_cast<int64_t>((k * 37 + 11) % 400);
  std::vector<float> w(rows.size() * 8), st(rows.size() * 8);
  for (size_t k = 0; k < w.size(); ++k) w[k] = 0.25f * static_cast<float>(k % 23) - 2.0f;
  for (size_t k = 0; k < st.size(); ++k) st[k] = 1.0f + static_cast<float>(k % 5);
  ASSERT_TRUE(be_->ImportRowsAt(*a, rows, w, st).ok());
  std::vector<float> all_st;
  const std::vector<float> all = Export(be_.get(), *a, spec, &all_st);
  std::vector<float> back_w(w.size()), back_st(st.size());
  ASSERT_TRUE(be_->ExportRowsAt(*a, rows, absl::MakeSpan(back_w), absl::MakeSpan(back_st)).ok());
  for (size_t k = 0; k < rows.size(); ++k) {
    for (int c = 0; c < 8; ++c) {
      ASSERT_EQ(all[rows[k] * 8 + c], w[k * 8 + c]) << "row " << rows[k];  // exact in fp16
      ASSERT_EQ(all_st[rows[k] * 8 + c], st[k * 8 + c]) << "row " << rows[k];
      ASSERT_EQ(back_w[k * 8 + c], w[k * 8 + c]) << "row " << rows[k];
      ASSERT_EQ(back_st[k * 8 + c], st[k * 8 + c]) << "row " << rows[k];
    }
  }
}

TEST_P(BackendParityTest, InitializerIsReproducibleAcrossShardings) {
  ShardSpec whole = MakeSpec(100, 16);
  ShardSpec part = whole;
  part.rows = 30;
  part.row_offset = 50;
  part.dim = 8;
  part.col_offset = 8;
  auto a = be_->CreateShard(whole);
  auto b = be_->CreateShard(part);
  ASSERT_TRUE(a.ok() && b.ok());
  const auto wa = Export(be_.get(), *a, whole), wb = Export(be_.get(), *b, part);
  const double bound = std::sqrt(1.0 / 100);
  double sum = 0;
  for (float v : wa) {
    EXPECT_LE(std::abs(v), bound);
    sum += v;
  }
  EXPECT_LT(std::abs(sum / wa.size()), bound / 10);  // centred
  for (int r = 0; r < 30; ++r) {
    for (int c = 0; c < 8; ++c) EXPECT_EQ(wb[r * 8 + c], wa[(50 + r) * 16 + 8 + c]);
  }
}

TEST_P(BackendParityTest, RejectsBadShardSpecs) {
  ShardSpec s = MakeSpec(10, 6);
  if (GetParam().column_multiple == 1) {
    EXPECT_TRUE(be_->CreateShard(s).ok());
  } else {
    const absl::Status refused = be_->CreateShard(s).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(refused.message()), testing::HasSubstr("dim 6 is not a multiple of 4"));
  }
  s = MakeSpec(10, 0);
  EXPECT_EQ(be_->CreateShard(s).status().code(), absl::StatusCode::kInvalidArgument);
  s = MakeSpec(0, 8);
  EXPECT_EQ(be_->CreateShard(s).status().code(), absl::StatusCode::kInvalidArgument);
  s = MakeSpec(10, 8);
  s.optimizer.weight_decay = 0.1f;  // SGD has none in FBGEMM
  EXPECT_EQ(be_->CreateShard(s).status().code(), absl::StatusCode::kInvalidArgument);
  s = MakeSpec(10, 8);
  s.row_offset = 5;  // beyond table_rows
  EXPECT_EQ(be_->CreateShard(s).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(be_->DropShard(1234).code(), absl::StatusCode::kNotFound);
}

// Dynamic (hash-keyed) shards over this backend (WithDynamicShards, which
// maps ids to slots of one of its fixed shards) serve and train as they do
// over the CPU backend: the same ids held after every step, the same
// lookups and rows (to the weight type's tolerance), on ids anywhere in
// int64, with admission at 2, TTL and LFU eviction at work.
TEST_P(BackendParityTest, DynamicShardsMatchTheCpuBackends) {
  auto made = GetParam().make();
  ASSERT_TRUE(made.ok()) << made.status();
  auto dyn = WithDynamicShards(*std::move(made));
  auto cpu = CreateCpuBackend(CpuBackendOptions());
  ASSERT_TRUE(cpu.ok());
  auto ref = WithDynamicShards(*std::move(cpu));
  ShardSpec spec = MakeSpec(12, 8, WeightType::kFp32, OptimizerType::kAdagrad);
  spec.is_dynamic = true;
  spec.dynamic.admit_after = 2;
  spec.dynamic.ttl_steps = 3;
  spec.dynamic.eviction = Eviction::kLfu;
  auto a = dyn->CreateShard(spec);
  auto b = ref->CreateShard(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  std::mt19937_64 rng(9);
  std::vector<int64_t> universe;
  for (int i = 0; i < 30; ++i) universe.push_back(static_cast<int64_t>(rng()));
  auto held = [](EmbeddingBackend* be, ShardId id) {
    std::vector<EmbeddingBackend::SlotMeta> m(12);
    EXPECT_TRUE(be->ExportSlots(id, 0, 12, absl::MakeSpan(m)).ok());
    std::map<int64_t, int64_t> out;  // id -> slot
    for (int64_t s = 0; s < 12; ++s) {
      if (m[s].held) out[m[s].id] = s;
    }
    return out;
  };
  for (int step = 0; step < 15; ++step) {
    Jagged j;
    for (int bag = 0; bag < 4; ++bag) {
      j.lengths.push_back(static_cast<int64_t>(rng() % 4));
      for (int64_t k = 0; k < j.lengths.back(); ++k) {
        j.ids.push_back(universe[rng() % 30 % (step + 5)]);
      }
    }
    std::vector<float> out_a(4 * 8), out_b(4 * 8), grad(4 * 8);
    for (float& g : grad) g = static_cast<float>(static_cast<int>(rng() % 9) - 4) * 0.25f;
    ASSERT_TRUE(dyn->Lookup({LookupRequest{Feature(*a, Pooling::kSum, j),
                                           absl::MakeSpan(out_a)}})
                    .ok());
    ASSERT_TRUE(ref->Lookup({LookupRequest{Feature(*b, Pooling::kSum, j),
                                           absl::MakeSpan(out_b)}})
                    .ok());
    for (size_t i = 0; i < out_a.size(); ++i) {
      EXPECT_NEAR(out_a[i], out_b[i], 1e-5 * (1 + std::abs(out_b[i]))) << "step " << step;
    }
    ASSERT_TRUE(dyn->ApplyGradients({GradientRequest{Feature(*a, Pooling::kSum, j),
                                                     grad}})
                    .ok());
    ASSERT_TRUE(ref->ApplyGradients({GradientRequest{Feature(*b, Pooling::kSum, j),
                                                     grad}})
                    .ok());
    const auto ha = held(dyn.get(), *a), hb = held(ref.get(), *b);
    ASSERT_EQ(ha.size(), hb.size()) << "step " << step;
    for (const auto& [id, slot] : hb) {
      ASSERT_TRUE(ha.count(id)) << "id " << id << " at step " << step;
      std::vector<float> wa(8), wb(8), sa(8), sb(8);
      ASSERT_TRUE(dyn->ExportRows(*a, ha.at(id), ha.at(id) + 1, absl::MakeSpan(wa),
                                  absl::MakeSpan(sa))
                      .ok());
      ASSERT_TRUE(
          ref->ExportRows(*b, slot, slot + 1, absl::MakeSpan(wb), absl::MakeSpan(sb)).ok());
      for (int c = 0; c < 8; ++c) {
        EXPECT_NEAR(wa[c], wb[c], 1e-5 * (1 + std::abs(wb[c]))) << "id " << id;
        EXPECT_NEAR(sa[c], sb[c], 1e-5 * (1 + std::abs(sb[c]))) << "id " << id;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, BackendParityTest, testing::ValuesIn(AvailableBackends()),
                         [](const testing::TestParamInfo<BackendParam>& info) { return info.param.name; });

// A backend that finds keys itself refuses a keyed lookup on a shard whose
// index it never got (FAILED_PRECONDITION) and a sync for a shard it does
// not hold (NOT_FOUND) or with bad lines (INVALID_ARGUMENT); the rest are
// served as before.
TEST(KeyedLookupTest, BackendsThatFindKeysRefuseWhatTheyCannotFind) {
  int tried = 0;
  for (const BackendParam& param : AvailableBackends()) {
    auto made = param.make();
    ASSERT_TRUE(made.ok()) << made.status();
    EmbeddingBackend* be = made->get();
    if (!be->FindsKeys()) continue;
    SCOPED_TRACE(param.name);
    ++tried;
    auto id = be->CreateShard(MakeSpec(8, 8));
    ASSERT_TRUE(id.ok()) << id.status();
    Jagged j;
    j.lengths = {2};
    j.ids = {-3, 12345678901};
    std::vector<float> out(8);
    FeatureRequest f = Feature(*id, Pooling::kSum, j);
    f.keyed = true;
    EXPECT_EQ(be->Lookup({LookupRequest{f, absl::MakeSpan(out)}}).code(),
              absl::StatusCode::kFailedPrecondition);
    std::vector<math::KeyLine> lines(4);
    for (math::KeyLine& l : lines) std::fill(std::begin(l.slot), std::end(l.slot), -1);
    EXPECT_EQ(be->SyncKeyIndex(*id + 1000, lines.data(), 4, {}).code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(be->SyncKeyIndex(*id, lines.data(), 3, {}).code(),
              absl::StatusCode::kInvalidArgument);
    // An index with no keys: every key reads the last row.
    ASSERT_TRUE(be->SyncKeyIndex(*id, lines.data(), 4, {}).ok());
    ASSERT_TRUE(be->Lookup({LookupRequest{f, absl::MakeSpan(out)}}).ok());
    std::vector<float> last(8), state(0);
    ASSERT_TRUE(be->ExportRows(*id, 7, 8, absl::MakeSpan(last), absl::MakeSpan(state)).ok());
    for (int c = 0; c < 8; ++c) EXPECT_FLOAT_EQ(out[c], 2 * last[c]) << "column " << c;
  }
  if (tried == 0) GTEST_SKIP() << "no backend here finds keys itself";
}

#if __has_include(<cuda_runtime_api.h>)
// A backend that finds keys itself (the CUDA backend, on the device) takes
// a dynamic shard's lookup ids in device memory, as a link channel hands
// them, and answers as the CPU backend does for the same ids on the host;
// an update's ids on the device are still refused, with nothing applied.
// (The CUDA backend, whole and in pieces: over the host runtime in
// backend_parity_on_host_test, on a GPU where one is visible.)
void ExpectDynamicLookupIdsOnTheDevice(const BackendParam& param) {
  SCOPED_TRACE(param.name);
  auto made = param.make();
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_TRUE((*made)->FindsKeys());
  auto owned = WithDynamicShards(*std::move(made));
  EmbeddingBackend* host = owned.get();
  DeviceInputsBackend device(std::move(owned));
  auto cpu = CreateCpuBackend(CpuBackendOptions());
  ASSERT_TRUE(cpu.ok());
  auto ref = WithDynamicShards(*std::move(cpu));
  ShardSpec spec = MakeSpec(16, 8, WeightType::kFp32, OptimizerType::kSgd);
  spec.is_dynamic = true;
  spec.dynamic.eviction = Eviction::kLru;
  auto a = device.CreateShard(spec);
  auto b = ref->CreateShard(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  std::mt19937_64 rng(17);
  std::vector<int64_t> universe;
  for (int i = 0; i < 40; ++i) universe.push_back(static_cast<int64_t>(rng()));
  auto draw = [&](int bags) {
    Jagged j;
    for (int bag = 0; bag < bags; ++bag) {
      j.lengths.push_back(static_cast<int64_t>(rng() % 5));
      for (int64_t k = 0; k < j.lengths.back(); ++k) j.ids.push_back(universe[rng() % 40]);
    }
    return j;
  };
  auto expect_same_lookups = [&](const std::string& when) {
    const Jagged j = draw(6);
    std::vector<float> out_a(6 * 8), out_b(6 * 8);
    ASSERT_TRUE(device.Lookup({LookupRequest{Feature(*a, Pooling::kSum, j), absl::MakeSpan(out_a)}})
                    .ok());
    ASSERT_TRUE(ref->Lookup({LookupRequest{Feature(*b, Pooling::kSum, j), absl::MakeSpan(out_b)}})
                    .ok());
    for (size_t i = 0; i < out_a.size(); ++i) {
      ASSERT_NEAR(out_a[i], out_b[i], 1e-5 * (1 + std::abs(out_b[i]))) << when << " at " << i;
    }
  };
  for (int step = 0; step < 12; ++step) {  // 40 ids through 16 rows: evictions too
    const Jagged j = draw(4);
    std::vector<float> grad(4 * 8);
    for (float& g : grad) g = static_cast<float>(static_cast<int>(rng() % 9) - 4) * 0.25f;
    ASSERT_TRUE(host->ApplyGradients({GradientRequest{Feature(*a, Pooling::kSum, j), grad}}).ok());
    ASSERT_TRUE(ref->ApplyGradients({GradientRequest{Feature(*b, Pooling::kSum, j), grad}}).ok());
    expect_same_lookups(absl::StrCat("step ", step));
  }
  const Jagged j = draw(4);
  std::vector<float> grad(4 * 8, 1.0f);
  const absl::Status refused =
      device.ApplyGradients({GradientRequest{Feature(*a, Pooling::kSum, j), grad}});
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("host memory"), std::string::npos) << refused;
  expect_same_lookups("after the refused update");
}

TEST(DynamicOnDeviceTest, LookupIdsOnTheDeviceMatchTheCpuBackend) {
  int tried = 0;
  for (const BackendParam& param : AvailableBackends()) {
    auto made = param.make();
    if (!made.ok() || (*made)->OutputMemory() != EmbeddingBackend::Memory::kCudaDevice) continue;
    ExpectDynamicLookupIdsOnTheDevice(param);
    ++tried;
  }
  if (tried == 0) GTEST_SKIP() << "no backend here holds shards on a CUDA device";
}
#endif

// With skip_overflow the rows whose update would overflow are left as they
// were and counted, and the rest of the call applies as the formulas say:
// the CPU backend and the CUDA kernels' emulation (whole and in pieces).
TEST(SkipOverflowTest, MisfitRowsAreLeftAloneAndCounted) {
  std::vector<std::pair<std::string, std::function<std::unique_ptr<EmbeddingBackend>()>>> makers;
  makers.push_back({"cpu", [] {
                      CpuBackendOptions o;
                      o.skip_overflow = true;
                      return *CreateCpuBackend(o);
                    }});
  for (size_t scratch : {size_t{0}, kSplitScratchBytes}) {
    makers.push_back({absl::StrCat("cuda_emulated_", scratch), [scratch] {
                        backend::EmulatedCudaOptions o;
                        o.skip_overflow = true;
                        o.scratch_bytes = scratch;
                        return backend::CreateEmulatedCudaBackend(o);
                      }});
  }
  for (auto& [name, make] : makers) {
    SCOPED_TRACE(name);
    std::unique_ptr<EmbeddingBackend> be = make();
    ShardSpec spec = MakeSpec(10, 8, WeightType::kFp16, OptimizerType::kSgd);
    spec.optimizer.learning_rate = 1.0f;
    spec.optimizer.stochastic_rounding = false;
    auto id = be->CreateShard(spec);
    ASSERT_TRUE(id.ok());
    RefShard ref = MakeRef(be.get(), *id, spec);
    Jagged j;
    j.lengths = {1, 1, 1, 2};
    j.ids = {1, 4, 6, 4, 9};  // row 4 twice: its merged gradient overflows
    std::vector<float> g(4 * 8, 0.5f);
    for (int c = 0; c < 8; ++c) g[1 * 8 + c] = g[3 * 8 + c] = -40000.0f;
    g[2 * 8 + 3] = 70000.0f;  // row 6, column 3 alone
    const FeatureRequest f = Feature(*id, Pooling::kSum, j);
    ASSERT_TRUE(be->ApplyGradients({GradientRequest{f, g}}).ok());
    EXPECT_EQ(be->OverflowSkippedRows(), 2);
    std::map<int64_t, std::vector<double>> merged;
    RefExpand(ref, Pooling::kSum, j, g, &merged);
    merged.erase(4);
    merged.erase(6);
    RefUpdate(&ref, merged);
    const std::vector<float> w = Export(be.get(), *id, spec);
    for (size_t i = 0; i < w.size(); ++i) {
      EXPECT_NEAR(w[i], ref.w[i], 2e-3 * (std::abs(ref.w[i]) + 1e-2)) << i;
    }
    EXPECT_EQ(*be->ExportStep(*id), 1);
  }
}

TEST(CpuBackendTest, MemoryLimitAndOptions) {
  CpuBackendOptions o;
  o.memory_limit_bytes = 1000;
  auto be = CreateCpuBackend(o);
  ASSERT_TRUE(be.ok());
  EXPECT_TRUE((*be)->CreateShard(MakeSpec(10, 8)).ok());  // 320 bytes
  EXPECT_EQ((*be)->CreateShard(MakeSpec(100, 8)).status().code(),
            absl::StatusCode::kResourceExhausted);
  o.num_threads = 0;
  EXPECT_EQ(CreateCpuBackend(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.num_threads = 1;
  o.isa = "sse9";
  EXPECT_EQ(CreateCpuBackend(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace backend
}  // namespace ember
