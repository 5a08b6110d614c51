#include "server/backend/key_value/row_file.h"

#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "math/embedding_math.h"

namespace ember {
namespace backend {
namespace {
// A range is read or written in pieces of at most this many bytes.
constexpr int64_t kMaxPieceBytes = int64_t{1} << 20;
// Buffers are aligned to a page: direct I/O's memory alignment on every
// drive.
constexpr size_t kAlign = 4096;
}  // namespace

absl::Status FileError(int err, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOSPC || err == EDQUOT || err == EFBIG) {
    return absl::ResourceExhaustedError(message);
  }
  return absl::InternalError(message);
}

absl::Status RowBuffer::Resize(int64_t rows, int64_t stride) {
  stride_ = stride;
  const int64_t bytes =
      (std::max<int64_t>(rows, 1) * stride + static_cast<int64_t>(kAlign) - 1) / kAlign * kAlign;
  if (bytes <= capacity_ && data_ != nullptr) return absl::OkStatus();
  char* p = static_cast<char*>(std::aligned_alloc(kAlign, static_cast<size_t>(bytes)));
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no memory for ", rows, " rows of I/O buffer"));
  }
  data_.reset(p);
  capacity_ = bytes;
  return absl::OkStatus();
}

struct RowFile::Ring {
  io_uring ring;
  ~Ring() { io_uring_queue_exit(&ring); }
};

absl::StatusOr<std::unique_ptr<RowFile>> RowFile::Create(const std::string& dir, int64_t rows,
                                                         int64_t record_bytes,
                                                         const std::string& what) {
  if (rows <= 0 || record_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", rows, " rows of ", record_bytes, " bytes"));
  }
  if (dir.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": no SSD directory (--ssd_dir)"));
  }
  const int64_t stride = math::KeyValueRecordStride(record_bytes);
  const int64_t bytes = rows * stride;
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
  // Direct I/O where the file system takes it; else through the page cache,
  // with read-ahead off (rows are read one here, one there).
  const int flags = fcntl(fd, F_GETFL);
  const bool direct = flags >= 0 && fcntl(fd, F_SETFL, flags | O_DIRECT) == 0;
  if (!direct) (void)posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
  std::unique_ptr<RowFile> file(new RowFile(fd, rows, stride, direct, what));
  if (direct) {
    // Zeros written once: a direct write into an allocated but never
    // written block first converts it (a journal update each), which ran
    // seven times slower than rewriting it (docs/lab-notes/2026-11-28-key-value.md).
    RowBuffer zeros;
    const int64_t per = std::max<int64_t>(1, kMaxPieceBytes / stride);
    if (absl::Status s = zeros.Resize(per, stride); !s.ok()) return s;
    std::memset(zeros.bytes(), 0, static_cast<size_t>(per * stride));
    std::vector<Piece> pieces;
    for (int64_t r = 0; r < rows; r += per) {
      pieces.push_back({r * stride, zeros.bytes(), std::min(per, rows - r) * stride, true});
    }
    if (absl::Status s = file->Many(pieces); !s.ok()) return s;
  }
  return file;
}

RowFile::RowFile(int fd, int64_t rows, int64_t stride, bool direct, std::string what)
    : fd_(fd), rows_(rows), stride_(stride), what_(std::move(what)), direct_(direct) {
  auto ring = std::make_unique<Ring>();
  if (io_uring_queue_init(kRingDepth, &ring->ring, 0) == 0) ring_ = std::move(ring);
}

RowFile::~RowFile() {
  ring_.reset();
  close(fd_);
}

bool RowFile::direct() const {
  absl::MutexLock lock(&mu_);
  return direct_;
}

absl::Status RowFile::CheckRows(absl::Span<const int64_t> rows) const {
  for (int64_t r : rows) {
    if (r < 0 || r >= rows_) {
      return absl::InvalidArgumentError(
          absl::StrCat(what_, ": row ", r, " outside its ", rows_, " rows"));
    }
  }
  return absl::OkStatus();
}

// Row rows[k] to or from buffer row k, rows that follow each other in the
// file (and so in the buffer) joined into one piece of at most
// kMaxPieceBytes: a run of records is one I/O.
void RowFile::AddPieces(absl::Span<const int64_t> rows, char* data, bool write,
                        std::vector<Piece>* pieces) const {
  for (size_t k = 0; k < rows.size(); ++k) {
    Piece* last = pieces->empty() ? nullptr : &pieces->back();
    if (last != nullptr && k > 0 && last->write == write && rows[k] == rows[k - 1] + 1 &&
        last->bytes + stride_ <= kMaxPieceBytes) {
      last->bytes += stride_;
      continue;
    }
    pieces->push_back({rows[k] * stride_, data + k * stride_, stride_, write});
  }
}

