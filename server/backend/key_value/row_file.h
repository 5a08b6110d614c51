// RowFile: one key_value shard's rows on local SSD (key_value_backend.h), a
// file read and written at positions. The file is unlinked as soon as it
// is made, so it lives exactly as long as the shard: a worker that is
// killed leaves no files behind (its shards come back from checkpoints,
// never from these files). Its blocks are allocated when it is made, so
// a full disk refuses the shard, not a later write.
#ifndef EMBER_SERVER_BACKEND_KEY_VALUE_ROW_FILE_H_
#define EMBER_SERVER_BACKEND_KEY_VALUE_ROW_FILE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ember {
namespace backend {

class RowFile {
 public:
  // A file of `bytes` bytes (read as zeros) in directory `dir`. `what`
  // names it in messages. RESOURCE_EXHAUSTED when the disk (or the file
  // size limit) cannot hold it, FAILED_PRECONDITION when `dir` cannot be
  // written, nothing left behind on a refusal.
  static absl::StatusOr<std::unique_ptr<RowFile>> Create(const std::string &dir, int64_t bytes,
                                                         const std::string &what);
  ~RowFile();
  RowFile(const RowFile &) = delete;
  RowFile &operator=(const RowFile &) = delete;

  // `n` bytes at `offset`, which must lie inside the file (INVALID_ARGUMENT
  // otherwise). A failed read is INTERNAL; a failed write RESOURCE_EXHAUSTED
  // for a full disk or file size limit, else INTERNAL; both name the file
  // and the error. Safe from several threads at once.
  absl::Status Read(int64_t offset, void *out, int64_t n) const;
  absl::Status Write(int64_t offset, const void *in, int64_t n);

  int64_t bytes() const { return bytes_; }

 private:
  RowFile(int fd, int64_t bytes, std::string what)
      : fd_(fd), bytes_(bytes), what_(std::move(what)) {}
  absl::Status Check(int64_t offset, int64_t n) const;

  const int fd_;
  const int64_t bytes_;
  const std::string what_;
};

// The status an errno from writing or allocating a file maps to:
// RESOURCE_EXHAUSTED for ENOSPC, EDQUOT and EFBIG, else INTERNAL.
absl::Status FileError(int err, const std::string &what);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_KEY_VALUE_ROW_FILE_H_
