#include "server/worker/shm_channels.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "server/common/byte_ranges.h"

namespace ember {
namespace worker {

ShmChannels::Region::~Region() {
  if (mapped_) {
    munmap(base_, size_);
  } else {
    std::free(base_);
  }
}

struct ShmChannels::LinkState {
  std::mutex call_mu;            // one call at a time (Transfer)
  absl::Notification joined;     // the join ended: join_status, link, memory set
  absl::Status join_status;
  std::unique_ptr<cuda::PeerLink> link;
  char* memory = nullptr;        // the link's memory, the region's size
  // A reply queued (Reply) and not yet waited for (the next Receive waits)
  // is given up on past this: the reaper aborts the link of a client that
  // never took it, whose queued send would otherwise hold the device.
  std::atomic<int64_t> reply_deadline_ns{INT64_MAX};
  bool memory_on_device = false;  // NCCL's (device) or a socket link's (host)
};

absl::Status ShmChannels::Transfer::CheckReply(
    const ember::v1::ShmSlice& reply,
    const google::protobuf::RepeatedPtrField<ember::v1::ShmSlice>& outputs) const {
  if (link_ == nullptr) {
    if (reply.size() == 0 && reply.offset() == 0) return absl::OkStatus();
    return absl::InvalidArgumentError("link_reply on a shared-memory channel");
  }
  if (absl::Status s = region_->Bytes(reply, 4, "link_reply").status(); !s.ok()) return s;
  uint64_t begin = UINT64_MAX, end = 0;
  for (const ember::v1::ShmSlice& o : outputs) {
    begin = std::min<uint64_t>(begin, o.offset());
    end = std::max<uint64_t>(end, o.offset() + o.size());
  }
  if (begin == UINT64_MAX) begin = 0;
  if (reply.offset() != begin || reply.size() != end - begin) {
    return absl::InvalidArgumentError(absl::StrCat("link_reply [", reply.offset(), ", +",
                                                   reply.size(), ") is not the outputs' bytes [",
                                                   begin, ", ", end, ")"));
  }
  return absl::OkStatus();
}

bool ShmChannels::Transfer::link_memory_on_device() const {
  return link_ != nullptr && link_->memory_on_device;
}

absl::StatusOr<absl::Span<char>> ShmChannels::Transfer::LinkBytes(
    const ember::v1::ShmSlice& slice, size_t align, const std::string& what) const {
  if (link_ == nullptr) return absl::InternalError("not a link channel");
  auto bytes = region_->Bytes(slice, align, what);  // the same bounds
  if (!bytes.ok()) return bytes.status();
  return absl::Span<char>(link_->memory + slice.offset(), bytes->size());
}

absl::Status ShmChannels::Transfer::Reply(const ember::v1::ShmSlice& reply,
                                          bool in_link_memory) {
  if (link_ == nullptr || reply.size() == 0) return absl::OkStatus();
  auto bytes = region_->Bytes(reply, 4, "link_reply");
  if (!bytes.ok()) return bytes.status();
  char* memory = link_->memory + reply.offset();
  cuda::PeerLink& link = *link_->link;
  if (!in_link_memory) {
    if (absl::Status s = link.CopyIn(memory, bytes->data(), bytes->size()); !s.ok()) return s;
  }
  // Not waited for: the client receives it once it has the call's answer;
  // the next call on the channel waits for it first (Use, Receive), and
  // the reaper aborts the link if none comes in time.
  link_->reply_deadline_ns = absl::ToUnixNanos(absl::Now() + reply_timeout_);
  return link.Send(memory, bytes->size());
}

absl::StatusOr<absl::Span<char>> ShmChannels::Region::Bytes(const ember::v1::ShmSlice& slice,
                                                            size_t align,
                                                            const std::string& what) const {
  if (slice.offset() > size_ || slice.size() > size_ - slice.offset()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": bytes [", slice.offset(), ", +",
                                                   slice.size(), ") lie outside the shared region's ",
                                                   size_, " bytes"));
  }
  if (align > 1 && (slice.offset() % align != 0 || slice.size() % align != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", slice.offset(), " and size ",
                                                   slice.size(), " must be multiples of ", align));
  }
  return absl::Span<char>(base_ + slice.offset(), slice.size());
}

