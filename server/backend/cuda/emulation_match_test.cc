// On a GPU: the CUDA backend and the emulated one (the same kernel bodies on
// the CPU) give the same bits for the same calls — lookups, updated weights
// and optimizer state — across weight types, optimizers, poolings and hot
// rows. This is what lets the emulated backend stand in for the GPU in CI.
// Skips where no GPU is usable.
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "math/half.h"
#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/cuda/emulated_backend.h"

namespace ember {
namespace backend {
namespace {


std::vector<uint32_t> Bits(const std::vector<float>& v) {
  std::vector<uint32_t> out;
  for (float x : v) out.push_back(backend::FloatBits(x));
  return out;
}

TEST(EmulationMatchTest, CudaAndEmulatedGiveTheSameBits) {
  auto gpu = CreateCudaBackend({});
  if (!gpu.ok()) GTEST_SKIP() << "no usable GPU: " << gpu.status();
  auto emu = CreateEmulatedCudaBackend();
  std::mt19937 rng(5);
  for (WeightType wt : {WeightType::kFp32, WeightType::kFp16, WeightType::kBf16}) {
    for (OptimizerType opt : {OptimizerType::kSgd, OptimizerType::kAdagrad,
                              OptimizerType::kRowwiseAdagrad, OptimizerType::kAdam}) {
      ShardSpec spec;
      spec.table = "t";
      spec.rows = 300;
      spec.table_rows = 300;
      spec.dim = 36;
      spec.weight_type = wt;
      spec.optimizer.type = opt;
      spec.optimizer.learning_rate = 0.05f;
      if (opt != OptimizerType::kSgd) {
        spec.optimizer.weight_decay = 0.01f;
        spec.optimizer.weight_decay_mode = backend::WeightDecayMode::kDecouple;
      }
      spec.initializer.seed = 17;
      auto a = (*gpu)->CreateShard(spec);
      auto b = emu->CreateShard(spec);
      ASSERT_TRUE(a.ok() && b.ok());
      for (int step = 0; step < 3; ++step) {
        std::vector<int64_t> lengths, ids;
        std::vector<float> weights;
        for (int bag = 0; bag < 64; ++bag) {
          const int len = static_cast<int>(rng() % 6);
          lengths.push_back(len);
          for (int k = 0; k < len; ++k) {
            ids.push_back(rng() % 3 == 0 ? 7 : static_cast<int64_t>(rng() % spec.rows));  // row 7 hot
            weights.push_back(std::uniform_real_distribution<float>(-1, 1)(rng));
          }
        }
        const Pooling pooling = step % 2 ? Pooling::kMean : Pooling::kSum;
        FeatureRequest fa, fb;
        fa.shard = *a;
        fb.shard = *b;
        fa.pooling = fb.pooling = pooling;
        fa.lengths = fb.lengths = lengths;
        fa.ids = fb.ids = ids;
        if (step == 2) fa.weights = fb.weights = weights;
        std::vector<float> out_a(64 * spec.dim), out_b(64 * spec.dim);
        ASSERT_TRUE((*gpu)->Lookup({LookupRequest{fa, absl::MakeSpan(out_a)}}).ok());
        ASSERT_TRUE(emu->Lookup({LookupRequest{fb, absl::MakeSpan(out_b)}}).ok());
        EXPECT_EQ(Bits(out_a), Bits(out_b)) << "lookup, type " << static_cast<int>(wt);
        std::vector<float> grad(64 * spec.dim);
        for (float& g : grad) g = std::uniform_real_distribution<float>(-1, 1)(rng);
        ASSERT_TRUE((*gpu)->ApplyGradients({GradientRequest{fa, grad}}).ok());
        ASSERT_TRUE(emu->ApplyGradients({GradientRequest{fb, grad}}).ok());
      }
      const int64_t width = backend::OptimizerStateWidth(opt, spec.dim);
      std::vector<float> wa(spec.rows * spec.dim), wb(wa.size()), sa(spec.rows * width),
          sb(sa.size());
      ASSERT_TRUE((*gpu)->ExportRows(*a, 0, spec.rows, absl::MakeSpan(wa), absl::MakeSpan(sa)).ok());
      ASSERT_TRUE(emu->ExportRows(*b, 0, spec.rows, absl::MakeSpan(wb), absl::MakeSpan(sb)).ok());
      EXPECT_EQ(Bits(wa), Bits(wb)) << "weights, type " << static_cast<int>(wt) << " optimizer "
                                    << static_cast<int>(opt);
      EXPECT_EQ(Bits(sa), Bits(sb)) << "state, optimizer " << static_cast<int>(opt);
    }
  }
}

}  // namespace
}  // namespace backend
}  // namespace ember
