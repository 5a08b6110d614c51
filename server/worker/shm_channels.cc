#include "server/worker/shm_channels.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace ember {
namespace worker {

ShmChannels::Region::~Region() { munmap(base_, size_); }

absl::StatusOr<absl::Span<char>> ShmChannels::Region::Bytes(const ember::v1::ShmSlice& slice,
                                                            size_t align,
                                                            const std::string& what) const {
  if (slice.offset() > size_ || slice.size() > size_ - slice.offset()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": bytes [", slice.offset(), ", +",
                                                   slice.size(), ") lie outside the channel's ",
                                                   size_, " bytes"));
  }
  if (align > 1 && (slice.offset() % align != 0 || slice.size() % align != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", slice.offset(), " and size ",
                                                   slice.size(), " must be multiples of ", align));
  }
  return absl::Span<char>(base_ + slice.offset(), slice.size());
}

ShmChannels::ShmChannels(absl::Duration idle_timeout, uint64_t max_region_bytes, int max_channels,
                         std::string shm_dir)
    : idle_timeout_(idle_timeout),
      max_region_bytes_(max_region_bytes),
      max_channels_(max_channels),
      shm_dir_(std::move(shm_dir)),
      rng_(std::random_device()()) {}

absl::StatusOr<uint64_t> ShmChannels::Open(const ember::v1::OpenChannelRequest& req,
                                           const std::string& owner) {
  const bool file = !req.shm_file().empty();
  if (file == !req.shm_name().empty()) {
    return absl::InvalidArgumentError("name the region by exactly one of shm_name and shm_file");
  }
  // A file is "ember-..." inside shm_dir; a POSIX name "/ember-...". Either
  // way no other '/' (nothing outside the place meant).
  const std::string& name = file ? req.shm_file() : req.shm_name();
  const std::string prefix = file ? "ember-" : "/ember-";
  if (!absl::StartsWith(name, prefix) || name.size() > 200 ||
      name.find('/', prefix.size()) != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(file ? "shared-memory file '" : "shared-memory name '", name.substr(0, 64),
                     "' must be \"", prefix, "...\" (no other '/')"));
  }
  if (file && shm_dir_.empty()) {
    return absl::FailedPreconditionError(
        "this worker shares no directory for channels (--shm_dir); use a shared-memory name");
  }
  const uint64_t size = req.size();
  if (size < 4096 || size > max_region_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("channel size ", size, " is outside [4096, ",
                                                   max_region_bytes_, "]"));
  }
  {
    absl::MutexLock lock(&mu_);
    ExpireLocked(absl::Now());
    if (static_cast<int>(channels_.size()) >= max_channels_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          max_channels_, " shared-memory channels are open on this worker; close some"));
    }
  }
  const std::string shown = file ? absl::StrCat(shm_dir_, "/", name) : name;
  const int fd = file ? open(shown.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC)
                      : shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("cannot open shared memory '", shown, "': ",
                                            std::strerror(errno),
                                            " (is the client on this worker's host?)"));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) < size) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shared memory '", shown,
                                                   "' is not a region of at least ", size,
                                                   " bytes"));
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot map shared memory '", shown, "': ",
                                                     std::strerror(errno)));
  }
  uint64_t nonce;
  std::memcpy(&nonce, base, sizeof(nonce));
  if (nonce != req.nonce()) {
    munmap(base, size);
    return absl::FailedPreconditionError(absl::StrCat(
        "shared memory '", shown,
        "' does not hold the client's nonce: another host's region of that name"));
  }
  auto region = std::make_shared<const Region>(static_cast<char*>(base), size);
  absl::MutexLock lock(&mu_);
  uint64_t id = 0;
  while (id == 0 || channels_.count(id)) id = rng_();
  channels_[id] = Channel{std::move(region), owner, absl::Now()};
  return id;
}

absl::Status ShmChannels::Close(uint64_t id, const std::string& owner) {
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(id);
  if (it == channels_.end()) return absl::NotFoundError(absl::StrCat("no channel ", id));
  if (it->second.owner != owner) {
    return absl::PermissionDeniedError(absl::StrCat("channel ", id, " belongs to another client"));
  }
  channels_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const ShmChannels::Region>> ShmChannels::Use(
    uint64_t id, const std::string& owner, uint64_t seq) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  ExpireLocked(now);
  auto it = channels_.find(id);
  if (it == channels_.end()) {
    return absl::UnavailableError(absl::StrCat(
        "no shared-memory channel ", id, " on this worker (closed, idle past ",
        absl::FormatDuration(idle_timeout_),
        ", or the worker restarted); open a new one"));
  }
  if (it->second.owner != owner) {
    return absl::PermissionDeniedError(absl::StrCat("channel ", id, " belongs to another client"));
  }
  if (seq <= it->second.last_seq) {
    return absl::InvalidArgumentError(absl::StrCat(
        "channel ", id, " transfer ", seq, " is out of order: transfer ", it->second.last_seq,
        " came before it (a stale or replayed control message; channel_seq counts from 1)"));
  }
  it->second.last_seq = seq;
  it->second.last_used = now;
  return it->second.region;
}

int ShmChannels::open_channels() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(channels_.size());
}

void ShmChannels::ExpireLocked(absl::Time now) {
  for (auto it = channels_.begin(); it != channels_.end();) {
    it = now - it->second.last_used > idle_timeout_ ? channels_.erase(it) : std::next(it);
  }
}

}  // namespace worker
}  // namespace ember
