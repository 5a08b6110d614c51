// libFuzzer target: the coordinator's request decoders and validators
// (ember.v1.Coordinator) in process: spec and topology validation with the
// planner behind it (PreviewPlan), worker registration and heartbeats,
// collection lookups, checkpoint and drain requests. Calls that would dial
// workers (CreateCollection, Restore) are left out: with no live workers
// they stop at validation anyway, which PreviewPlan covers.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "proto/service.pb.h"
#include "server/coordinator/coordinator_service.h"

namespace {

ember::coordinator::CoordinatorService* Make() {
  ember::coordinator::CoordinatorOptions o;
  auto c = ember::coordinator::CoordinatorService::Create(o);
  if (!c.ok()) std::abort();
  return c->release();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static ember::coordinator::CoordinatorService* service = Make();
  if (size < 1) return 0;
  const std::string payload(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 6) {
    case 0: {
      ember::v1::PreviewPlanRequest r;
      ember::v1::PreviewPlanResponse out;
      // The planner's cost grows with tables x workers; keep runs short (its
      // scale is the planner tests' and benchmarks'; the limits that bound
      // it, formats_fuzz's).
      if (r.ParseFromString(payload) && r.topology().world_size() > 0 &&
          r.topology().world_size() <= 64 && r.spec().tables_size() <= 16) {
        (void)service->PreviewPlan(nullptr, &r, &out);
      }
      break;
    }
    case 1: {  // registrations of fake workers: nothing dials them here
      ember::v1::RegisterWorkerRequest r;
      ember::v1::RegisterWorkerResponse out;
      if (r.ParseFromString(payload)) (void)service->RegisterWorker(nullptr, &r, &out);
      break;
    }
    case 2: {
      ember::v1::HeartbeatRequest r;
      ember::v1::HeartbeatResponse out;
      if (r.ParseFromString(payload)) (void)service->Heartbeat(nullptr, &r, &out);
      break;
    }
    case 3: {
      ember::v1::GetCollectionRequest r;
      ember::v1::GetCollectionResponse out;
      if (r.ParseFromString(payload)) (void)service->GetCollection(nullptr, &r, &out);
      ember::v1::DropCollectionRequest d;
      ember::v1::DropCollectionResponse dropped;
      if (d.ParseFromString(payload)) (void)service->DropCollection(nullptr, &d, &dropped);
      break;
    }
    case 4: {
      ember::v1::CheckpointRequest r;
      ember::v1::CheckpointResponse out;
      if (r.ParseFromString(payload)) {
        r.set_dir("/nonexistent/ember-fuzz");
        (void)service->Checkpoint(nullptr, &r, &out);
      }
      break;
    }
    default: {
      ember::v1::DrainWorkerRequest r;
      ember::v1::DrainWorkerResponse out;
      // A drain of a registered fake worker holding nothing touches no worker.
      if (r.ParseFromString(payload)) (void)service->DrainWorker(nullptr, &r, &out);
      // A rescale finds no collection (none is ever created here).
      ember::v1::ScaleCollectionRequest s;
      ember::v1::ScaleCollectionResponse scaled;
      if (s.ParseFromString(payload)) (void)service->ScaleCollection(nullptr, &s, &scaled);
    }
  }
  return 0;
}
