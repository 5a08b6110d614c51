#include "client/shared_buffer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace ember {
namespace client {
namespace {

// Descriptors this process holds open on output memfds.
int OutputFds() {
  int n = 0;
  std::error_code ec;
  for (const auto& fd : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    const std::string target = std::filesystem::read_symlink(fd.path(), ec).string();
    if (target.find("memfd:ember-buffer") != std::string::npos) ++n;
  }
  return n;
}

TEST(SharedBuffersTest, LargeBuffersAreSharedSealedAndNamedByANonce) {
  SharedBuffers& ob = SharedBuffers::Global();
  const int fds = OutputFds();
  {
    FloatBuffer v(1 << 20);  // 4 MiB
    auto info = ob.Find(v.data(), v.size() * sizeof(float));
    ASSERT_TRUE(info.has_value());
    EXPECT_EQ(info->pid, getpid());
    EXPECT_EQ(info->base + SharedBuffers::kHeaderBytes, reinterpret_cast<const char*>(v.data()));
    EXPECT_GE(info->size, SharedBuffers::kHeaderBytes + v.size() * sizeof(float));
    uint64_t nonce;
    std::memcpy(&nonce, info->base, sizeof(nonce));
    EXPECT_EQ(nonce, info->nonce);
    // What a worker checks: a memfd sealed against shrinking, of that size.
    EXPECT_NE(fcntl(info->fd, F_GET_SEALS) & F_SEAL_SHRINK, 0);
    EXPECT_EQ(ftruncate(info->fd, 4096), -1) << "a sealed buffer shrank";
    EXPECT_EQ(lseek(info->fd, 0, SEEK_END), static_cast<off_t>(info->size));
    // A range inside is found; one reaching past the end, or outside, is not.
    EXPECT_TRUE(ob.Find(v.data() + 100, 400).has_value());
    EXPECT_FALSE(ob.Find(v.data() + v.size() - 1, 8).has_value());
    EXPECT_FALSE(ob.Find(&nonce, sizeof(nonce)).has_value());
    EXPECT_EQ(OutputFds(), fds + 1);
  }
  // Small ones take ordinary memory.
  FloatBuffer small(100);
  EXPECT_FALSE(ob.Find(small.data(), 4).has_value());
  // A KeyedJaggedTensor's ids (IdBuffer) likewise: a large one is shared,
  // and found by the range of any feature's ids inside it.
  IdBuffer ids(1 << 16);  // 512 KiB
  auto info = ob.Find(ids.data() + 1000, 5000 * sizeof(int64_t));
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->base + SharedBuffers::kHeaderBytes, reinterpret_cast<const char*>(ids.data()));
  IdBuffer few(100);
  EXPECT_FALSE(ob.Find(few.data(), 8).has_value());
}

TEST(SharedBuffersTest, FreedBuffersAreReusedUnlessPoisoned) {
  SharedBuffers& ob = SharedBuffers::Global();
  const float* first;
  uint64_t first_id;
  {
    FloatBuffer v(300000);
    first = v.data();
    first_id = ob.Find(first, 4)->id;
  }
  {
    FloatBuffer v(290000);  // fits the freed one: taken again, not zeroed
    EXPECT_EQ(v.data(), first);
  }
  {
    FloatBuffer v(10 << 20);  // far larger: a new one
    EXPECT_NE(v.data(), first);
  }
  {
    FloatBuffer v(300000);
    ASSERT_EQ(v.data(), first);
    ob.Poison(v.data() + 5);
  }
  // Poisoned: unmapped when freed, never handed out again.
  FloatBuffer again(300000);
  EXPECT_TRUE(ob.Find(again.data(), 4).has_value());
  for (int i = 0; i < 8; ++i) {
    FloatBuffer v(300000);
    auto info = ob.Find(v.data(), 4);
    ASSERT_TRUE(info.has_value());
    EXPECT_NE(info->id, first_id) << "a poisoned buffer came back";
  }
}

TEST(SharedBuffersTest, ResizeDoesNotClearAndKeptBuffersAreBounded) {
  SharedBuffers& ob = SharedBuffers::Global();
  {
    FloatBuffer v(300000, 7.0f);
    v.resize(100000);
    v.resize(300000);  // within capacity: the old values stay
    EXPECT_EQ(v[200000], 7.0f);
  }
  {
    std::vector<FloatBuffer> many;
    for (int i = 0; i < 3 * SharedBuffers::kMaxKept; ++i) many.emplace_back(300000 + 4096 * i);
  }
  EXPECT_LE(ob.kept_buffers(), SharedBuffers::kMaxKept);
  {
    // Past kMaxKeptBytes together, the older ones go; one larger alone is
    // not kept at all.
    std::vector<FloatBuffer> big;
    for (int i = 0; i < 3; ++i) big.emplace_back(SharedBuffers::kMaxKeptBytes / 4 / 3 + 4096 * i);
    big.emplace_back(SharedBuffers::kMaxKeptBytes / 4 + 1);
  }
  EXPECT_LE(ob.kept_buffers(), 2);
  // Past kMaxShared live buffers, ordinary memory.
  std::vector<FloatBuffer> live;
  for (int i = 0; i < SharedBuffers::kMaxShared + 4; ++i) live.emplace_back(70000);
  EXPECT_LE(ob.shared_buffers(), SharedBuffers::kMaxShared);
  EXPECT_FALSE(ob.Find(live.back().data(), 4).has_value());
  live.clear();
  EXPECT_LE(OutputFds(), SharedBuffers::kMaxKept) << "freed buffers kept their descriptors";
}

// After fork() the child's copy of a live buffer is its own (neither
// process sees the other's later writes), is never named to a worker, and
// the child never takes a buffer the parent kept.
TEST(SharedBuffersTest, AForkedChildSharesNoBufferWithItsParent) {
  SharedBuffers& ob = SharedBuffers::Global();
  FloatBuffer live(300000, 1.0f);
  const float* kept_at;
  {
    FloatBuffer kept(300000);
    kept_at = kept.data();
  }
  ASSERT_TRUE(ob.Find(live.data(), 4).has_value());
  int go[2], ready[2];  // the parent's word that it wrote; the child's that it forked
  ASSERT_EQ(pipe(go), 0);
  ASSERT_EQ(pipe(ready), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 0;
    if (ob.Find(live.data(), 4).has_value()) code |= 1;  // would be named to a worker
    char c;
    if (write(ready[1], "r", 1) != 1) code |= 8;
    if (read(go[0], &c, 1) != 1 || live[1] != 1.0f) code |= 4;  // saw the parent's write
    live[0] = 42.0f;
    FloatBuffer fresh(300000);  // not the parent's kept buffer (checked below)
    std::fill(fresh.begin(), fresh.end(), 43.0f);
    _exit(code);
  }
  char c;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  live[1] = 7.0f;
  ASSERT_EQ(write(go[1], "x", 1), 1);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  for (int fd : {go[0], go[1], ready[0], ready[1]}) close(fd);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status) & 4, 0) << "the parent's write reached the child";
  EXPECT_EQ(WEXITSTATUS(status) & 1, 0) << "the child would hand an inherited buffer to a worker";
  EXPECT_EQ(live[0], 1.0f) << "the child's write reached the parent";
  FloatBuffer again(300000);
  EXPECT_EQ(again.data(), kept_at);  // still the parent's to reuse
  EXPECT_EQ(std::count(again.begin(), again.end(), 43.0f), 0)
      << "the child wrote into the parent's kept buffer";
}

}  // namespace
}  // namespace client
}  // namespace ember
