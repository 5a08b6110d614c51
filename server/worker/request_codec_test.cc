// The request codec on its own, over inline requests (the channel
// transports are covered through the service in worker_service_test and
// worker_device_link_test): what it hands the backend, worked out by hand,
// and what it refuses.
#include "server/worker/request_codec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/backend/cpu/cpu_backend.h"

namespace ember {
namespace worker {
namespace {

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

class RequestCodecTest : public ::testing::Test {
 protected:
  RequestCodecTest() : channels_(absl::Minutes(1), 1 << 20, 4) {
    backend::CpuBackendOptions o;
    o.memory_limit_bytes = 1 << 20;
    auto b = backend::CreateCpuBackend(o);
    EXPECT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
  }

  RequestCodec Codec(int64_t max_response_bytes = 1 << 20, bool skip_nonfinite = false) {
    return RequestCodec(&channels_, backend_.get(),
                        CodecOptions{max_response_bytes, skip_nonfinite});
  }

  // Table "t" shard 0 is backend shard 7 of 10 rows x 4 columns; any
  // other is refused as this worker's FindShard would.
  static absl::StatusOr<ShardShape> Resolve(const ember::v1::ShardRef& ref) {
    if (ref.table() == "t" && ref.shard_index() == 0) return ShardShape{7, 10, 4};
    return absl::FailedPreconditionError("no such shard here");
  }

  static ember::v1::ShardFeature Feature(const std::vector<int64_t>& lengths,
                                         const std::vector<int64_t>& ids) {
    ember::v1::ShardFeature f;
    f.mutable_shard()->set_table("t");
    f.set_feature("f");
    f.set_lengths(Bytes(lengths));
    f.set_ids(Bytes(ids));
    return f;
  }

