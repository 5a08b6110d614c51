#include "server/checkpoint/checkpoint_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <type_traits>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/json_util.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace checkpoint {
namespace {

constexpr char kShardMagic[8] = {'E', 'M', 'B', 'S', 'H', 'R', 'D', '1'};
constexpr char kDeltaMagic[8] = {'E', 'M', 'B', 'D', 'E', 'L', 'T', '1'};
constexpr int64_t kHeaderBytes = 8 + 5 * 8;
constexpr int64_t kDeltaHeaderBytes = 8 + 6 * 8;
constexpr size_t kMaxChain = 10000;
constexpr size_t kChunk = size_t{4} << 20;

std::string Join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

absl::Status Errno(const std::string& what, const std::string& path) {
  const int e = errno;
  const std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(e));
  if (e == ENOENT) return absl::NotFoundError(message);
  if (e == ENOSPC || e == EDQUOT) return absl::ResourceExhaustedError(message);
  if (e == EACCES || e == EPERM || e == EROFS) return absl::PermissionDeniedError(message);
  return absl::InternalError(message);
}

// An fd closed on scope exit.
class File {
 public:
  explicit File(int fd) : fd_(fd) {}
  ~File() {
    if (fd_ >= 0) close(fd_);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  int fd() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

absl::Status WriteAll(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = write(fd, p, std::min(n, kChunk));
    if (w < 0) {
      if (errno == EINTR) continue;
      return Errno("writing", path);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

// Reads up to n bytes; returns how many (fewer only at end of file).
absl::StatusOr<size_t> ReadUpTo(int fd, void* data, size_t n, const std::string& path) {
  char* p = static_cast<char*>(data);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = read(fd, p + got, std::min(n - got, kChunk));
    if (r < 0) {
      if (errno == EINTR) continue;
      return Errno("reading", path);
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return got;
}

absl::Status FsyncDir(const std::string& dir) {
  File d(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.fd() < 0) return Errno("opening directory", dir);
  if (fsync(d.fd()) != 0) return Errno("fsync of directory", dir);
  return absl::OkStatus();
}

uint32_t Crc(uint32_t crc, const void* data, size_t n) {
  if (n == 0) return crc;  // zlib answers a null buffer with the initial value
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), n));
}

absl::Status DataLoss(const std::string& path, const std::string& what) {
  return absl::DataLossError(absl::StrCat("checkpoint file ", path, " is damaged: ", what));
}

bool IsDir(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

std::vector<std::string> Subdirs(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    if (IsDir(Join(dir, name))) out.push_back(name);
  }
  closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// "ckpt-<ms>-e<epoch>" -> ms, or -1.
int64_t CreatedMs(const std::string& name) {
  if (!absl::StartsWith(name, "ckpt-")) return -1;
  std::vector<std::string> parts = absl::StrSplit(name.substr(5), '-');
  int64_t ms;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &ms)) return -1;
  return ms;
}

std::vector<std::string> CheckpointDirs(const std::string& root, const std::string& collection,
                                        bool committed) {
  std::vector<std::pair<int64_t, std::string>> found;
  const std::string base = Join(root, collection);
  for (const std::string& name : Subdirs(base)) {
    const int64_t ms = CreatedMs(name);
    if (ms < 0) continue;
    const std::string dir = Join(base, name);
    if (Exists(Join(dir, kManifestName)) == committed) found.emplace_back(ms, dir);
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

int64_t HeaderBytes(bool delta) { return delta ? kDeltaHeaderBytes : kHeaderBytes; }

// Writes the header of `d` (HeaderBytes(d.delta) bytes) to `out`.
void WriteHeader(const ShardData& d, char* out) {
  std::memcpy(out, d.delta ? kDeltaMagic : kShardMagic, 8);
  const int64_t fields[6] = {d.rows, d.cols, d.state_width, d.step,
                             static_cast<int64_t>(d.applied_ids.size()),
                             static_cast<int64_t>(d.changed_rows.size())};
  std::memcpy(out + 8, fields, d.delta ? 6 * 8 : 5 * 8);
}

// The sections of a file after its header, in order (Data: ShardData or
// const ShardData); a full file's changed_rows is empty.
template <typename Data>
auto Sections(Data& d) {
  using Ptr = std::conditional_t<std::is_const_v<Data>, const void*, void*>;
  return std::array<std::pair<Ptr, size_t>, 8>{{
      {d.changed_rows.data(), d.changed_rows.size() * sizeof(int64_t)},
      {d.weights.data(), d.weights.size() * sizeof(float)},
      {d.state.data(), d.state.size() * sizeof(float)},
      {d.applied_ids.data(), d.applied_ids.size() * sizeof(uint64_t)},
      {d.applied_unix_ms.data(), d.applied_unix_ms.size() * sizeof(int64_t)},
      {d.slot_meta.data(), d.slot_meta.size() * sizeof(int64_t)},
      {d.pending_counts.data(), d.pending_counts.size() * sizeof(int64_t)},
      {d.pending_sketch.data(), d.pending_sketch.size() * sizeof(uint32_t)}}};
}

// Whether a manifest holds a delta shard (an incremental checkpoint).
bool HasDeltas(const ember::v1::CheckpointManifest& m) {
  return std::any_of(m.shards().begin(), m.shards().end(),
                     [](const ember::v1::CheckpointShard& s) { return s.delta(); });
}

// The names of the shard files ("*.shard") in `dir`.
std::vector<std::string> ShardFilesIn(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return names;
  while (dirent* e = readdir(d)) {
    if (absl::EndsWith(e->d_name, ".shard")) names.emplace_back(e->d_name);
  }
  closedir(d);
  return names;
}

// Rows strictly ascending, each in [0, rows).
bool RowsInOrder(const std::vector<int64_t>& changed, int64_t rows) {
  for (size_t i = 0; i < changed.size(); ++i) {
    if (changed[i] < 0 || changed[i] >= rows || (i > 0 && changed[i] <= changed[i - 1])) {
      return false;
    }
  }
  return true;
}

// A shard file's name must be a plain name inside its directory.
bool SafeName(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos && name != "." && name != "..";
}

// Opens entry's file and checks its size; the caller owns the descriptor.
absl::StatusOr<int> OpenChecked(const std::string& path, const ember::v1::CheckpointShard& entry) {
  if (!SafeName(entry.file())) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard file name '", entry.file(), "' is not a plain file name"));
  }
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::DataLossError(absl::StrCat("checkpoint file ", path, " is missing"));
    return Errno("opening", path);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    return Errno("stat of", path);
  }
  if (st.st_size != entry.bytes()) {
    close(fd);
    return DataLoss(path, absl::StrCat("it has ", st.st_size, " bytes, the manifest says ",
                                       entry.bytes()));
  }
  if (entry.rows() < 0 || entry.cols() <= 0 || entry.state_width() < 0 ||
      entry.applied_ids() < 0 || entry.rows() > (int64_t{1} << 40) ||
      entry.cols() > (int64_t{1} << 20) || entry.state_width() > (int64_t{1} << 21) ||
      entry.applied_ids() > (int64_t{1} << 40) ||
      entry.pending_counts() < 0 || entry.pending_counts() > (int64_t{1} << 40) ||
      (!entry.dynamic() && (entry.pending_counts() != 0 || entry.pending_sketch())) ||
      (entry.delta() && (entry.changed_rows() < 0 || entry.changed_rows() > entry.rows())) ||
      (!entry.delta() && entry.changed_rows() != 0) ||
      EntryFileBytes(entry) != entry.bytes()) {
    close(fd);
    return DataLoss(path, "the manifest's shape does not match the file's size");
  }
  return fd;
}

absl::Status CheckHeader(const char* header, const std::string& path,
                         const ember::v1::CheckpointShard& entry) {
  if (std::memcmp(header, entry.delta() ? kDeltaMagic : kShardMagic, 8) != 0) {
    return DataLoss(path, "bad magic");
  }
  int64_t f[6] = {0, 0, 0, 0, 0, 0};
  std::memcpy(f, header + 8, entry.delta() ? 6 * 8 : 5 * 8);
  if (f[0] != entry.rows() || f[1] != entry.cols() || f[2] != entry.state_width() ||
      f[3] != entry.step() || f[4] != entry.applied_ids() || f[5] != entry.changed_rows()) {
    return DataLoss(path, "its header does not match the manifest");
  }
  return absl::OkStatus();
}

}  // namespace

