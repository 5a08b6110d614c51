// RowFile against the bytes written: rows written one batch at a time (and
// rows side by side, and writes and reads in one batch) read back equal, in a
// directory on disk (direct I/O where its file system takes it) and in
// /dev/shm (tmpfs: the page cache); rows outside the file are refused
// before anything is done; a new file reads as zeros.
#include "server/backend/key_value/row_file.h"

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "math/embedding_math.h"

namespace ember {
namespace backend {
namespace {

std::vector<std::string> Dirs() {
  const char* t = std::getenv("TEST_TMPDIR");
  return {t != nullptr ? t : "/tmp", "/dev/shm"};
}

// Row k of a buffer: its floats k * 1000 + i.
void Fill(RowBuffer* b, int64_t rows, int64_t floats, int64_t salt) {
  for (int64_t k = 0; k < rows; ++k) {
    for (int64_t i = 0; i < floats; ++i) b->row(k)[i] = static_cast<float>(salt + k * 1000 + i);
  }
}

TEST(RowFileTest, RowsReadBackAsWritten) {
  for (const std::string& dir : Dirs()) {
    SCOPED_TRACE(dir);
    constexpr int64_t kRows = 3000, kFloats = 65;  // 260 bytes: a 512-byte stride
    auto f = RowFile::Create(dir, kRows, kFloats * 4, "test file");
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ((*f)->stride(), 512);
    EXPECT_EQ((*f)->bytes(), kRows * 512);
    std::printf("%s: direct I/O %d, io_uring %d\n", dir.c_str(), (*f)->direct(),
                (*f)->uses_io_uring());
    RowBuffer zeros;
    ASSERT_TRUE(zeros.Resize(2, 512).ok());
    const std::vector<int64_t> two = {0, kRows - 1};
    ASSERT_TRUE((*f)->ReadRows(two, &zeros).ok());
    EXPECT_EQ(zeros.row(0)[0], 0.0f);
    EXPECT_EQ(zeros.row(1)[kFloats - 1], 0.0f);

    // 600 random distinct rows (more than the ring holds at once).
    std::mt19937_64 rng(1);
    std::vector<int64_t> rows;
    for (int64_t r = 0; r < kRows; ++r) {
      if (rng() % 5 == 0) rows.push_back(r);
    }
    std::shuffle(rows.begin(), rows.end(), rng);
    ASSERT_GT(rows.size(), RowFile::kRingDepth);
    RowBuffer out, in;
    ASSERT_TRUE(out.Resize(static_cast<int64_t>(rows.size()), 512).ok());
    Fill(&out, static_cast<int64_t>(rows.size()), kFloats, 7);
    ASSERT_TRUE((*f)->WriteRows(rows, out).ok());
    ASSERT_TRUE(in.Resize(static_cast<int64_t>(rows.size()), 512).ok());
    ASSERT_TRUE((*f)->ReadRows(rows, &in).ok());
    for (size_t k = 0; k < rows.size(); ++k) {
      ASSERT_EQ(std::memcmp(in.row(k), out.row(k), kFloats * 4), 0) << "row " << rows[k];
    }
    // Rows side by side (one piece), then writes and reads in one batch.
    RowBuffer range, back;
    ASSERT_TRUE(range.Resize(10, 512).ok());
    Fill(&range, 10, kFloats, 99);
    const std::vector<int64_t> run = {100, 101, 102, 103, 104, 105, 106, 107, 108, 109};
    ASSERT_TRUE((*f)->WriteRows(run, range).ok());  // rows side by side: one write
    const std::vector<int64_t> w = {5, 6}, r = {100, 109, rows[0]};
    RowBuffer pair;
    ASSERT_TRUE(pair.Resize(2, 512).ok());
    Fill(&pair, 2, kFloats, 5);
    ASSERT_TRUE(back.Resize(3, 512).ok());
    ASSERT_TRUE((*f)->Exchange(w, pair, r, &back).ok());
    EXPECT_EQ(std::memcmp(back.row(0), range.row(0), kFloats * 4), 0);
    EXPECT_EQ(std::memcmp(back.row(1), range.row(9), kFloats * 4), 0);
    EXPECT_EQ(std::memcmp(back.row(2), out.row(0), kFloats * 4), 0);
    ASSERT_TRUE((*f)->ReadRows(std::vector<int64_t>{5, 6}, &back).ok());
    EXPECT_EQ(std::memcmp(back.row(0), pair.row(0), kFloats * 4), 0);
    EXPECT_EQ(std::memcmp(back.row(1), pair.row(1), kFloats * 4), 0);

    // Outside the file: refused, nothing read or written.
    const std::vector<int64_t> bad = {1, kRows};
    EXPECT_EQ((*f)->WriteRows(bad, pair).code(), absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE((*f)->ReadRows(std::vector<int64_t>{1}, &back).ok());
    EXPECT_EQ(back.row(0)[0], 0.0f);  // row 1 was never written
    EXPECT_EQ((*f)->ReadRows(std::vector<int64_t>{kRows - 1, kRows}, &back).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*f)->ReadRows(std::vector<int64_t>{-1}, &back).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(RowFileTest, RefusesWhatCannotBeMade) {
  EXPECT_EQ(RowFile::Create("", 10, 4, "f").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(RowFile::Create("/nonexistent/dir", 10, 4, "f").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(RowFile::Create("/tmp", 0, 4, "f").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(math::KeyValueRecordStride(1), 512);
  EXPECT_EQ(math::KeyValueRecordStride(512), 512);
  EXPECT_EQ(math::KeyValueRecordStride(513), 1024);
  EXPECT_EQ(math::KeyValueSlackRows(10, 2), 5);    // half the rows
  EXPECT_EQ(math::KeyValueSlackRows(10, 7), 7);    // at least the cache's
  EXPECT_EQ(math::KeyValueSlackRows(11, 11), 11);  // at most the rows
}

}  // namespace
}  // namespace backend
}  // namespace ember
