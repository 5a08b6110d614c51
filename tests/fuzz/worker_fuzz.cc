// libFuzzer target: every request decoder and validator of the worker
// (ember.v1.Worker) in process, on a worker holding a small collection.
// The first byte picks the method, the rest is the serialized request.
// Invariants besides "no crash, no sanitizer report": the collection "c"
// keeps answering a fixed lookup with unchanged values unless an
// acknowledged mutation targeted it. A dynamic table ("d") takes any id.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "proto/service.pb.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/dynamic/dynamic_backend.h"
#include "server/common/wire.h"
#include "server/worker/worker_service.h"

namespace {

using ember::v1::TableConfig;
using ember::worker::WorkerService;

WorkerService* Make() {
  ember::backend::CpuBackendOptions o;
  o.memory_limit_bytes = 64 << 20;
  auto backend = ember::backend::CreateCpuBackend(o);
  if (!backend.ok()) std::abort();
  ember::worker::WorkerServiceOptions so;
  so.max_response_bytes = 16 << 20;
  so.skip_nonfinite = std::getenv("EMBER_FUZZ_SKIP_NONFINITE") != nullptr;
  auto* s = new WorkerService(ember::backend::WithDynamicShards(std::move(*backend)), so);
  ember::v1::CreateShardsRequest req;
  req.set_collection("c");
  req.set_epoch(1);
  struct T {
    const char* name;
    int rows, dim;
    TableConfig::Pooling pooling;
    ember::v1::OptimizerSpec::Type opt;
  } tables[] = {{"t", 50, 8, TableConfig::SUM, ember::v1::OptimizerSpec::ADAM},
                {"m", 30, 4, TableConfig::MEAN, ember::v1::OptimizerSpec::ROWWISE_ADAGRAD},
                {"s", 20, 4, TableConfig::NONE, ember::v1::OptimizerSpec::ADAGRAD}};
  for (const T& t : tables) {
    auto* a = req.add_shards();
    a->mutable_ref()->set_table(t.name);
    TableConfig* c = a->mutable_table();
    c->set_name(t.name);
    c->set_num_embeddings(t.rows);
    c->set_embedding_dim(t.dim);
    c->set_pooling(t.pooling);
    c->mutable_optimizer()->set_type(t.opt);
    a->set_rows(t.rows);
    a->set_cols(t.dim);
  }
  // A dynamic table: any int64 id, admission at 2, TTL 3, LFU.
  auto* d = req.add_shards();
  d->mutable_ref()->set_table("d");
  TableConfig* dc = d->mutable_table();
  dc->set_name("d");
  dc->set_num_embeddings(16);
  dc->set_embedding_dim(4);
  dc->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::ADAGRAD);
  dc->mutable_dynamic()->set_capacity(16);
  dc->mutable_dynamic()->set_admit_after(2);
  dc->mutable_dynamic()->set_ttl_steps(3);
  dc->mutable_dynamic()->set_eviction(ember::v1::DynamicTableSpec::LFU);
  d->set_rows(16);
  d->set_cols(4);
  ember::v1::CreateShardsResponse resp;
  if (!s->CreateShards(nullptr, &req, &resp).ok()) std::abort();
  // The same tables trained SYNC by one trainer: its steps' path (a step
  // never waits for another rank; a lookup waits at most 1 ms).
  req.set_collection("sync");
  req.mutable_training()->set_mode(ember::v1::TrainingSpec::SYNC);
  req.mutable_training()->set_trainers(1);
  req.mutable_training()->set_step_timeout_s(0.001);
  if (!s->CreateShards(nullptr, &req, &resp).ok()) std::abort();
  return s;
}

template <typename Req>
bool Parse(const std::string& bytes, Req* r) {
  return r->ParseFromString(bytes);
}

// A shared-memory channel the service has mapped (as a client on this host
// would open it): calls through it read the fuzzer's bytes from the region.
struct FuzzChannel {
  char* base = nullptr;
  uint64_t size = 1 << 16;
  uint64_t id = 0;
  uint64_t seq = 0;  // transfers sent through it
};