std::string ShardFileName(const ember::v1::ShardRef& ref, bool delta) {
  std::string safe;
  for (char c : ref.table()) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-';
    safe.push_back(ok ? c : '_');
  }
  if (safe.size() > 64) safe.resize(64);
  const uint32_t h = Crc(0, ref.table().data(), ref.table().size());
  return absl::StrCat(absl::Hex(h, absl::kZeroPad8), "-", safe, ".", ref.shard_index(),
                      delta ? ".delta.shard" : ".shard");
}

absl::StatusOr<ember::v1::CheckpointShard> WriteShardFile(const std::string& dir,
                                                          const ember::v1::ShardRef& ref,
                                                          const ShardData& data) {
  const int64_t held = data.delta ? static_cast<int64_t>(data.changed_rows.size()) : data.rows;
  if (static_cast<int64_t>(data.weights.size()) != held * data.cols ||
      static_cast<int64_t>(data.state.size()) != held * data.state_width ||
      (!data.delta && !data.changed_rows.empty()) ||
      (data.delta && !RowsInOrder(data.changed_rows, data.rows)) ||
      data.applied_ids.size() != data.applied_unix_ms.size() ||
      (!data.slot_meta.empty() &&
       static_cast<int64_t>(data.slot_meta.size()) !=
           data.rows * backend::EmbeddingBackend::kSlotMetaFields) ||
      data.pending_counts.size() % 2 != 0 ||
      (data.slot_meta.empty() && !data.pending_counts.empty()) ||
      (data.slot_meta.empty() && !data.pending_sketch.empty()) ||
      (!data.pending_sketch.empty() &&
       data.pending_sketch.size() != backend::kPendingSketchCounters)) {
    return absl::InternalError("shard data does not match its shape");
  }
  const bool dynamic = !data.slot_meta.empty();
  const std::string name = ShardFileName(ref, data.delta);
  const std::string path = Join(dir, name);
  File f(open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (f.fd() < 0) return Errno("creating", path);
  char header[kDeltaHeaderBytes];
  WriteHeader(data, header);
  const size_t header_bytes = static_cast<size_t>(HeaderBytes(data.delta));
  uint32_t crc = Crc(0, header, header_bytes);
  if (absl::Status s = WriteAll(f.fd(), header, header_bytes, path); !s.ok()) return s;
  for (const auto& [data_ptr, n] : Sections(data)) {
    const char* p = static_cast<const char*>(data_ptr);
    for (size_t at = 0; at < n; at += kChunk) {
      const size_t len = std::min(kChunk, n - at);
      crc = Crc(crc, p + at, len);
      if (absl::Status s = WriteAll(f.fd(), p + at, len, path); !s.ok()) return s;
    }
  }
  if (fsync(f.fd()) != 0) return Errno("fsync of", path);
  ember::v1::CheckpointShard entry;
  *entry.mutable_ref() = ref;
  entry.set_file(name);
  const int64_t pending = static_cast<int64_t>(data.pending_counts.size() / 2);
  entry.set_dynamic(dynamic);
  entry.set_delta(data.delta);
  entry.set_changed_rows(static_cast<int64_t>(data.changed_rows.size()));
  entry.set_pending_counts(pending);
  entry.set_pending_sketch(!data.pending_sketch.empty());
  entry.set_applied_ids(static_cast<int64_t>(data.applied_ids.size()));
  entry.set_crc32(crc);
  entry.set_rows(data.rows);
  entry.set_cols(data.cols);
  entry.set_state_width(data.state_width);
  entry.set_step(data.step);
  entry.set_bytes(EntryFileBytes(entry));
  return entry;
}

absl::StatusOr<ShardData> ReadShardFile(const std::string& dir,
                                        const ember::v1::CheckpointShard& entry) {
  const std::string path = Join(dir, entry.file());
  auto fd = OpenChecked(path, entry);
  if (!fd.ok()) return fd.status();
  File f(*fd);
  char header[kDeltaHeaderBytes];
  const size_t header_bytes = static_cast<size_t>(HeaderBytes(entry.delta()));
  auto got = ReadUpTo(f.fd(), header, header_bytes, path);
  if (!got.ok()) return got.status();
  if (*got != header_bytes) return DataLoss(path, "truncated header");
  if (absl::Status s = CheckHeader(header, path, entry); !s.ok()) return s;
  ShardData d;
  d.rows = entry.rows();
  d.cols = entry.cols();
  d.state_width = entry.state_width();
  d.step = entry.step();
  d.delta = entry.delta();
  d.changed_rows.resize(entry.delta() ? entry.changed_rows() : 0);
  const int64_t held = entry.delta() ? entry.changed_rows() : d.rows;
  d.weights.resize(held * d.cols);
  d.state.resize(held * d.state_width);
  d.applied_ids.resize(entry.applied_ids());
  d.applied_unix_ms.resize(entry.applied_ids());
  if (entry.dynamic()) {
    d.slot_meta.resize(d.rows * backend::EmbeddingBackend::kSlotMetaFields);
    d.pending_counts.resize(2 * entry.pending_counts());
    if (entry.pending_sketch()) d.pending_sketch.resize(backend::kPendingSketchCounters);
  }
  uint32_t crc = Crc(0, header, header_bytes);
  for (const auto& [p, n] : Sections(d)) {
    auto r = ReadUpTo(f.fd(), p, n, path);
    if (!r.ok()) return r.status();
    if (*r != n) return DataLoss(path, "truncated");
    crc = Crc(crc, p, n);
  }
  if (crc != entry.crc32()) return DataLoss(path, "CRC-32 mismatch");
  if (!RowsInOrder(d.changed_rows, d.rows)) {
    return DataLoss(path, "its changed rows are not ascending rows of the shard");
  }
  return d;
}

absl::Status ApplyDelta(const ShardData& delta, const std::string& what, ShardData* base) {
  const int64_t n = static_cast<int64_t>(delta.changed_rows.size());
  if (!delta.delta || base->delta || delta.rows != base->rows || delta.cols != base->cols ||
      delta.state_width != base->state_width ||
      static_cast<int64_t>(delta.weights.size()) != n * delta.cols ||
      static_cast<int64_t>(delta.state.size()) != n * delta.state_width ||
      !RowsInOrder(delta.changed_rows, base->rows) ||
      static_cast<int64_t>(base->weights.size()) != base->rows * base->cols ||
      static_cast<int64_t>(base->state.size()) != base->rows * base->state_width ||
      delta.slot_meta.empty() != base->slot_meta.empty()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint file ", what, " does not fit the shard it builds on"));
  }
  const int64_t cols = delta.cols, sw = delta.state_width;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t r = delta.changed_rows[k];
    std::copy_n(delta.weights.begin() + k * cols, cols, base->weights.begin() + r * cols);
    std::copy_n(delta.state.begin() + k * sw, sw, base->state.begin() + r * sw);
  }
  base->step = delta.step;
  base->applied_ids = delta.applied_ids;
  base->applied_unix_ms = delta.applied_unix_ms;
  base->slot_meta = delta.slot_meta;
  base->pending_counts = delta.pending_counts;
  base->pending_sketch = delta.pending_sketch;
  return absl::OkStatus();
}

