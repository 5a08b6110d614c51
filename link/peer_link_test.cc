// Peer links (peer_link.h): socket links everywhere; NCCL links where two
// GPUs are visible (skipped otherwise). The same checks run on both kinds:
// transfers in order both ways, a size the two ends disagree on, a peer that
// never queues its side, a peer that goes away, joins that time out.
#include "link/peer_link.h"

#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "cuda/device_query.h"
#include "gtest/gtest.h"
#ifdef EMBER_NCCL_ON_HOST
#include "link/fake_nccl.h"
#endif

namespace ember {
namespace cuda {
namespace {

struct Pair {
  std::unique_ptr<PeerLink> a, b;  // ranks 0 and 1
};

// Joins a new link of `links` from two threads (devices 0 and 1).
absl::StatusOr<Pair> Join(PeerLinks* links) {
  auto id = links->NewId();
  if (!id.ok()) return id.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<PeerLink>> a, b;
  std::thread t([&] { a = links->Join(*id, 0, 0, deadline); });
  b = links->Join(*id, 1, 1, deadline);
  t.join();
  if (!a.ok()) return a.status();
  if (!b.ok()) return b.status();
  return Pair{*std::move(a), *std::move(b)};
}

class PeerLinkTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
#ifdef EMBER_NCCL_ON_HOST
    // nccl_link.cc over the stand-in, on the host runtime's two devices.
    static PeerLinks* fake = NcclLinksOver(FakeNccl()).release();
    absl::StatusOr<PeerLinks*> links = GetParam() == "nccl" ? fake : PeerLinksNamed(GetParam());
#else
    auto links = PeerLinksNamed(GetParam());
#endif
    ASSERT_TRUE(links.ok()) << links.status();
    if (GetParam() == "nccl") {
      auto devices = QueryDevices();
      if (!devices.ok() || devices->size() < 2) GTEST_SKIP() << "NCCL links need two GPUs";
    }
    links_ = *links;
    auto pair = Join(links_);
    ASSERT_TRUE(pair.ok()) << pair.status();
    pair_ = *std::move(pair);
  }
  // Memory of `link` holding `values`.
  static void* Holding(PeerLink* link, const std::vector<int64_t>& values) {
    auto m = link->Allocate(values.size() * 8);
    EXPECT_TRUE(m.ok()) << m.status();
    EXPECT_TRUE(link->CopyIn(*m, values.data(), values.size() * 8).ok());
    return *m;
  }
  static absl::Time Soon() { return absl::Now() + absl::Seconds(20); }