  ShmChannels channels_;
  std::unique_ptr<backend::EmbeddingBackend> backend_;
};

TEST_F(RequestCodecTest, InlineLookupViewsTheArraysAndSizesTheOutputs) {
  ember::v1::WorkerLookupRequest req;
  *req.add_features() = Feature({2, 0, 1}, {3, 9, 0});
  auto* seq = req.add_features();
  *seq = Feature({1, 1}, {4, 5});
  seq->set_pooling(ember::v1::TableConfig::NONE);
  const RequestCodec codec = Codec();
  LookupCall call;
  ASSERT_TRUE(codec.ReceiveLookup(req, "", &call).ok());
  ember::v1::WorkerLookupResponse resp;
  ASSERT_TRUE(call.Decode(Resolve, &resp).ok());
  ASSERT_EQ(call.requests().size(), 2u);
  const backend::FeatureRequest& pooled = call.requests()[0].feature;
  EXPECT_EQ(pooled.shard, 7u);
  EXPECT_EQ(std::vector<int64_t>(pooled.lengths.begin(), pooled.lengths.end()),
            (std::vector<int64_t>{2, 0, 1}));
  EXPECT_EQ(std::vector<int64_t>(pooled.ids.begin(), pooled.ids.end()),
            (std::vector<int64_t>{3, 9, 0}));
  EXPECT_FALSE(pooled.on_device);
  // Pooled: one row of 4 per bag; sequence: one row of 4 per id.
  EXPECT_EQ(call.requests()[0].output.size(), 3u * 4);
  EXPECT_EQ(call.requests()[1].output.size(), 2u * 4);
  EXPECT_EQ(call.requests()[1].feature.pooling, backend::Pooling::kNone);
  ASSERT_EQ(resp.outputs_size(), 2);
  EXPECT_EQ(resp.outputs(0).size(), 3u * 4 * 4);
  EXPECT_EQ(call.output_bytes(), (3 + 2) * 4 * 4);
  ASSERT_TRUE(call.Finish(&resp).ok());
  EXPECT_FALSE(resp.placed());
  EXPECT_FALSE(call.placed() || call.linked() || call.from_id_buffer());
}

TEST_F(RequestCodecTest, LookupRefusals) {
  const RequestCodec codec = Codec(/*max_response_bytes=*/3 * 4 * 4 - 1);
  {  // the shard's refusal, as it came
    ember::v1::WorkerLookupRequest req;
    *req.add_features() = Feature({1}, {0});
    req.mutable_features(0)->mutable_shard()->set_table("other");
    LookupCall call;
    ASSERT_TRUE(codec.ReceiveLookup(req, "", &call).ok());
    ember::v1::WorkerLookupResponse resp;
    const absl::Status s = call.Decode(Resolve, &resp);
    EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
    EXPECT_EQ(s.message(), "no such shard here");
  }
  {  // over max_response_bytes: 3 bags of 4 floats is one byte too many
    ember::v1::WorkerLookupRequest req;
    *req.add_features() = Feature({1, 1, 1}, {0, 1, 2});
    LookupCall call;
    ASSERT_TRUE(codec.ReceiveLookup(req, "", &call).ok());
    ember::v1::WorkerLookupResponse resp;
    const absl::Status s = call.Decode(Resolve, &resp);
    EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
    EXPECT_EQ(resp.outputs_size(), 0);
  }
  {  // lengths that are not whole int64s
    ember::v1::WorkerLookupRequest req;
    *req.add_features() = Feature({1}, {0});
    req.mutable_features(0)->mutable_lengths()->push_back('x');
    LookupCall call;
    ASSERT_TRUE(codec.ReceiveLookup(req, "", &call).ok());
    ember::v1::WorkerLookupResponse resp;
    const absl::Status s = call.Decode(Resolve, &resp);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_NE(s.message().find("feature 'f' (table 't' shard 0)"), std::string::npos) << s;
  }
  {  // lengths that do not add up to the ids
    ember::v1::WorkerLookupRequest req;
    *req.add_features() = Feature({2}, {0});
    LookupCall call;
    ASSERT_TRUE(codec.ReceiveLookup(req, "", &call).ok());
    ember::v1::WorkerLookupResponse resp;
    EXPECT_TRUE(absl::IsInvalidArgument(call.Decode(Resolve, &resp)));
  }
  // Transports named without a channel are refused before anything else.
  for (int kind = 0; kind < 4; ++kind) {
    ember::v1::WorkerLookupRequest req;
    *req.add_features() = Feature({1}, {0});
    if (kind == 0) req.add_shm_outputs();
    if (kind == 1) req.mutable_features(0)->mutable_shm_ids()->set_size(8);
    if (kind == 2) req.mutable_id_buffer();
    if (kind == 3) req.add_placements();
    LookupCall call;
    const absl::Status s = codec.ReceiveLookup(req, "", &call);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << kind << ": " << s;
  }
  {  // a channel this worker never opened
    ember::v1::WorkerLookupRequest req;
    *req.add_features() = Feature({1}, {0});
    req.set_channel_id(12345);
    req.set_channel_seq(1);
    LookupCall call;
    EXPECT_FALSE(codec.ReceiveLookup(req, "", &call).ok());
  }
}

TEST_F(RequestCodecTest, GradientsAreCheckedWhole) {
  ember::v1::WorkerApplyGradientsRequest req;
  auto* g = req.add_gradients();
  *g->mutable_feature() = Feature({2, 1}, {1, 2, 3});
  const float nan = std::numeric_limits<float>::quiet_NaN();
  g->set_grad(Bytes(std::vector<float>{1, 2, 3, 4, nan, 6, 7, 8}));
  {  // by default passed on whole: the backend refuses NaN/Inf before
     // anything runs (ValidateRequest), the codec leaves nothing out
    const RequestCodec codec = Codec();
    GradientCall call;
    ASSERT_TRUE(codec.ReceiveGradients(req, "", &call).ok());
    const auto part = call.Decode(0, Resolve);
    ASSERT_TRUE(part.ok()) << part.status();
    EXPECT_EQ(part->feature.ids.size(), 3u);
    ASSERT_EQ(part->grad.size(), 8u);
    EXPECT_TRUE(std::isnan(part->grad[4]));
    EXPECT_EQ(call.skipped(), 0);
  }
  {  // skip_nonfinite: bag 1's row is not finite, so its one id is left out
     // and its gradient row zeroed; bag 0 stays whole
    const RequestCodec codec = Codec(1 << 20, /*skip_nonfinite=*/true);
    GradientCall call;
    ASSERT_TRUE(codec.ReceiveGradients(req, "", &call).ok());
    const auto part = call.Decode(0, Resolve);
    ASSERT_TRUE(part.ok()) << part.status();
    EXPECT_EQ(std::vector<int64_t>(part->feature.lengths.begin(), part->feature.lengths.end()),
              (std::vector<int64_t>{2, 0}));
    EXPECT_EQ(std::vector<int64_t>(part->feature.ids.begin(), part->feature.ids.end()),
              (std::vector<int64_t>{1, 2}));
    EXPECT_EQ(std::vector<float>(part->grad.begin(), part->grad.end()),
              (std::vector<float>{1, 2, 3, 4, 0, 0, 0, 0}));
    EXPECT_EQ(call.skipped(), 1);
  }
  {  // an id past the shard's rows (an update's ids are checked here, as
     // parts already applied never reach the backend)
    const RequestCodec codec = Codec();
    ember::v1::WorkerApplyGradientsRequest bad = req;
    bad.mutable_gradients(0)->set_grad(Bytes(std::vector<float>(8, 1.0f)));
    bad.mutable_gradients(0)->mutable_feature()->set_ids(Bytes(std::vector<int64_t>{1, 2, 10}));
    GradientCall call;
    ASSERT_TRUE(codec.ReceiveGradients(bad, "", &call).ok());
    const absl::Status s = call.Decode(0, Resolve).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_NE(s.message().find("10"), std::string::npos) << s;
  }
  {  // channel slices without a channel
    const RequestCodec codec = Codec();
    ember::v1::WorkerApplyGradientsRequest bad = req;
    bad.mutable_gradients(0)->mutable_shm_grad()->set_size(4);
    GradientCall call;
    EXPECT_TRUE(absl::IsInvalidArgument(codec.ReceiveGradients(bad, "", &call)));
  }
}

}  // namespace
}  // namespace worker
}  // namespace ember