absl::Status VerifyShardFile(const std::string& dir, const ember::v1::CheckpointShard& entry) {
  const std::string path = Join(dir, entry.file());
  auto fd = OpenChecked(path, entry);
  if (!fd.ok()) return fd.status();
  File f(*fd);
  std::unique_ptr<char[]> buf(new char[kChunk]);
  uint32_t crc = 0;
  int64_t total = 0;
  bool first = true;
  for (;;) {
    auto r = ReadUpTo(f.fd(), buf.get(), kChunk, path);
    if (!r.ok()) return r.status();
    if (first) {
      if (*r < static_cast<size_t>(HeaderBytes(entry.delta()))) {
        return DataLoss(path, "truncated header");
      }
      if (absl::Status s = CheckHeader(buf.get(), path, entry); !s.ok()) return s;
      first = false;
    }
    crc = Crc(crc, buf.get(), *r);
    total += static_cast<int64_t>(*r);
    if (*r < kChunk) break;
  }
  if (total != entry.bytes()) return DataLoss(path, "truncated");
  if (crc != entry.crc32()) return DataLoss(path, "CRC-32 mismatch");
  return absl::OkStatus();
}

absl::Status CommitManifest(const std::string& dir, const ember::v1::CheckpointManifest& given) {
  ember::v1::CheckpointManifest manifest = given;
  const int version = HasDeltas(manifest) ? kIncrementalFormatVersion : kFormatVersion;
  manifest.set_format_version(version);
  std::string body;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = true;
  o.preserve_proto_field_names = true;
  if (auto s = google::protobuf::util::MessageToJsonString(manifest, &body, o); !s.ok()) {
    return absl::InternalError(absl::StrCat("manifest to JSON: ", s.ToString()));
  }
  const std::string text =
      absl::StrCat("ember-checkpoint ", version, " crc32=",
                   absl::Hex(Crc(0, body.data(), body.size()), absl::kZeroPad8),
                   " bytes=", body.size(), "\n", body);
  const std::string tmp = Join(dir, absl::StrCat(kManifestName, ".tmp"));
  const std::string path = Join(dir, kManifestName);
  {
    File f(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (f.fd() < 0) return Errno("creating", tmp);
    if (absl::Status s = WriteAll(f.fd(), text.data(), text.size(), tmp); !s.ok()) return s;
    if (fsync(f.fd()) != 0) return Errno("fsync of", tmp);
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) return Errno("renaming", tmp);
  return FsyncDir(dir);
}

absl::StatusOr<ember::v1::CheckpointManifest> ReadManifest(const std::string& dir) {
  const std::string path = Join(dir, kManifestName);
  File f(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd() < 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat("no committed checkpoint in ", dir, " (no ",
                                              kManifestName, ")"));
    }
    return Errno("opening", path);
  }
  std::string text;
  char buf[1 << 16];
  for (;;) {
    auto r = ReadUpTo(f.fd(), buf, sizeof(buf), path);
    if (!r.ok()) return r.status();
    text.append(buf, *r);
    if (*r < sizeof(buf)) break;
    if (text.size() > (size_t{256} << 20)) return DataLoss(path, "larger than 256 MiB");
  }
  auto m = ParseManifest(text, path);
  if (!m.ok()) return m.status();
  m->mutable_info()->set_path(dir);
  return m;
}

