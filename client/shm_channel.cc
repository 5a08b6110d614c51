#include "client/shm_channel.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/shared_buffer.h"
#include "server/common/grpc_util.h"

namespace ember {
namespace client {
namespace {

// How long a client waits for a link channel's link to be joined.
constexpr absl::Duration kLinkJoinTimeout = absl::Seconds(15);

// A channel's region for calls of `bytes`: at least 1 MiB, whole pages.
uint64_t RegionSize(uint64_t bytes) {
  return (std::max<uint64_t>(bytes, 1 << 20) + 4095) / 4096 * 4096;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::Open(
    ember::v1::Worker::Stub* stub, uint64_t bytes, const std::string& shm_dir,
    const std::function<void(grpc::ClientContext*)>& prepare) {
  if (!shm_dir.empty()) return OpenAs(Handover::kFile, stub, bytes, shm_dir, prepare);
  // A sealed memfd first; a worker that cannot open it (another PID
  // namespace sharing /dev/shm, an older worker) gets a name.
  auto ch = OpenAs(Handover::kMemfd, stub, bytes, shm_dir, prepare);
  if (ch.ok() || absl::IsUnavailable(ch.status()) || absl::IsDeadlineExceeded(ch.status()) ||
      absl::IsResourceExhausted(ch.status()) || absl::IsUnauthenticated(ch.status()) ||
      absl::IsPermissionDenied(ch.status())) {
    return ch;
  }
  return OpenAs(Handover::kName, stub, bytes, shm_dir, prepare);
}

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::OpenAs(
    Handover handover, ember::v1::Worker::Stub* stub, uint64_t bytes, const std::string& shm_dir,
    const std::function<void(grpc::ClientContext*)>& prepare) {
  static std::atomic<uint64_t> counter{0};
  const uint64_t size = RegionSize(bytes);
  std::random_device rd;
  const std::string base_name =
      absl::StrCat("ember-", getpid(), "-", counter.fetch_add(1), "-", rd());
  // A memfd (nothing named), a POSIX shared-memory name, or a file in the
  // shared directory.
  const std::string name =
      handover == Handover::kFile ? absl::StrCat(shm_dir, "/", base_name) : "/" + base_name;
  int fd = -1;
  switch (handover) {
    case Handover::kMemfd:  // sealed at its size: it never shrinks under the worker
      fd = SealedMemfd("ember-channel", size);
      break;
    case Handover::kName:
      fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      break;
    case Handover::kFile:
      fd = open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0660);
      break;
  }
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat(
        handover == Handover::kMemfd ? "memfd_create" : handover == Handover::kName ? "shm_open "
                                                                                     : "open ",
        handover == Handover::kMemfd ? "" : name, ": ", std::strerror(errno)));
  }
  auto unlink_name = [&] {
    if (handover == Handover::kName) shm_unlink(name.c_str());
    if (handover == Handover::kFile) unlink(name.c_str());
  };
  // A worker of this user or group maps it read-write, whatever the umask.
  if (handover == Handover::kFile) (void)fchmod(fd, 0660);
  std::unique_ptr<ShmChannel> ch(new ShmChannel());
  ch->stub_ = stub;
  ch->prepare_ = prepare;
  void* base = MAP_FAILED;
  if (handover == Handover::kMemfd || ftruncate(fd, static_cast<off_t>(size)) == 0) {
    base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (base == MAP_FAILED) {
    close(fd);
    unlink_name();
    return absl::ResourceExhaustedError(absl::StrCat("shared memory of ", size, " bytes: ",
                                                     std::strerror(errno)));
  }
  ch->base_ = static_cast<char*>(base);
  ch->size_ = size;
  // The worker checks it maps these bytes, not another host's region of
  // the same name.
  const uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) | rd();
  std::memcpy(ch->base_, &nonce, sizeof(nonce));
  grpc::ClientContext ctx;
  prepare(&ctx);
  ember::v1::OpenChannelRequest req;
  switch (handover) {
    case Handover::kMemfd:  // held open until the worker has opened it
      req.set_pid(getpid());
      req.set_memfd(fd);
      break;
    case Handover::kName:
      req.set_shm_name(name);
      break;
    case Handover::kFile:
      req.set_shm_file(base_name);
      break;
  }
  req.set_size(size);
  req.set_nonce(nonce);
  ember::v1::OpenChannelResponse resp;
  const grpc::Status s = stub->OpenChannel(&ctx, req, &resp);
  close(fd);
  unlink_name();  // mapped on both sides (or refused): the name is done with
  if (!s.ok()) return FromGrpc(s, "OpenChannel");  // the destructor unmaps
  ch->id_ = resp.channel_id();
  ch->reads_id_buffers_ = resp.reads_id_buffers();
  return ch;
}

absl::StatusOr<std::unique_ptr<ShmChannel>> ShmChannel::OpenLink(
    ember::v1::Worker::Stub* stub, uint64_t bytes, cuda::PeerLinks* kind, int device,
    absl::Time deadline, const std::function<void(grpc::ClientContext*)>& prepare) {
  const uint64_t size = RegionSize(bytes);
  std::unique_ptr<ShmChannel> ch(new ShmChannel());
  ch->base_ = static_cast<char*>(std::aligned_alloc(4096, size));
  if (ch->base_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("a link channel's region of ", size, " bytes"));
  }
  ch->heap_ = true;
  ch->size_ = size;
  grpc::ClientContext ctx;
  prepare(&ctx);
  ember::v1::OpenChannelRequest req;
  req.set_link(kind->name());
  req.set_size(size);
  ember::v1::OpenChannelResponse resp;
  const grpc::Status s = stub->OpenChannel(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s, "OpenChannel");
  ch->stub_ = stub;  // from here the destructor closes the worker's side
  ch->prepare_ = prepare;
  ch->id_ = resp.channel_id();
  auto link = kind->Join(resp.link_id(), 1, device, deadline);
  if (!link.ok()) return link.status();
  auto memory = (*link)->Allocate(size);
  if (!memory.ok()) return memory.status();
  ch->link_ = *std::move(link);
  ch->link_memory_ = static_cast<char*>(*memory);
  return ch;
}