namespace {

// Whether descriptor link `path` (a /proc/.../fd/N) names a memfd called
// exactly `name`: "/memfd:ember-buffer (deleted)".
bool IsMemfd(const std::string& path, const std::string& name) {
  char target[128];
  const ssize_t n = readlink(path.c_str(), target, sizeof(target) - 1);
  if (n <= 0) return false;
  return absl::string_view(target, n) == absl::StrCat("/memfd:", name, " (deleted)");
}

// Opens descriptor `fd` of process `pid`, a client's memfd called `name` of
// at least `size` bytes sealed against shrinking (so it cannot shrink under
// a mapping: no SIGBUS), read-write; `*inode` is its inode. Nothing else is
// opened for reading or writing: the descriptor is first taken as a path
// only (O_PATH: no open of a FIFO or device happens), checked, and then
// reopened through this process's own descriptor. FAILED_PRECONDITION
// otherwise, naming `what`.
absl::StatusOr<int> OpenClientMemfd(int64_t pid, int fd, const std::string& name, uint64_t size,
                                    const std::string& what, ino_t* inode) {
  const std::string path = absl::StrCat("/proc/", pid, "/fd/", fd);
  auto refused = [&](const std::string& why) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " ", path, " ", why,
                     " (a client in another PID namespace or on another host cannot hand "
                     "over memory this way)"));
  };
  if (pid <= 0 || fd < 0) return refused("names no descriptor");
  const int as_path = open(path.c_str(), O_PATH | O_CLOEXEC);
  if (as_path < 0) return refused(absl::StrCat("cannot be opened: ", std::strerror(errno)));
  const std::string own = absl::StrCat("/proc/self/fd/", as_path);
  struct stat st;
  if (!IsMemfd(own, name) || fstat(as_path, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(as_path);
    return refused(absl::StrCat("is not a memfd named ", name));
  }
  const int opened = open(own.c_str(), O_RDWR | O_CLOEXEC);
  close(as_path);
  if (opened < 0) return refused(absl::StrCat("cannot be opened: ", std::strerror(errno)));
  const int seals = fcntl(opened, F_GET_SEALS);
  if (fstat(opened, &st) != 0 || static_cast<uint64_t>(st.st_size) < size || seals < 0 ||
      (seals & F_SEAL_SHRINK) == 0) {
    close(opened);
    return refused(absl::StrCat("is not a memfd ", name, " of at least ", size,
                                " bytes sealed against shrinking"));
  }
  *inode = st.st_ino;
  return opened;
}

// Whether /proc/<pid>/fd/<fd> is still the file of `inode` (the client has
// not let it go).
bool StillOpen(int64_t pid, int fd, ino_t inode) {
  struct stat st;
  return stat(absl::StrCat("/proc/", pid, "/fd/", fd).c_str(), &st) == 0 && st.st_ino == inode;
}

// Maps `size` bytes of `fd` (closed here) read-write, as `what` ("shared
// memory '...'", "shared buffer ..."): RESOURCE_EXHAUSTED when it cannot,
// FAILED_PRECONDITION (`why_else` said after) when its first 8 bytes are
// not `nonce`, so not the client's.
absl::StatusOr<std::shared_ptr<const ShmChannels::Region>> MapWithNonce(
    int fd, uint64_t size, uint64_t nonce, const std::string& what, const char* why_else) {
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", what, ": ", std::strerror(errno)));
  }
  uint64_t first;
  std::memcpy(&first, base, sizeof(first));
  if (first != nonce) {
    munmap(base, size);
    return absl::FailedPreconditionError(
        absl::StrCat(what, " does not hold the client's nonce", why_else));
  }
  return std::make_shared<const ShmChannels::Region>(static_cast<char*>(base), size);
}