absl::StatusOr<ember::v1::CheckpointManifest> ParseManifest(const std::string& text,
                                                            const std::string& path) {
  const size_t nl = text.find('\n');
  if (nl == std::string::npos) return DataLoss(path, "no header line");
  const std::string head_line = text.substr(0, nl);
  std::vector<absl::string_view> head = absl::StrSplit(head_line, ' ');
  int version = 0;
  uint32_t crc = 0;
  uint64_t bytes = 0;
  if (head.size() != 4 || head[0] != "ember-checkpoint" || !absl::SimpleAtoi(head[1], &version) ||
      !absl::ConsumePrefix(&head[2], "crc32=") || !absl::SimpleHexAtoi(head[2], &crc) ||
      !absl::ConsumePrefix(&head[3], "bytes=") || !absl::SimpleAtoi(head[3], &bytes)) {
    return DataLoss(path, "malformed header line");
  }
  if (version != kFormatVersion && version != kIncrementalFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(path, " has format version ", version,
                                                      "; this build reads ", kFormatVersion,
                                                      " and ", kIncrementalFormatVersion));
  }
  const std::string body = text.substr(nl + 1);
  if (body.size() != bytes) {
    return DataLoss(path, absl::StrCat("body has ", body.size(), " bytes, header says ", bytes));
  }
  if (Crc(0, body.data(), body.size()) != crc) return DataLoss(path, "CRC-32 mismatch");
  ember::v1::CheckpointManifest m;
  if (auto s = google::protobuf::util::JsonStringToMessage(body, &m); !s.ok()) {
    return DataLoss(path, absl::StrCat("not a manifest: ", s.ToString()));
  }
  if (m.format_version() != version ||
      (version == kIncrementalFormatVersion) != HasDeltas(m) || m.spec().name().empty() ||
      m.plan().tables_size() != m.spec().tables_size()) {
    return DataLoss(path, "inconsistent manifest");
  }
  std::set<std::string> files;
  for (const auto& s : m.shards()) {
    if (!SafeName(s.file()) || !files.insert(s.file()).second) {
      return DataLoss(path, absl::StrCat("bad shard file name '", s.file(), "'"));
    }
  }
  return m;
}

