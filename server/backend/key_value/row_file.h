// RowFile: one key_value shard's rows on local SSD (key_value_backend.h).
//
// Row r lies at r * stride() bytes: its record (weights then optimizer
// state, fp32) padded to a multiple of 512 bytes (math::KeyValueRecordStride), so that the file is
// read and written with direct I/O (O_DIRECT): rows go between the drive
// and the shard's cache without passing through the kernel's page cache,
// which would otherwise hold a second copy of hot rows, count against the
// worker's memory limit, and turn every row written into a 4 KiB page
// written back later. Where the file system refuses direct I/O (tmpfs) or
// its alignment, the same layout is read and written through the page
// cache instead.
//
// Batches of rows go to the kernel through io_uring (liburing) with up to
// kRingDepth of them in flight, so that a drive serves them in parallel;
// where io_uring cannot be had (an old kernel, a sandbox that forbids it)
// they fall back to one pread/pwrite a row.
//
// The file is unlinked as soon as it is made, so it lives exactly as long
// as the shard: a worker that is killed leaves no files behind (its shards
// come back from checkpoints, never from these files). Its blocks are
// allocated when it is made, so a full disk refuses the shard, not a
// later write.
//
// Thread-safe: calls may run at once (batches take turns on the ring).
#ifndef EMBER_SERVER_BACKEND_KEY_VALUE_ROW_FILE_H_
#define EMBER_SERVER_BACKEND_KEY_VALUE_ROW_FILE_H_

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace ember {
namespace backend {

// Rows in memory laid out as in the file (stride bytes a row, aligned for
// direct I/O).
class RowBuffer {
 public:
  RowBuffer() = default;
  // RESOURCE_EXHAUSTED when the memory cannot be had.
  absl::Status Resize(int64_t rows, int64_t stride);
  float* row(int64_t k) { return reinterpret_cast<float*>(data_.get() + k * stride_); }
  const float* row(int64_t k) const {
    return reinterpret_cast<const float*>(data_.get() + k * stride_);
  }
  char* bytes() { return data_.get(); }
  const char* bytes() const { return data_.get(); }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> data_;
  int64_t capacity_ = 0;  // bytes
  int64_t stride_ = 0;
};

class RowFile {
 public:
  // Rows a batch keeps in flight at once.
  static constexpr unsigned kRingDepth = 256;

  // A file of `rows` rows of `record_bytes` (read as zeros) in directory
  // `dir`. `what` names it in messages. RESOURCE_EXHAUSTED when the disk
  // (or the file size limit) cannot hold it, FAILED_PRECONDITION when
  // `dir` cannot be written; nothing is left behind on a refusal.
  static absl::StatusOr<std::unique_ptr<RowFile>> Create(const std::string& dir, int64_t rows,
                                                         int64_t record_bytes,
                                                         const std::string& what);
  ~RowFile();
  RowFile(const RowFile&) = delete;
  RowFile& operator=(const RowFile&) = delete;

  // Row rows[k] into (or from) buffer row k (rows that follow each other
  // in the file travel as one I/O); rows distinct and in range
  // (INVALID_ARGUMENT otherwise, nothing done). A failed read is INTERNAL;
  // a failed write RESOURCE_EXHAUSTED for a full disk or file size limit,
  // else INTERNAL; both name the file, the row and the error. On a failure
  // the rows of the batch still in flight finish first.
  absl::Status ReadRows(absl::Span<const int64_t> rows, RowBuffer* buffer) const;
  absl::Status WriteRows(absl::Span<const int64_t> rows, const RowBuffer& buffer);
  // Both in one batch, the drive serving them together: out's rows to
  // write_rows, read_rows into in (the two sets disjoint). On a failure
  // any of the writes may or may not have landed.
  absl::Status Exchange(absl::Span<const int64_t> write_rows, const RowBuffer& out,
                        absl::Span<const int64_t> read_rows, RowBuffer* in);

  int64_t stride() const { return stride_; }
  int64_t bytes() const { return rows_ * stride_; }
  // How rows travel: direct I/O (else the page cache), io_uring batches
  // (else a system call a row).
  bool direct() const;
  bool uses_io_uring() const { return ring_ != nullptr; }

 private:
  struct Ring;
  struct Piece {
    int64_t offset;
    char* data;
    int64_t bytes;
    bool write;
  };
  RowFile(int fd, int64_t rows, int64_t stride, bool direct, std::string what);
  absl::Status CheckRows(absl::Span<const int64_t> rows) const;
  void AddPieces(absl::Span<const int64_t> rows, char* data, bool write,
                 std::vector<Piece>* pieces) const;
  absl::Status Many(absl::Span<const Piece> pieces) const;
  absl::Status One(const Piece& p) const;
  // A direct I/O refused for its alignment (EINVAL): the file goes on
  // through the page cache.
  bool FallBackFromDirect(int err) const;

  const int fd_;
  const int64_t rows_;
  const int64_t stride_;
  const std::string what_;
  mutable absl::Mutex mu_;  // one batch at a time on the ring
  mutable bool direct_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Ring> ring_;  // null: no io_uring
};

// The status an errno from writing or allocating a file maps to:
// RESOURCE_EXHAUSTED for ENOSPC, EDQUOT and EFBIG, else INTERNAL.
absl::Status FileError(int err, const std::string& what);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_KEY_VALUE_ROW_FILE_H_