bool SameBuffer(const ember::v1::SharedBuffer& a, const ember::v1::SharedBuffer& b) {
  return a.id() == b.id() && a.pid() == b.pid() && a.fd() == b.fd() && a.size() == b.size() &&
         a.nonce() == b.nonce();
}

}  // namespace

ShmChannels::ShmChannels(absl::Duration idle_timeout, uint64_t max_region_bytes, int max_channels,
                         std::string shm_dir, LinkChannelOptions links)
    : idle_timeout_(idle_timeout),
      max_region_bytes_(max_region_bytes),
      max_channels_(max_channels),
      shm_dir_(std::move(shm_dir)),
      links_(std::move(links)),
      rng_(std::random_device()()) {
  if (!links_.kinds.empty()) reaper_ = std::thread([this] { Reap(); });
}

ShmChannels::~ShmChannels() {
  if (reaper_.joinable()) {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    reaper_.join();
  }
}

void ShmChannels::Reap() {
  for (;;) {
    std::vector<std::pair<uint64_t, std::shared_ptr<LinkState>>> late;
    {
      absl::MutexLock lock(&mu_);
      auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stop), absl::Seconds(1))) return;
      const int64_t now = absl::ToUnixNanos(absl::Now());
      for (const auto& [id, c] : channels_) {
        if (c.link != nullptr && c.link->reply_deadline_ns.load() < now) late.emplace_back(id, c.link);
      }
    }
    for (auto& [id, link] : late) {
      // A call holding the link waits for the reply itself.
      std::unique_lock<std::mutex> call(link->call_mu, std::try_to_lock);
      if (!call.owns_lock()) continue;
      if (link->link->Wait(absl::InfinitePast()).ok()) {  // taken after all
        link->reply_deadline_ns = INT64_MAX;
        continue;
      }
      call.unlock();
      LOG(WARNING) << "link channel " << id << ": the client never took a reply; dropped";
      absl::MutexLock lock(&mu_);
      auto it = channels_.find(id);
      if (it != channels_.end() && it->second.link == link) channels_.erase(it);
    }
  }
}

absl::StatusOr<uint64_t> ShmChannels::Open(const ember::v1::OpenChannelRequest& req,
                                           const std::string& owner, std::string* link_id) {
  if (!req.link().empty()) {
    if (link_id == nullptr) return absl::InternalError("link channel opened without a link id");
    return OpenLink(req, owner, link_id);
  }
  const bool file = !req.shm_file().empty();
  const bool memfd = req.pid() != 0;
  if (file + !req.shm_name().empty() + memfd != 1) {
    return absl::InvalidArgumentError(
        "name the region by exactly one of shm_name, shm_file and pid/memfd");
  }
  // A file is "ember-..." inside shm_dir; a POSIX name "/ember-...". Either
  // way no other '/' (nothing outside the place meant).
  const std::string& name = file ? req.shm_file() : req.shm_name();
  const std::string prefix = file ? "ember-" : "/ember-";
  if (!memfd && (!absl::StartsWith(name, prefix) || name.size() > 200 ||
                 name.find('/', prefix.size()) != std::string::npos)) {
    return absl::InvalidArgumentError(
        absl::StrCat(file ? "shared-memory file '" : "shared-memory name '", name.substr(0, 64),
                     "' must be \"", prefix, "...\" (no other '/')"));
  }
  if (file && shm_dir_.empty()) {
    return absl::FailedPreconditionError(
        "this worker shares no directory for channels (--shm_dir); use a shared-memory name");
  }
  const uint64_t size = req.size();
  if (absl::Status s = CheckRoom(size); !s.ok()) return s;
  const std::string shown = memfd  ? absl::StrCat("/proc/", req.pid(), "/fd/", req.memfd())
                            : file ? absl::StrCat(shm_dir_, "/", name)
                                   : name;
  int fd;
  if (memfd) {
    ino_t inode;
    auto opened =
        OpenClientMemfd(req.pid(), req.memfd(), "ember-channel", size, "channel", &inode);
    if (!opened.ok()) return opened.status();
    fd = *opened;
  } else {
    fd = file ? open(shown.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC)
              : shm_open(name.c_str(), O_RDWR, 0);
  }
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
  auto region = MapWithNonce(fd, size, req.nonce(), absl::StrCat("shared memory '", shown, "'"),
                             ": another host's region of that name");
  if (!region.ok()) return region.status();
  absl::MutexLock lock(&mu_);
  uint64_t id = 0;
  while (id == 0 || channels_.count(id)) id = rng_();
  channels_[id] = Channel{*std::move(region), owner, absl::Now()};
  return id;
}