absl::Status CheckCoverage(const ember::v1::CheckpointManifest& m) {
  std::map<std::string, std::vector<const ember::v1::CheckpointShard*>> by_table;
  for (const auto& s : m.shards()) by_table[s.ref().table()].push_back(&s);
  for (const auto& table : m.spec().tables()) {
    const int64_t rows = table.num_embeddings(), cols = table.embedding_dim();
    const auto& shards = by_table[table.name()];
    int64_t area = 0;
    for (size_t i = 0; i < shards.size(); ++i) {
      const auto& a = *shards[i];
      if (a.row_offset() < 0 || a.col_offset() < 0 || a.rows() < 0 || a.cols() < 0 ||
          a.row_offset() > rows - a.rows() || a.col_offset() > cols - a.cols()) {
        return absl::DataLossError(absl::StrCat(
            "checkpoint shard ", a.file(), " of table '", table.name(), "' lies outside its ",
            rows, " x ", cols));
      }
      for (size_t j = 0; j < i; ++j) {
        const auto& b = *shards[j];
        if (!CellBlock::Of(a).Intersection(CellBlock::Of(b)).empty()) {
          return absl::DataLossError(absl::StrCat("checkpoint shards ", b.file(), " and ",
                                                  a.file(), " of table '", table.name(),
                                                  "' overlap"));
        }
      }
      area += a.rows() * a.cols();  // in range: both within the table
    }
    if (area != rows * cols) {
      return absl::DataLossError(absl::StrCat("the checkpoint's shards of table '", table.name(),
                                              "' cover ", area, " of its ", rows * cols,
                                              " cells"));
    }
  }
  return absl::OkStatus();
}

namespace {

std::string Parent(const std::string& dir) {
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  const size_t slash = d.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : d.substr(0, slash);
}

// The base directory of the checkpoint whose manifest is `m` (in `dir`),
// confined under `root` when given.
absl::StatusOr<std::string> BaseDir(const std::string& dir,
                                    const ember::v1::CheckpointManifest& m,
                                    const std::string& root) {
  const std::string& base = m.info().base();
  const std::string manifest = Join(dir, kManifestName);
  if (base.empty()) return DataLoss(manifest, "it has delta shards but names no base checkpoint");
  if (!SafeName(base) || CreatedMs(base) < 0) {
    return DataLoss(manifest, absl::StrCat("its base '", absl::CHexEscape(base.substr(0, 128)),
                                           "' is not a checkpoint directory's name"));
  }
  const std::string path = Join(Parent(dir), base);
  if (root.empty()) return path;
  auto confined = ConfinedPath(root, path);
  if (!confined.ok()) return DataLoss(manifest, std::string(confined.status().message()));
  return *confined;
}

absl::StatusOr<const ember::v1::CheckpointManifest*> CachedManifest(
    const std::string& dir, std::map<std::string, ember::v1::CheckpointManifest>* cache) {
  auto it = cache->find(dir);
  if (it != cache->end()) return &it->second;
  auto m = ReadManifest(dir);
  if (!m.ok()) return m.status();
  return &cache->emplace(dir, *std::move(m)).first->second;
}

// ShardChain, with the manifests read so far.
absl::StatusOr<std::vector<ChainLink>> ShardChainIn(
    const std::string& dir, const ember::v1::CheckpointShard& entry, const std::string& root,
    std::map<std::string, ember::v1::CheckpointManifest>* manifests) {
  std::vector<ChainLink> links = {{dir, entry}};
  while (links.back().entry.delta()) {
    const ChainLink& top = links.back();
    const std::string what = Join(top.dir, top.entry.file());
    if (links.size() > kMaxChain) {
      return DataLoss(what, absl::StrCat("its chain of bases is longer than ", kMaxChain));
    }
    auto m = CachedManifest(top.dir, manifests);
    if (!m.ok()) return m.status();
    auto base_dir = BaseDir(top.dir, **m, root);
    if (!base_dir.ok()) return base_dir.status();
    auto bm = CachedManifest(*base_dir, manifests);
    if (absl::IsNotFound(bm.status())) {
      return DataLoss(what, absl::StrCat("its base checkpoint ", *base_dir, " is missing"));
    }
    if (!bm.ok()) return bm.status();
    const ember::v1::CheckpointShard* found = nullptr;
    for (const auto& s : (*bm)->shards()) {
      if (s.ref().table() == top.entry.ref().table() &&
          s.ref().shard_index() == top.entry.ref().shard_index()) {
        found = &s;
      }
    }
    const auto& e = top.entry;
    if (found == nullptr || found->rows() != e.rows() || found->cols() != e.cols() ||
        found->state_width() != e.state_width() || found->row_offset() != e.row_offset() ||
        found->col_offset() != e.col_offset() || found->dynamic() != e.dynamic() ||
        found->lineage() == 0 || found->lineage() != e.lineage() ||
        found->generation() != e.base_generation()) {
      return DataLoss(what, absl::StrCat("its base checkpoint ", *base_dir,
                                         " holds no matching shard (same rows, columns and "
                                         "lineage, generation ", e.base_generation(), ")"));
    }
    links.push_back({*base_dir, *found});
  }
  std::reverse(links.begin(), links.end());
  return links;
}

}  // namespace

