// emberctl: the operator's and tester's command line.
//
//   emberctl plan --spec=FILE --world_size=N [--local_world_size=N]
//       [--sharding_type=TYPE] [--compute_device=cuda|cpu] [--hbm_cap_gib=X]
//       [--ddr_cap_gib=X] [--batch_size=N] [--num_trainers=N]
//       [--format=table|json]
//   emberctl up --workers=N [--port=P] [--device=cpu|cuda]
//   emberctl coordinator [--listen=HOST:PORT]
//   emberctl worker --coordinator=ADDR [--listen=HOST:PORT] [--device=cpu|cuda]
//       [--cuda_device=N] [--cuda_scratch_mib=M]
//   emberctl create --coordinator=ADDR --spec=FILE [--sharding_type=TYPE | --plan=FILE]
//   emberctl plan --coordinator=ADDR --collection=NAME
//   emberctl status --coordinator=ADDR
//   emberctl lookup --coordinator=ADDR --collection=NAME --input=kjt.json --output=out.json
//   emberctl apply-gradients --coordinator=ADDR --collection=NAME --input=kjt.json
//       --grads=grads.json
//   emberctl export --coordinator=ADDR --collection=NAME --table=T --output=FILE.npy
//       (a dynamic table: its rows, and FILE.ids.npy the ids they hold)
//   emberctl checkpoint --coordinator=ADDR --collection=NAME [--dir=ROOT] [--incremental]
//   emberctl checkpoints --coordinator=ADDR [--collection=NAME]
//   emberctl restore --coordinator=ADDR --from=PATH [--collection=NEW_NAME]
//       [--sharding_type=TYPE]
//   emberctl drain --coordinator=ADDR --worker=ID
//   emberctl scale --coordinator=ADDR --collection=NAME --workers=N
//   emberctl set-trainers --coordinator=ADDR --collection=NAME --trainers=N --from_step=S
//   emberctl calibrate --coordinator=ADDR --output=FILE [--calibrate_rows=N]
//   emberctl tokens --dir=DIR [--workers=N | --worker_names=A,B,...]
//
// Exit status: 0 success, 1 the request failed (bad spec, infeasible plan),
// 2 bad usage.
#include <cmath>
#include <cstdint>
#include <iostream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/cluster_commands.h"
#include "cli/exit_status.h"
#include "cli/spec_io.h"
#include "cuda/device_query.h"
#include "gflags/gflags.h"
#include "server/common/host_memory.h"
#include "cli/json_io.h"
#include "planner/cost_model_io.h"
#include "planner/plan_format.h"
#include "planner/planner.h"
#include "planner/sharding_types.h"

DEFINE_int32(keep_freed_heap_mib, 256,
             "worker, coordinator, up: freed heap memory kept for reuse, MiB (glibc; "
             "allocations under 32 MiB from the heap), so per-call buffers of megabytes are "
             "not faulted in afresh each call; 0: the allocator's defaults.");
DEFINE_string(spec, "", "Collection spec, JSON (proto3 mapping of ember.v1.CollectionSpec).");
DEFINE_int32(world_size, 2, "Number of workers.");
DEFINE_int32(local_world_size, 0, "Workers per host (0: world_size, one host).");
DEFINE_string(sharding_type, "",
              "Force one sharding type on every table (table_wise, row_wise, "
              "column_wise, table_row_wise, table_column_wise, data_parallel).");
DEFINE_string(compute_device, "",
              "Worker device kind: cuda or cpu (default: cuda where this machine has a CUDA "
              "device, else cpu; plan says which on stderr).");
DEFINE_double(hbm_cap_gib, 0, "HBM per worker in GiB (0: device default, 80 GiB for cuda).");
DEFINE_double(ddr_cap_gib, 0, "Host memory per worker in GiB (0: default, 128 GiB).");
DEFINE_int32(batch_size, 0, "Per-trainer batch size (0: 512).");
DEFINE_int32(num_trainers, 0, "Trainers issuing batches concurrently (0: world_size).");
DEFINE_string(format, "table", "Output format: table or json.");
DECLARE_string(coordinator);
DECLARE_string(cost_model);
DECLARE_string(plan);