absl::Status RowFile::ReadRows(absl::Span<const int64_t> rows, RowBuffer* buffer) const {
  if (absl::Status s = CheckRows(rows); !s.ok()) return s;
  std::vector<Piece> pieces;
  AddPieces(rows, buffer->bytes(), /*write=*/false, &pieces);
  return Many(pieces);
}

absl::Status RowFile::WriteRows(absl::Span<const int64_t> rows, const RowBuffer& buffer) {
  if (absl::Status s = CheckRows(rows); !s.ok()) return s;
  std::vector<Piece> pieces;
  AddPieces(rows, const_cast<char*>(buffer.bytes()), /*write=*/true, &pieces);
  return Many(pieces);
}

absl::Status RowFile::Exchange(absl::Span<const int64_t> write_rows, const RowBuffer& out,
                               absl::Span<const int64_t> read_rows, RowBuffer* in) {
  if (absl::Status s = CheckRows(write_rows); !s.ok()) return s;
  if (absl::Status s = CheckRows(read_rows); !s.ok()) return s;
  std::vector<Piece> pieces;
  AddPieces(write_rows, const_cast<char*>(out.bytes()), /*write=*/true, &pieces);
  AddPieces(read_rows, in->bytes(), /*write=*/false, &pieces);
  return Many(pieces);
}

bool RowFile::FallBackFromDirect(int err) const {
  if (err != EINVAL || !direct_) return false;
  const int flags = fcntl(fd_, F_GETFL);
  if (flags < 0 || fcntl(fd_, F_SETFL, flags & ~O_DIRECT) != 0) return false;
  direct_ = false;
  (void)posix_fadvise(fd_, 0, 0, POSIX_FADV_RANDOM);
  return true;
}

absl::Status RowFile::One(const Piece& piece) const {
  Piece p = piece;
  const bool write = p.write;
  while (p.bytes > 0) {
    const ssize_t done = write ? pwrite(fd_, p.data, static_cast<size_t>(p.bytes), p.offset)
                               : pread(fd_, p.data, static_cast<size_t>(p.bytes), p.offset);
    if (done < 0 && errno == EINTR) continue;
    if (done < 0 && FallBackFromDirect(errno)) continue;
    if (done <= 0) {
      const int err = done == 0 ? EIO : errno;
      const std::string what =
          absl::StrCat(what_, write ? ": writing " : ": reading ", p.bytes, " bytes at ", p.offset);
      return write ? FileError(err, what)
                   : absl::InternalError(absl::StrCat(what, ": ", std::strerror(err)));
    }
    p.data += done;
    p.offset += done;
    p.bytes -= done;
  }
  return absl::OkStatus();
}

absl::Status RowFile::Many(absl::Span<const Piece> pieces) const {
  absl::MutexLock lock(&mu_);
  if (ring_ == nullptr) {
    for (const Piece& p : pieces) {
      if (absl::Status s = One(p); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  io_uring* ring = &ring_->ring;
  absl::Status first;
  size_t next = 0, in_flight = 0;
  while (next < pieces.size() || in_flight > 0) {
    // Fill the ring, unless a piece failed: then only drain it.
    while (first.ok() && next < pieces.size() && in_flight < kRingDepth) {
      io_uring_sqe* sqe = io_uring_get_sqe(ring);
      if (sqe == nullptr) break;
      const Piece& p = pieces[next];
      if (p.write) {
        io_uring_prep_write(sqe, fd_, p.data, static_cast<unsigned>(p.bytes),
                            static_cast<uint64_t>(p.offset));
      } else {
        io_uring_prep_read(sqe, fd_, p.data, static_cast<unsigned>(p.bytes),
                           static_cast<uint64_t>(p.offset));
      }
      io_uring_sqe_set_data64(sqe, next);
      ++next;
      ++in_flight;
    }
    if (in_flight == 0) break;
    const int r = io_uring_submit_and_wait(ring, 1);
    if (r < 0 && r != -EINTR) return FileError(-r, absl::StrCat(what_, ": io_uring"));
    io_uring_cqe* cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(ring, head, cqe) {
      ++seen;
      if (!first.ok()) continue;
      const Piece& p = pieces[io_uring_cqe_get_data64(cqe)];
      const int res = cqe->res;
      if (res >= p.bytes) continue;
      if (res >= 0) {  // short: the rest the plain way
        first = One(Piece{p.offset + res, p.data + res, p.bytes - res, p.write});
      } else if (-res == EINTR || -res == EAGAIN || FallBackFromDirect(-res)) {
        first = One(p);
      } else {
        const std::string what = absl::StrCat(what_, p.write ? ": writing " : ": reading ", p.bytes,
                                              " bytes at ", p.offset);
        first = p.write ? FileError(-res, what)
                        : absl::InternalError(absl::StrCat(what, ": ", std::strerror(-res)));
      }
    }
    io_uring_cq_advance(ring, seen);
    in_flight -= seen;
  }
  return first;
}

}  // namespace backend
}  // namespace ember