absl::StatusOr<std::vector<ChainLink>> ShardChain(const std::string& dir,
                                                  const ember::v1::CheckpointShard& entry,
                                                  const std::string& root) {
  std::map<std::string, ember::v1::CheckpointManifest> manifests;
  return ShardChainIn(dir, entry, root, &manifests);
}

absl::StatusOr<ShardData> ReadShardChain(const std::string& dir,
                                         const ember::v1::CheckpointShard& entry,
                                         const std::string& root, int64_t* bytes_read) {
  auto chain = ShardChain(dir, entry, root);
  if (!chain.ok()) return chain.status();
  absl::StatusOr<ShardData> data;
  for (const ChainLink& link : *chain) {
    auto d = ReadShardFile(link.dir, link.entry);
    if (!d.ok()) return d.status();
    if (bytes_read != nullptr) *bytes_read += link.entry.bytes();
    if (!data.ok()) {
      data = *std::move(d);
      continue;
    }
    if (absl::Status s = ApplyDelta(*d, Join(link.dir, link.entry.file()), &*data); !s.ok()) {
      return s;
    }
  }
  return data;
}

absl::StatusOr<std::vector<std::string>> CheckpointChain(const std::string& dir,
                                                         const std::string& root) {
  std::vector<std::string> chain = {dir};
  for (;;) {
    auto m = ReadManifest(chain.back());
    if (!m.ok()) {
      if (chain.size() > 1 && absl::IsNotFound(m.status())) {
        return absl::DataLossError(absl::StrCat("the base checkpoint ", chain.back(), " of ",
                                                chain[chain.size() - 2], " is missing"));
      }
      return m.status();
    }
    if (m->info().base().empty()) return chain;
    if (chain.size() > kMaxChain) {
      return absl::DataLossError(
          absl::StrCat(dir, ": its chain of bases is longer than ", kMaxChain));
    }
    auto base = BaseDir(chain.back(), *m, root);
    if (!base.ok()) return base.status();
    chain.push_back(*base);
  }
}

absl::StatusOr<int64_t> CompactCheckpoint(const std::string& dir, const std::string& root) {
  auto m = ReadManifest(dir);
  if (!m.ok()) return m.status();
  if (!HasDeltas(*m)) return 0;
  int64_t written = 0, bytes = 0;
  for (auto& entry : *m->mutable_shards()) {
    if (!entry.delta()) {
      bytes += entry.bytes();
      continue;
    }
    auto data = ReadShardChain(dir, entry, root);
    if (!data.ok()) return data.status();
    auto full = WriteShardFile(dir, entry.ref(), *data);
    if (!full.ok()) return full.status();
    full->set_row_offset(entry.row_offset());
    full->set_col_offset(entry.col_offset());
    full->set_lineage(entry.lineage());
    full->set_generation(entry.generation());
    entry = *std::move(full);
    written += entry.bytes();
    bytes += entry.bytes();
  }
  ember::v1::CheckpointInfo* info = m->mutable_info();
  info->clear_path();
  info->clear_base();
  info->set_delta_shards(0);
  info->set_changed_rows(0);
  info->set_chain_length(1);
  info->set_bytes(bytes);
  if (absl::Status s = FsyncDir(dir); !s.ok()) return s;
  if (absl::Status s = CommitManifest(dir, *m); !s.ok()) return s;
  return written;
}