ShmChannel::~ShmChannel() {
  if (id_ != 0 && stub_ != nullptr) {
    grpc::ClientContext ctx;
    prepare_(&ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    ember::v1::CloseChannelRequest req;
    req.set_channel_id(id_);
    ember::v1::CloseChannelResponse resp;
    (void)stub_->CloseChannel(&ctx, req, &resp);
  }
  link_.reset();  // aborts what is still queued
  if (base_ != nullptr) {
    if (heap_) {
      std::free(base_);
    } else {
      munmap(base_, size_);
    }
  }
}

bool ChannelPool::SameHost(const std::string& address) {
  return absl::StartsWith(address, "127.") || absl::StartsWith(address, "localhost:") ||
         absl::StartsWith(address, "[::1]:");
}

ChannelPool::Lease ChannelPool::Acquire(const std::string& address, uint64_t bytes,
                                        const std::string& shm_dir, ember::v1::Worker::Stub* stub,
                                        const std::function<void(grpc::ClientContext*)>& prepare,
                                        cuda::PeerLinks* link, int device) {
  // Socket links join over an abstract socket of this host's: loopback
  // workers only, as shared memory without a directory.
  const bool host_only = link == nullptr ? shm_dir.empty() : link->name() == "socket";
  if ((host_only && !SameHost(address)) || bytes > static_cast<uint64_t>(kMaxMessageBytes)) {
    return Lease();
  }
  Slot* slot;
  {
    absl::MutexLock lock(&mu_);
    auto& s = slots_[address];
    if (!s) s = std::make_unique<Slot>();
    slot = s.get();
  }
  std::unique_lock<std::mutex> lock(slot->mu, std::try_to_lock);
  if (!lock.owns_lock()) return Lease();  // another call has it: inline
  if (slot->broken) {
    slot->channel.reset();
    slot->broken = false;
  }
  if (slot->channel == nullptr || slot->channel->size() < bytes) {
    if (absl::Now() < slot->retry_after) return Lease();
    slot->channel.reset();
    auto ch = link != nullptr ? ShmChannel::OpenLink(stub, bytes + bytes / 4, link, device,
                                                     absl::Now() + kLinkJoinTimeout, prepare)
                              : ShmChannel::Open(stub, bytes + bytes / 4, shm_dir, prepare);
    if (!ch.ok()) {
      // Another host after all, shared memory or the link turned off there,
      // a link that could not be joined: inline for a while before asking
      // again.
      if (link != nullptr && link_warnings_.fetch_add(1) < 4) {  // asked for, not had: say so
        std::fprintf(stderr, "ember client: no %s link channel to %s, its calls go inline: %s\n",
                     link->name().c_str(), address.c_str(), ch.status().ToString().c_str());
      }
      slot->retry_after = absl::Now() + absl::Seconds(60);
      return Lease();
    }
    slot->channel = *std::move(ch);
  }
  return Lease(std::move(lock), slot->channel.get(), &slot->broken, &slot->ids_refused);
}

}  // namespace client
}  // namespace ember