FuzzChannel OpenFuzzChannel(WorkerService* s) {
  FuzzChannel ch;
  const std::string name = "/ember-fuzz-" + std::to_string(getpid());
  const int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0 || ftruncate(fd, ch.size) != 0) std::abort();
  ch.base = static_cast<char*>(mmap(nullptr, ch.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  ember::v1::OpenChannelRequest req;
  req.set_shm_name(name);
  req.set_size(ch.size);
  ember::v1::OpenChannelResponse resp;
  if (ch.base == MAP_FAILED || !s->OpenChannel(nullptr, &req, &resp).ok()) std::abort();
  shm_unlink(name.c_str());
  ch.id = resp.channel_id();
  return ch;
}

// A client shared buffer the service can map (a sealed memfd, as
// client/shared_buffer.cc makes): lookups through the channel name it as
// their output buffer, with the fuzzer's placements, and as their id
// buffer, holding part of the payload (the ids any buffer_ids slice names).
char* shared_base = nullptr;
ember::v1::SharedBuffer MakeSharedBuffer() {
  const uint64_t size = 1 << 16;
  const int fd = memfd_create("ember-buffer", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0 || ftruncate(fd, size) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    std::abort();
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) std::abort();
  const uint64_t nonce = 0x0e11be7;
  std::memcpy(base, &nonce, sizeof(nonce));
  shared_base = static_cast<char*>(base);
  ember::v1::SharedBuffer b;
  b.set_id(1);
  b.set_pid(getpid());
  b.set_fd(fd);
  b.set_size(size);
  b.set_nonce(nonce);
  return b;  // descriptor and mapping kept for the process's life
}

// The first half of the payload goes into the region, the rest is the
// request.
std::string Split(const std::string& payload, const FuzzChannel& ch) {
  const size_t half = std::min<size_t>(payload.size() / 2, ch.size);
  std::memcpy(ch.base, payload.data(), half);
  return payload.substr(half);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static WorkerService* service = Make();
  static FuzzChannel channel = OpenFuzzChannel(service);
  static const ember::v1::SharedBuffer output = MakeSharedBuffer();
  if (size < 1) return 0;
  const std::string payload(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 13) {
    case 9:     // a lookup through the channel
    case 12: {  // the same with a mappable output and id buffer (the fuzzer's
                // placements and buffer_ids)
      ember::v1::WorkerLookupRequest r;
      ember::v1::WorkerLookupResponse out;
      if (Parse(Split(payload, channel), &r)) {
        r.set_channel_id(channel.id);
        r.set_channel_seq(++channel.seq);
        if (data[0] % 13 == 12) {
          *r.mutable_out_buffer() = output;
          *r.mutable_id_buffer() = output;
          std::memcpy(shared_base + 4096, payload.data(), std::min<size_t>(payload.size(), 4096));
        }
        (void)service->Lookup(nullptr, &r, &out);
      }
      break;
    }
    case 10: {  // an update through the channel
      ember::v1::WorkerApplyGradientsRequest r;
      ember::v1::WorkerApplyGradientsResponse out;
      if (Parse(Split(payload, channel), &r)) {
        r.set_channel_id(channel.id);
        r.set_channel_seq(++channel.seq);
        (void)service->ApplyGradients(nullptr, &r, &out);
      }
      break;
    }
    case 11: {  // opening (names that do not exist) and closing channels
      ember::v1::OpenChannelRequest r;
      ember::v1::OpenChannelResponse out;
      if (Parse(payload, &r)) {
        if (r.pid() != 0) {  // descriptors of this process, whatever they are
          r.set_pid(getpid());
          r.clear_shm_name();
          r.clear_shm_file();
        } else {
          r.set_shm_name("/ember-fuzz-absent-" + r.shm_name().substr(0, 32));
        }
        (void)service->OpenChannel(nullptr, &r, &out);
      }
      ember::v1::CloseChannelRequest c;
      ember::v1::CloseChannelResponse closed;
      if (Parse(payload, &c) && c.channel_id() != channel.id) {
        (void)service->CloseChannel(nullptr, &c, &closed);
      }
      break;
    }
    case 0: {
      ember::v1::WorkerLookupRequest r;
      ember::v1::WorkerLookupResponse out;
      if (Parse(payload, &r)) {
        if (payload.size() % 2 == 1) r.set_collection("sync");
        (void)service->Lookup(nullptr, &r, &out);
      }
      break;
    }
    case 1: {
      ember::v1::WorkerApplyGradientsRequest r;
      ember::v1::WorkerApplyGradientsResponse out;
      if (Parse(payload, &r)) {
        if (payload.size() % 2 == 1) r.set_collection("sync");
        (void)service->ApplyGradients(nullptr, &r, &out);
      }
      break;
    }
    case 2: {
      ember::v1::ImportRowsRequest r;
      ember::v1::ImportRowsResponse out;
      if (Parse(payload, &r)) (void)service->ImportRows(nullptr, &r, &out);
      break;
    }
    case 3: {
      ember::v1::ExportRowsRequest r;
      ember::v1::ExportRowsResponse out;
      if (Parse(payload, &r)) (void)service->ExportRows(nullptr, &r, &out);
      break;
    }
    case 4: {  // creates are dropped again so memory stays bounded
      ember::v1::CreateShardsRequest r;
      ember::v1::CreateShardsResponse out;
      if (Parse(payload, &r) && r.collection() != "c" && r.collection() != "sync" &&
          service->CreateShards(nullptr, &r, &out).ok()) {
        ember::v1::DropShardsRequest d;
        d.set_collection(r.collection());
        d.set_epoch(r.epoch());
        ember::v1::DropShardsResponse dropped;
        if (!service->DropShards(nullptr, &d, &dropped).ok()) std::abort();
      }
      break;
    }
    case 5: {
      ember::v1::UpdateShardsRequest r;
      ember::v1::UpdateShardsResponse out;
      if (Parse(payload, &r) && r.collection() != "c" && r.collection() != "sync") {
        (void)service->UpdateShards(nullptr, &r, &out);
      }
      break;
    }
    case 6: {
      ember::v1::DropShardsRequest r;
      ember::v1::DropShardsResponse out;
      if (Parse(payload, &r) && r.collection() != "c" && r.collection() != "sync") {
        (void)service->DropShards(nullptr, &r, &out);
      }
      break;
    }
    case 7: {  // reads only under a directory that holds no checkpoint
      ember::v1::LoadCheckpointRequest r;
      ember::v1::LoadCheckpointResponse out;
      if (Parse(payload, &r)) {
        r.set_dir("/nonexistent/ember-fuzz");
        (void)service->LoadCheckpoint(nullptr, &r, &out);
      }
      break;
    }
    default: {
      ember::v1::ShardStatusRequest r;
      ember::v1::ShardStatusResponse out;
      if (Parse(payload, &r)) (void)service->ShardStatus(nullptr, &r, &out);
    }
  }
  return 0;
}