int RemoveUnlistedShardFiles(const std::string& dir, absl::Duration grace) {
  struct stat st;
  if (stat(Join(dir, kManifestName).c_str(), &st) != 0 ||
      absl::FromTimeT(st.st_mtime) + grace > absl::Now()) {
    return 0;
  }
  auto m = ReadManifest(dir);
  if (!m.ok()) return 0;
  std::set<std::string> listed;
  for (const auto& s : m->shards()) listed.insert(s.file());
  int removed = 0;
  for (const std::string& name : ShardFilesIn(dir)) {
    if (!listed.count(name)) removed += unlink(Join(dir, name).c_str()) == 0;
  }
  return removed;
}

absl::StatusOr<ember::v1::CheckpointManifest> VerifyCheckpoint(
    const std::string& dir, const std::function<void(int64_t done, int64_t total)>& progress,
    const std::string& root) {
  auto m = ReadManifest(dir);
  if (!m.ok()) return m.status();
  // Every file of every shard's chain, once (a base's files serve many).
  std::map<std::string, ember::v1::CheckpointManifest> manifests;
  std::vector<ChainLink> files;
  std::set<std::string> seen;
  for (const auto& s : m->shards()) {
    auto chain = ShardChainIn(dir, s, root, &manifests);
    if (!chain.ok()) return chain.status();
    for (ChainLink& link : *chain) {
      if (seen.insert(Join(link.dir, link.entry.file())).second) files.push_back(std::move(link));
    }
  }
  int64_t total = 0, done = 0;
  for (const auto& f : files) total += std::max<int64_t>(f.entry.bytes(), 0);
  if (progress) progress(0, total);
  for (const auto& f : files) {
    if (absl::Status st = VerifyShardFile(f.dir, f.entry); !st.ok()) return st;
    done += std::max<int64_t>(f.entry.bytes(), 0);
    if (progress) progress(done, total);
  }
  return m;
}

namespace {

bool HasControlByte(absl::string_view s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return true;
  }
  return false;
}

// `path` with "." components and repeated '/' removed (no "..": refused
// before).
std::string Normalize(const std::string& path) {
  std::vector<absl::string_view> parts;
  for (absl::string_view p : absl::StrSplit(path, '/', absl::SkipEmpty())) {
    if (p != ".") parts.push_back(p);
  }
  return absl::StrCat(path.empty() || path[0] != '/' ? "" : "/", absl::StrJoin(parts, "/"));
}

bool Under(const std::string& path, const std::string& root) {
  if (root == "/") return true;
  return path == root || (absl::StartsWith(path, root) && path[root.size()] == '/');
}

// The real path of `path`'s longest existing prefix, with the rest of
// `path` appended; "" when even "/" cannot be resolved.
std::string RealPathOfExisting(const std::string& path) {
  std::string prefix = path, rest;
  while (true) {
    char buf[PATH_MAX];
    if (realpath(prefix.c_str(), buf) != nullptr) return Normalize(Join(buf, rest));
    const size_t slash = prefix.rfind('/');
    if (slash == std::string::npos || prefix == "/") return "";
    rest = rest.empty() ? prefix.substr(slash + 1) : Join(prefix.substr(slash + 1), rest);
    prefix = slash == 0 ? "/" : prefix.substr(0, slash);
  }
}

}  // namespace

absl::StatusOr<std::string> ConfinedPath(const std::string& root, const std::string& requested) {
  if (root.empty()) {
    if (requested.empty()) return absl::FailedPreconditionError("no checkpoint root configured");
    return absl::FailedPreconditionError(
        "this server has no checkpoint root (--checkpoint_dir): it accepts no checkpoint path");
  }
  const std::string shown = absl::CHexEscape(requested.substr(0, 256));
  if (HasControlByte(requested)) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint path \"", shown, "\" has a NUL or control byte"));
  }
  for (absl::string_view p : absl::StrSplit(requested, '/')) {
    if (p == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint path \"", shown, "\" has a '..' component"));
    }
  }
  const std::string base = Normalize(root);
  const std::string path =
      requested.empty() ? base
                        : Normalize(requested[0] == '/' ? requested : Join(base, requested));
  const std::string outside = absl::StrCat("checkpoint path \"", shown,
                                           "\" is outside this server's checkpoint root ", base);
  // Decided on real paths (with no ".." left, the lexical path differs only
  // by links): a link inside root must not lead out of it, and a root given
  // relative or through a link still takes its absolute spelling.
  const std::string real_base = RealPathOfExisting(base);
  const std::string real_path = RealPathOfExisting(path);
  if (real_base.empty() || real_path.empty() || !Under(real_path, real_base)) {
    return absl::InvalidArgumentError(outside);
  }
  return path;
}

