#include "server/backend/key_value/row_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace ember {
namespace backend {

absl::Status FileError(int err, const std::string &what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOSPC || err == EDQUOT || err == EFBIG) {
    return absl::ResourceExhaustedError(message);
  }
  return absl::InternalError(message);
}

absl::StatusOr<std::unique_ptr<RowFile>> RowFile::Create(const std::string &dir, int64_t bytes,
                                                         const std::string &what) {
  if (bytes <= 0) return absl::InvalidArgumentError(absl::StrCat(what, ": ", bytes, " bytes"));
  if (dir.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": no SSD directory (--ssd_dir)"));
  }
  std::string path = dir + "/ember-kv-XXXXXX";
  std::vector<char> name(path.begin(), path.end());
  name.push_back('\0');
  const int fd = mkstemp(name.data());
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": cannot make a file in '", dir,
                                                      "' (--ssd_dir): ", std::strerror(errno)));
  }
  unlink(name.data());  // the file now lives as long as the descriptor
  // Blocks allocated now: a full disk refuses the shard instead of a write
  // in the middle of serving it. Where the file system cannot allocate
  // ahead, the file is sized (sparse) instead.
  int err = posix_fallocate(fd, 0, bytes);
  if (err == EOPNOTSUPP || err == EINVAL) err = ftruncate(fd, bytes) == 0 ? 0 : errno;
  if (err != 0) {
    close(fd);
    return FileError(err, absl::StrCat(what, ": allocating ", bytes, " bytes in '", dir, "'"));
  }
  return std::unique_ptr<RowFile>(new RowFile(fd, bytes, what));
}

RowFile::~RowFile() { close(fd_); }

absl::Status RowFile::Check(int64_t offset, int64_t n) const {
  if (offset < 0 || n < 0 || offset > bytes_ || n > bytes_ - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat(what_, ": bytes [", offset, ", +", n, ") outside its ", bytes_));
  }
  return absl::OkStatus();
}

absl::Status RowFile::Read(int64_t offset, void *out, int64_t n) const {
  if (absl::Status s = Check(offset, n); !s.ok()) return s;
  char *p = static_cast<char *>(out);
  while (n > 0) {
    const ssize_t got = pread(fd_, p, static_cast<size_t>(n), offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return absl::InternalError(absl::StrCat(what_, ": reading ", n, " bytes at ", offset, ": ",
                                              got == 0 ? "end of file" : std::strerror(errno)));
    }
    p += got;
    offset += got;
    n -= got;
  }
  return absl::OkStatus();
}

absl::Status RowFile::Write(int64_t offset, const void *in, int64_t n) {
  if (absl::Status s = Check(offset, n); !s.ok()) return s;
  const char *p = static_cast<const char *>(in);
  while (n > 0) {
    const ssize_t put = pwrite(fd_, p, static_cast<size_t>(n), offset);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) {
      return FileError(put == 0 ? EIO : errno,
                       absl::StrCat(what_, ": writing ", n, " bytes at ", offset));
    }
    p += put;
    offset += put;
    n -= put;
  }
  return absl::OkStatus();
}

}  // namespace backend
}  // namespace ember