namespace {

using ember::cli::Fail;
using ember::cli::kExitUsage;

int Usage(const std::string& message) {
  std::cerr << "emberctl: " << message << "\n\n"
            << gflags::ProgramUsage() << std::endl;
  return kExitUsage;
}

int64_t GiBToBytes(double gib) {
  return static_cast<int64_t>(std::llround(gib * 1024.0 * 1024.0 * 1024.0));
}

int RunPlan() {
  if (FLAGS_spec.empty()) return Usage("plan needs --spec=FILE");
  if (FLAGS_format != "table" && FLAGS_format != "json") {
    return Usage("--format must be table or json, got '" + FLAGS_format + "'");
  }
  ember::v1::Topology topology;
  if (FLAGS_compute_device.empty()) {
    // This machine's kind, said aloud: a plan for GPUs made on a laptop, or
    // the reverse, is the kind of surprise a default should not spring.
    auto devices = ember::cuda::QueryDevices();
    const bool gpu = devices.ok() && !devices->empty();
    FLAGS_compute_device = gpu ? "cuda" : "cpu";
    std::cerr << "emberctl plan: planning for " << FLAGS_compute_device << " workers ("
              << (gpu ? "this machine has a CUDA device"
                      : "this machine has no CUDA device")
              << "; --compute_device chooses)" << std::endl;
  }
  if (FLAGS_compute_device == "cuda") {
    topology.set_compute_device(ember::v1::CUDA);
  } else if (FLAGS_compute_device == "cpu") {
    topology.set_compute_device(ember::v1::CPU);
  } else {
    return Usage("--compute_device must be cuda or cpu, got '" +
                 FLAGS_compute_device + "'");
  }
  if (FLAGS_hbm_cap_gib < 0 || FLAGS_ddr_cap_gib < 0 ||
      !std::isfinite(FLAGS_hbm_cap_gib) || !std::isfinite(FLAGS_ddr_cap_gib)) {
    return Usage("--hbm_cap_gib and --ddr_cap_gib must be >= 0");
  }
  topology.set_world_size(FLAGS_world_size);
  topology.set_local_world_size(FLAGS_local_world_size);
  topology.set_hbm_cap_bytes(GiBToBytes(FLAGS_hbm_cap_gib));
  topology.set_ddr_cap_bytes(GiBToBytes(FLAGS_ddr_cap_gib));
  topology.set_batch_size(FLAGS_batch_size);
  topology.set_num_trainers(FLAGS_num_trainers);

  auto spec = ember::cli::ReadCollectionSpec(FLAGS_spec);
  if (!spec.ok()) return Fail("plan", spec.status());
  if (!FLAGS_sharding_type.empty()) {
    // Like the seed tutorial's gen_constraints: one type for every table.
    if (absl::Status s = ember::planner::ForceShardingType(FLAGS_sharding_type, &*spec); !s.ok()) {
      return Usage(std::string(s.message()));
    }
  }
  ember::planner::PlannerOptions options;
  if (!FLAGS_cost_model.empty()) {
    ember::v1::ComputeDevice device;
    auto model = ember::planner::LoadCostModel(FLAGS_cost_model, &device);
    if (!model.ok()) return Fail("plan", model.status());
    if (device != topology.compute_device()) {
      return Usage("--cost_model=" + FLAGS_cost_model + " is for " +
                   (device == ember::v1::CUDA ? "cuda" : "cpu") + " workers; --compute_device=" +
                   FLAGS_compute_device);
    }
    options.cost_model = *model;
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<ember::v1::ShardingPlan> plan;
  if (!FLAGS_plan.empty()) {  // check and score a plan made elsewhere
    if (!FLAGS_sharding_type.empty()) return Usage("plan takes --plan or --sharding_type, not both");
    auto text = ember::cli::ReadFile(FLAGS_plan);
    if (!text.ok()) return Fail("plan", text.status());
    auto given = ember::planner::ParsePlanJson(*text);
    if (!given.ok()) return Fail("plan", given.status());
    plan = ember::planner::CheckPlan(*spec, topology, *given, options);
  } else {
    plan = ember::planner::Plan(*spec, topology, options);
  }
  if (!plan.ok()) return Fail("plan", plan.status());
  plan->mutable_stats()->set_planning_ms(absl::ToDoubleMilliseconds(absl::Now() - start));
  if (FLAGS_format == "json") {
    std::cout << ember::planner::FormatPlanJson(*plan) << std::endl;
  } else {
    std::cout << ember::planner::FormatPlanTable(*plan);
    std::cout << (FLAGS_plan.empty() ? "planned " : "checked ") << plan->tables_size() << " table(s) on "
              << plan->topology().world_size() << " worker(s) in "
              << absl::StrCat(plan->stats().planning_ms()) << " ms" << std::endl;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "Ember's command line.\n"
      "  emberctl plan --spec=FILE --world_size=N [--local_world_size=N]\n"
      "      [--sharding_type=TYPE] [--compute_device=cuda|cpu]\n"
      "      [--hbm_cap_gib=X] [--ddr_cap_gib=X] [--batch_size=N]\n"
      "      [--num_trainers=N] [--format=table|json] [--cost_model=FILE]\n"
      "      [--plan=FILE: check and score a plan made elsewhere instead]\n"
      "  emberctl up --workers=N [--port=P] [--device=cpu|cuda] [--threads=N]\n"
      "      [--checkpoint_dir=ROOT [--checkpoint_every=DURATION]] [--state_dir=DIR]\n"
      "      [--skip_nonfinite] [--restart_workers=true|false] [--dynamic_exact_pending_ids=N]\n"
      "  emberctl coordinator [--listen=HOST:PORT] [--state_dir=DIR] [--checkpoint_dir=ROOT]\n"
      "      [--checkpoint_every=DURATION [--checkpoint_incremental]] [--keep_checkpoints=K]\n"
      "      [--checkpoint_full_every=K] [--checkpoint_compact_after=N]\n"
      "  emberctl worker --coordinator=ADDR [--listen=HOST:PORT] [--device=cpu|cuda]\n"
      "      [--cuda_device=N] [--cuda_scratch_mib=M]\n"
      "  emberctl create --coordinator=ADDR --spec=FILE [--sharding_type=TYPE | --plan=FILE]\n"
      "  emberctl plan --coordinator=ADDR --collection=NAME [--format=table|json]\n"
      "  emberctl status --coordinator=ADDR\n"
      "  emberctl lookup --coordinator=ADDR --collection=NAME --input=kjt.json --output=out.json\n"
      "  emberctl apply-gradients --coordinator=ADDR --collection=NAME --input=kjt.json\n"
      "      --grads=grads.json [--request_id=ID]\n"
      "  emberctl export --coordinator=ADDR --collection=NAME --table=T --output=FILE.npy\n"
      "  emberctl checkpoint --coordinator=ADDR --collection=NAME [--dir=ROOT] [--incremental]\n"
      "  emberctl checkpoints --coordinator=ADDR [--collection=NAME]\n"
      "  emberctl restore --coordinator=ADDR --from=CHECKPOINT_OR_ROOT [--collection=NEW_NAME]\n"
      "      [--sharding_type=TYPE]\n"
      "  emberctl drain --coordinator=ADDR --worker=ID\n"
      "  emberctl scale --coordinator=ADDR --collection=NAME --workers=N\n"
      "  emberctl set-trainers --coordinator=ADDR --collection=NAME --trainers=N --from_step=S\n"
      "  emberctl calibrate --coordinator=ADDR --output=FILE [--calibrate_rows=N]\n"
      "  emberctl tokens --dir=DIR [--workers=N | --worker_names=A,B,...]\n"
      "Run 'emberctl --helpshort' for every flag.");
  ember::cli::BlockTerminationSignals();  // before any thread exists
  gflags::ParseCommandLineFlags(&argc, &argv, /*remove_flags=*/true);
  if (argc < 2) return Usage("missing command");
  const std::string command = argv[1];
  if (command == "worker" || command == "coordinator" || command == "up") {
    if (FLAGS_keep_freed_heap_mib < 0) return Usage("--keep_freed_heap_mib must be >= 0");
    if (!ember::KeepFreedHeapMemory(int64_t{FLAGS_keep_freed_heap_mib} << 20)) {
      std::cerr << "emberctl: the allocator refused --keep_freed_heap_mib; using its defaults"
                << std::endl;
    }
  }
  if (argc > 2) return Usage(absl::StrCat("unexpected argument '", argv[2], "'"));
  namespace ec = ember::cli;
  if (command == "plan") return FLAGS_coordinator.empty() ? RunPlan() : ec::RunLivePlan();
  if (command == "up") return ec::RunUp("/proc/self/exe");
  if (command == "coordinator") return ec::RunCoordinator();
  if (command == "worker") return ec::RunWorker();
  if (command == "create") return ec::RunCreate();
  if (command == "status") return ec::RunStatus();
  if (command == "lookup") return ec::RunLookup();
  if (command == "apply-gradients") return ec::RunApplyGradients();
  if (command == "export") return ec::RunExport();
  if (command == "checkpoint") return ec::RunCheckpoint();
  if (command == "checkpoints") return ec::RunCheckpoints();
  if (command == "restore") return ec::RunRestore();
  if (command == "drain") return ec::RunDrain();
  if (command == "scale") return ec::RunScale();
  if (command == "set-trainers") return ec::RunSetTrainers();
  if (command == "calibrate") return ec::RunCalibrate();
  if (command == "tokens") return ec::RunTokens();
  if (command == "help") {
    std::cout << gflags::ProgramUsage() << std::endl;
    return 0;
  }
  return Usage("unknown command '" + command + "'");
}