  PeerLinks* links_ = nullptr;
  Pair pair_;
};

TEST_P(PeerLinkTest, TransfersArriveInOrderBothWays) {
  std::vector<int64_t> first(1000), second(3), back(70000);
  std::iota(first.begin(), first.end(), 1);
  std::iota(second.begin(), second.end(), -5);
  std::iota(back.begin(), back.end(), 100);
  void* f = Holding(pair_.a.get(), first);
  void* s = Holding(pair_.a.get(), second);
  void* k = Holding(pair_.b.get(), back);
  auto rf = pair_.b->Allocate(first.size() * 8);
  auto rs = pair_.b->Allocate(second.size() * 8);
  auto rk = pair_.a->Allocate(back.size() * 8);
  ASSERT_TRUE(rf.ok() && rs.ok() && rk.ok());
  // a sends two, then receives one; b the mirror image.
  ASSERT_TRUE(pair_.a->Send(f, first.size() * 8).ok());
  ASSERT_TRUE(pair_.a->Send(s, second.size() * 8).ok());
  ASSERT_TRUE(pair_.a->Recv(*rk, back.size() * 8).ok());
  ASSERT_TRUE(pair_.b->Recv(*rf, first.size() * 8).ok());
  ASSERT_TRUE(pair_.b->Recv(*rs, second.size() * 8).ok());
  ASSERT_TRUE(pair_.b->Send(k, back.size() * 8).ok());
  std::vector<int64_t> got_first(first.size()), got_second(second.size()), got_back(back.size());
  ASSERT_TRUE(pair_.b->CopyOut(got_first.data(), *rf, first.size() * 8).ok());
  ASSERT_TRUE(pair_.b->CopyOut(got_second.data(), *rs, second.size() * 8).ok());
  ASSERT_TRUE(pair_.a->CopyOut(got_back.data(), *rk, back.size() * 8).ok());
  ASSERT_TRUE(pair_.a->Wait(Soon()).ok());
  ASSERT_TRUE(pair_.b->Wait(Soon()).ok());
  EXPECT_EQ(got_first, first);
  EXPECT_EQ(got_second, second);
  EXPECT_EQ(got_back, back);
  // Empty transfers are transfers too.
  ASSERT_TRUE(pair_.a->Send(f, 0).ok());
  ASSERT_TRUE(pair_.b->Recv(*rf, 0).ok());
  EXPECT_TRUE(pair_.a->Wait(Soon()).ok());
  EXPECT_TRUE(pair_.b->Wait(Soon()).ok());
}

// Rows copied on the device, in stream order, and between host and device
// at once.
TEST_P(PeerLinkTest, RowsAreCopiedBetweenPitches) {
  std::vector<int64_t> wide = {1, 2, 3, 4, 5, 6, 7, 8, 9};  // 3 rows of 3, the first 2 wanted
  void* src = Holding(pair_.a.get(), wide);
  auto dst = pair_.a->Allocate(6 * 8);
  ASSERT_TRUE(dst.ok());
  ASSERT_TRUE(pair_.a->CopyRows(*dst, 16, src, 24, 16, 3).ok());
  std::vector<int64_t> got(6);
  ASSERT_TRUE(pair_.a->CopyOut(got.data(), *dst, 48).ok());
  ASSERT_TRUE(pair_.a->Wait(Soon()).ok());
  EXPECT_EQ(got, (std::vector<int64_t>{1, 2, 4, 5, 7, 8}));
  // Host rows into the device's, pitched, and back.
  const std::vector<int64_t> host = {10, 20, 30, 40};
  ASSERT_TRUE(links_->CopyRowsNow(0, true, *dst, 24, host.data(), 16, 16, 2).ok());
  std::vector<int64_t> back(6, 0);
  ASSERT_TRUE(links_->CopyRowsNow(0, false, back.data(), 8 * 3, *dst, 24, 16, 2).ok());
  EXPECT_EQ(back, (std::vector<int64_t>{10, 20, 0, 30, 40, 0}));
}

TEST_P(PeerLinkTest, APeerThatNeverQueuesItsSideLosesTheLinkAtTheDeadline) {
  auto m = pair_.a->Allocate(4096);
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE(pair_.a->Recv(*m, 4096).ok());
  const absl::Time start = absl::Now();
  absl::Status s = pair_.a->Wait(absl::Now() + absl::Milliseconds(300));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // Lost for good: every later call answers the same.
  EXPECT_EQ(pair_.a->Send(*m, 8).code(), s.code());
  EXPECT_EQ(pair_.a->Wait(Soon()).code(), s.code());
}

TEST_P(PeerLinkTest, APeerThatGoesAwayLosesTheLink) {
  auto m = pair_.a->Allocate(4096);
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE(pair_.a->Recv(*m, 4096).ok());
  pair_.b.reset();
  absl::Status s = pair_.a->Wait(absl::Now() + absl::Seconds(10));
  EXPECT_FALSE(s.ok());
  EXPECT_FALSE(pair_.a->Send(*m, 8).ok());
}

INSTANTIATE_TEST_SUITE_P(Kinds, PeerLinkTest, ::testing::Values("socket", "nccl"));

// Only socket links frame their transfers: NCCL leaves a size mismatch
// undefined, which is why channels never let one happen.
TEST(SocketLinkTest, SizesTheEndsDisagreeOnLoseTheLink) {
  auto pair = Join(SocketLinks());
  ASSERT_TRUE(pair.ok()) << pair.status();
  auto m = pair->a->Allocate(64);
  auto r = pair->b->Allocate(64);
  ASSERT_TRUE(m.ok() && r.ok());
  ASSERT_TRUE(pair->a->Send(*m, 64).ok());
  ASSERT_TRUE(pair->b->Recv(*r, 32).ok());
  absl::Status s = pair->b->Wait(absl::Now() + absl::Seconds(10));
  EXPECT_TRUE(absl::IsInternal(s)) << s;
  EXPECT_NE(s.message().find("sent 64 bytes where 32 were expected"), std::string::npos) << s;
}

TEST(SocketLinkTest, JoinsTimeOutAndIdsAreChecked) {
  auto id = SocketLinks()->NewId();
  ASSERT_TRUE(id.ok());
  for (int rank : {0, 1}) {
    const absl::Time start = absl::Now();
    auto link = SocketLinks()->Join(*id, rank, 0, absl::Now() + absl::Milliseconds(200));
    EXPECT_TRUE(absl::IsDeadlineExceeded(link.status())) << rank << ": " << link.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
  EXPECT_TRUE(absl::IsInvalidArgument(
      SocketLinks()->Join("not-a-link", 0, 0, absl::Now() + absl::Seconds(1)).status()));
  EXPECT_TRUE(
      absl::IsInvalidArgument(SocketLinks()->Join(*id, 2, 0, absl::Now() + absl::Seconds(1)).status()));
  auto other = SocketLinks()->NewId();
  ASSERT_TRUE(other.ok());
  EXPECT_NE(*id, *other);
  EXPECT_TRUE(absl::IsInvalidArgument(PeerLinksNamed("tcp").status()));
}

#ifndef EMBER_NCCL_ON_HOST  // the real library, on the real runtime
TEST(NcclLinkTest, IdsAreMadeWithoutAGpu) {
  auto links = NcclLinks();
  if (!links.ok()) GTEST_SKIP() << links.status();  // a build without NCCL
  EXPECT_EQ((*links)->name(), "nccl");
  auto id = (*links)->NewId();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(id->size(), 128u);
  EXPECT_TRUE(absl::IsInvalidArgument(
      (*links)->Join("short", 0, 0, absl::Now() + absl::Seconds(1)).status()));
}
#endif

}  // namespace
}  // namespace cuda
}  // namespace ember