absl::StatusOr<std::string> MakeCheckpointDir(const std::string& root,
                                              const std::string& collection, int64_t epoch,
                                              int64_t created_unix_ms) {
  if (root.empty()) return absl::InvalidArgumentError("the checkpoint root is empty");
  if (root.find('\0') != std::string::npos || collection.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("a checkpoint path with a NUL byte");
  }
  std::string path;
  for (const std::string& part : {root, collection}) {
    path = path.empty() ? part : Join(path, part);
    // mkdir -p of every component of path.
    for (size_t at = 1; at <= path.size(); ++at) {
      if (at != path.size() && path[at] != '/') continue;
      const std::string prefix = path.substr(0, at);
      if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) return Errno("creating", prefix);
    }
  }
  constexpr int kMaxNames = 1000;
  for (int n = 0; n < kMaxNames; ++n) {
    const std::string dir = Join(path, absl::StrCat("ckpt-", created_unix_ms + n, "-e", epoch));
    if (mkdir(dir.c_str(), 0755) == 0) {
      if (absl::Status s = FsyncDir(path); !s.ok()) return s;
      return dir;
    }
    if (errno != EEXIST) return Errno("creating", dir);
  }
  return absl::AlreadyExistsError(absl::StrCat("no free checkpoint name in ", path, " after ",
                                               kMaxNames, " tries"));
}

absl::StatusOr<std::string> ResolveCheckpoint(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("no checkpoint path given");
  if (Exists(Join(path, kManifestName))) return path;
  if (!IsDir(path)) return absl::NotFoundError(absl::StrCat("no directory ", path));
  // path = ROOT/<collection>, or ROOT.
  std::vector<std::pair<int64_t, std::string>> found;
  std::set<std::string> collections;
  auto scan = [&](const std::string& base, const std::string& collection) {
    for (const std::string& name : Subdirs(base)) {
      const int64_t ms = CreatedMs(name);
      const std::string dir = Join(base, name);
      if (ms >= 0 && Exists(Join(dir, kManifestName))) {
        found.emplace_back(ms, dir);
        collections.insert(collection);
      }
    }
  };
  scan(path, path);
  for (const std::string& sub : Subdirs(path)) {
    if (CreatedMs(sub) < 0) scan(Join(path, sub), sub);
  }
  if (found.empty()) {
    return absl::NotFoundError(absl::StrCat("no committed checkpoint in or under ", path, " (no ",
                                            kManifestName, " there or in its subdirectories)"));
  }
  if (collections.size() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " holds checkpoints of several collections (",
                     absl::StrJoin(collections, ", "), "); name ", path, "/<collection>"));
  }
  return std::max_element(found.begin(), found.end())->second;
}

std::vector<std::string> ListCommitted(const std::string& root, const std::string& collection) {
  return CheckpointDirs(root, collection, true);
}

std::vector<std::string> ListUncommitted(const std::string& root, const std::string& collection) {
  return CheckpointDirs(root, collection, false);
}

int64_t ShardFileBytes(int64_t rows, int64_t cols, int64_t state_width, int64_t applied,
                       bool dynamic, int64_t pending, bool sketch) {
  return kHeaderBytes + 4 * rows * (cols + state_width) + 16 * applied +
         (dynamic ? 8 * backend::EmbeddingBackend::kSlotMetaFields * rows + 16 * pending +
                        (sketch ? 4 * static_cast<int64_t>(backend::kPendingSketchCounters) : 0)
                  : 0);
}

int64_t EntryFileBytes(const ember::v1::CheckpointShard& e) {
  if (!e.delta()) {
    return ShardFileBytes(e.rows(), e.cols(), e.state_width(), e.applied_ids(), e.dynamic(),
                          e.pending_counts(), e.pending_sketch());
  }
  // The full file of the same shard less its rows, plus the changed rows
  // and their indices.
  return ShardFileBytes(e.rows(), e.cols(), e.state_width(), e.applied_ids(), e.dynamic(),
                        e.pending_counts(), e.pending_sketch()) -
         kHeaderBytes + kDeltaHeaderBytes - 4 * e.rows() * (e.cols() + e.state_width()) +
         e.changed_rows() * (8 + 4 * (e.cols() + e.state_width()));
}

int64_t ShardBytesInDirectory(const std::string& dir) {
  int64_t total = 0;
  for (const std::string& name : ShardFilesIn(dir)) {
    struct stat st;
    if (stat(Join(dir, name).c_str(), &st) == 0 && S_ISREG(st.st_mode)) total += st.st_size;
  }
  return total;
}

absl::Status RemoveCheckpoint(const std::string& dir) {
  const std::string manifest = Join(dir, kManifestName);
  if (unlink(manifest.c_str()) == 0) {
    if (absl::Status s = FsyncDir(dir); !s.ok()) return s;
  } else if (errno != ENOENT) {
    return Errno("removing", manifest);
  }
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return Errno("opening directory", dir);
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(d);
  for (const std::string& name : names) {
    const std::string p = Join(dir, name);
    if (unlink(p.c_str()) != 0 && errno != ENOENT) return Errno("removing", p);
  }
  if (rmdir(dir.c_str()) != 0 && errno != ENOENT) return Errno("removing", dir);
  return absl::OkStatus();
}

}  // namespace checkpoint
}  // namespace ember