absl::Status ShmChannels::CheckRoom(uint64_t size) {
  if (size < 4096 || size > max_region_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("channel size ", size, " is outside [4096, ",
                                                   max_region_bytes_, "]"));
  }
  Gone gone;
  absl::MutexLock lock(&mu_);
  ExpireLocked(absl::Now(), &gone);
  if (static_cast<int>(channels_.size()) >= max_channels_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(max_channels_, " channels are open on this worker; close some"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ShmChannels::OpenLink(const ember::v1::OpenChannelRequest& req,
                                               const std::string& owner, std::string* link_id) {
  if (!req.shm_name().empty() || !req.shm_file().empty() || req.pid() != 0) {
    return absl::InvalidArgumentError(
        "a link channel names no region (shm_name, shm_file, pid/memfd): each side has its own");
  }
  cuda::PeerLinks* kind = nullptr;
  std::vector<std::string> offered;
  for (cuda::PeerLinks* k : links_.kinds) {
    if (k->name() == req.link()) kind = k;
    offered.push_back(absl::StrCat("\"", k->name(), "\""));
  }
  if (kind == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this worker offers no \"", req.link().substr(0, 32), "\" links (--links offers ",
        offered.empty() ? "none" : absl::StrJoin(offered, ", "), ")"));
  }
  const uint64_t size = req.size();
  if (absl::Status s = CheckRoom(size); !s.ok()) return s;
  auto id_made = kind->NewId();
  if (!id_made.ok()) return id_made.status();
  // Zeroed: a reply may cover padding between outputs, which must hold
  // nothing of this process's.
  char* base = static_cast<char*>(std::calloc(size, 1));
  if (base == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("a link channel's region of ", size, " bytes"));
  }
  auto region = std::make_shared<const Region>(base, size, /*mapped=*/false);
  auto state = std::make_shared<LinkState>();
  state->memory_on_device = kind->name() == "nccl";
  uint64_t id = 0;
  {
    Gone gone;
    absl::MutexLock lock(&mu_);
    int64_t held = 0;
    for (const auto& [other, c] : channels_) {
      if (c.link != nullptr) held += static_cast<int64_t>(c.region->size());
    }
    if (held + static_cast<int64_t>(size) > links_.max_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "link channels hold ", held, " bytes of this worker's ", links_.max_bytes,
          " (--link_memory_mib); a channel of ", size, " more is refused"));
    }
    while (id == 0 || channels_.count(id)) id = rng_();
    Channel& c = channels_[id];
    c.region = std::move(region);
    c.owner = owner;
    c.last_used = absl::Now();
    c.link = state;
  }
  links_opened_.fetch_add(1, std::memory_order_relaxed);
  // Joined in the background: the client joins once it has this answer.
  std::thread([state, kind, link = *id_made, device = links_.device, size,
               deadline = absl::Now() + links_.transfer_timeout] {
    auto joined = kind->Join(link, 0, device, deadline);
    if (joined.ok()) {
      auto memory = (*joined)->Allocate(size);
      if (memory.ok()) {
        state->link = *std::move(joined);
        state->memory = static_cast<char*>(*memory);
      } else {
        state->join_status = memory.status();
      }
    } else {
      state->join_status = joined.status();
    }
    state->joined.Notify();
  }).detach();
  *link_id = *id_made;
  return id;
}

void ShmChannels::Abandon(uint64_t id, const std::string& owner) {
  Gone gone;
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(id);
  if (it == channels_.end() || it->second.owner != owner || it->second.link == nullptr) return;
  DropLocked(it, &gone);
}

bool ShmChannels::IsLink(uint64_t id, const std::string& owner) const {
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(id);
  return it != channels_.end() && it->second.owner == owner && it->second.link != nullptr;
}

std::map<uint64_t, ShmChannels::Channel>::iterator ShmChannels::DropLocked(
    std::map<uint64_t, Channel>::iterator it, Gone* gone) {
  if (it->second.link != nullptr) gone->push_back(std::move(it->second.link));
  return channels_.erase(it);
}

absl::Status ShmChannels::Receive(LinkState& link, const Region& region,
                                  const ember::v1::ShmSlice& sent,
                                  const std::vector<ember::v1::ShmSlice>* host_slices) {
  if (!link.joined.WaitForNotificationWithTimeout(links_.transfer_timeout)) {
    return absl::UnavailableError("link channel: the link is still being joined");
  }
  if (!link.join_status.ok()) {
    return absl::UnavailableError(
        absl::StrCat("link channel: its link was not joined: ", link.join_status.message()));
  }
  auto bytes = region.Bytes(sent, 1, "link_sent");
  if (!bytes.ok()) return bytes.status();
  cuda::PeerLink& l = *link.link;
  const absl::Time deadline = absl::Now() + links_.transfer_timeout;
  // Waited for before the copy out (as well as the previous call's reply,
  // queued before it): a copy into pageable host memory may block until
  // the stream gets there, out of the deadline's reach.
  absl::Status s;
  if (!bytes->empty()) s = l.Recv(link.memory + sent.offset(), bytes->size());
  if (s.ok()) s = l.Wait(deadline);
  if (s.ok()) link.reply_deadline_ns = INT64_MAX;  // the previous reply was taken
  if (s.ok() && !bytes->empty()) {
    if (host_slices != nullptr && link.memory_on_device) {
      // The slices the caller reads on the host, merged where they touch;
      // one outside the region is left for the caller to refuse.
      std::vector<ByteRange> ranges;
      for (const ember::v1::ShmSlice& h : *host_slices) {
        if (h.size() > 0 && region.Bytes(h, 1, "").ok()) {
          ranges.emplace_back(h.offset(), h.offset() + h.size());
        }
      }
      for (const auto& [begin, end] : MergedRanges(std::move(ranges))) {
        ember::v1::ShmSlice merged;
        merged.set_offset(begin);
        merged.set_size(end - begin);
        s = l.CopyOut(region.Bytes(merged, 1, "")->data(), link.memory + begin, end - begin);
        if (!s.ok()) break;
      }
    } else {
      s = l.CopyOut(bytes->data(), link.memory + sent.offset(), bytes->size());
    }
    if (s.ok()) s = l.Wait(deadline);
  }
  if (!s.ok()) {
    return absl::UnavailableError(absl::StrCat("link channel: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status ShmChannels::Close(uint64_t id, const std::string& owner) {
  Gone gone;
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(id);
  if (it == channels_.end()) return absl::NotFoundError(absl::StrCat("no channel ", id));
  if (it->second.owner != owner) {
    return absl::PermissionDeniedError(absl::StrCat("channel ", id, " belongs to another client"));
  }
  DropLocked(it, &gone);
  return absl::OkStatus();
}

absl::StatusOr<ShmChannels::Transfer> ShmChannels::Use(uint64_t id, const std::string& owner,
                                                       uint64_t seq,
                                                       const ember::v1::ShmSlice& sent,
                                                       const std::vector<ember::v1::ShmSlice>* host_slices) {
  Transfer t;
  {
    Gone gone;
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    ExpireLocked(now, &gone);
    auto ch = FindLocked(id, owner);
    if (!ch.ok()) return ch.status();
    Channel& c = **ch;
    absl::Status refused;
    if (seq <= c.last_seq) {
      refused = absl::InvalidArgumentError(absl::StrCat(
          "channel ", id, " transfer ", seq, " is out of order: transfer ", c.last_seq,
          " came before it (a stale or replayed control message; channel_seq counts from 1)"));
    } else if (c.link == nullptr && (sent.size() != 0 || sent.offset() != 0)) {
      refused = absl::InvalidArgumentError("link_sent on a shared-memory channel");
    }
    if (!refused.ok()) {
      if (c.link != nullptr) DropLocked(channels_.find(id), &gone);  // out of step with the client
      return refused;
    }
    c.last_seq = seq;
    c.last_used = now;
    t.region_ = c.region;
    t.link_ = c.link;
    t.reply_timeout_ = links_.transfer_timeout;
  }
  if (t.link_ == nullptr) return t;
  t.lock_ = std::unique_lock<std::mutex>(t.link_->call_mu);
  if (absl::Status s = Receive(*t.link_, *t.region_, sent, host_slices); !s.ok()) {
    Abandon(id, owner);
    return s;
  }
  return t;
}

absl::StatusOr<ShmChannels::Channel*> ShmChannels::FindLocked(uint64_t id,
                                                               const std::string& owner) {
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
  return &it->second;
}

absl::StatusOr<std::shared_ptr<const ShmChannels::Region>> ShmChannels::MapBuffer(
    uint64_t id, const std::string& owner, const ember::v1::SharedBuffer& b) {
  {
    absl::MutexLock lock(&mu_);
    auto ch = FindLocked(id, owner);
    if (!ch.ok()) return ch.status();
    auto& buffers = (*ch)->buffers;
    // Buffers the client has let go are unmapped here, not kept until the
    // LRU or the channel drops them (the mapping would keep their memory).
    buffers.erase(std::remove_if(buffers.begin(), buffers.end(),
                                 [](const Channel::Buffer& o) {
                                   return !StillOpen(o.buffer.pid(), o.buffer.fd(), o.inode);
                                 }),
                  buffers.end());
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (!SameBuffer(buffers[i].buffer, b)) continue;
      Channel::Buffer hit = std::move(buffers[i]);  // now the most recently used
      buffers.erase(buffers.begin() + i);
      buffers.push_back(hit);
      return hit.region;
    }
  }
  const uint64_t size = b.size();
  if (size < 8192 || size > max_region_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("shared buffer size ", size,
                                                   " is outside [8192, ", max_region_bytes_, "]"));
  }
  ino_t inode;
  auto opened = OpenClientMemfd(b.pid(), b.fd(), "ember-buffer", size, "shared buffer", &inode);
  if (!opened.ok()) return opened.status();
  auto region = MapWithNonce(*opened, size, b.nonce(),
                             absl::StrCat("shared buffer /proc/", b.pid(), "/fd/", b.fd()), "");
  if (!region.ok()) return region.status();
  absl::MutexLock lock(&mu_);
  auto ch = FindLocked(id, owner);
  if (!ch.ok()) return ch.status();
  auto& buffers = (*ch)->buffers;
  if (static_cast<int>(buffers.size()) >= kMaxBuffers) buffers.erase(buffers.begin());
  buffers.push_back(Channel::Buffer{b, *region, inode});
  return *region;
}

int ShmChannels::open_channels() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(channels_.size());
}

int ShmChannels::link_channels() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [id, c] : channels_) n += c.link != nullptr;
  return n;
}

void ShmChannels::ExpireLocked(absl::Time now, Gone* gone) {
  for (auto it = channels_.begin(); it != channels_.end();) {
    it = now - it->second.last_used > idle_timeout_ ? DropLocked(it, gone) : std::next(it);
  }
}

}  // namespace worker
}  // namespace ember
