// Calls larger than a backend's fixed scratch, run as a sequence of smaller
// ones. The CUDA backend reserves its scratch (device) and staging (pinned
// host) memory once, when it starts, and the worker advertises its capacity
// without them; a call whose arrays do not fit is cut here, in CUDA-free
// code that the emulated backend runs in every build.
#ifndef EMBER_SERVER_BACKEND_CUDA_CALL_SPLIT_H_
#define EMBER_SERVER_BACKEND_CUDA_CALL_SPLIT_H_

#include <cstddef>
#include <functional>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "server/backend/cuda/request_plan.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

// A backend's fixed scratch and staging bytes, and the temporary storage its
// scans and sort need for a call of a given size.
struct Scratch {
  size_t device_bytes = 0;
  size_t host_bytes = 0;
  std::function<size_t(const CallSize&)> lookup_temp;
  std::function<size_t(const CallSize&)> gradient_temp;

  bool FitsLookup(const CallSize& size) const;
  bool FitsGradients(const CallSize& size) const;
};

using LookupRun = std::function<absl::Status(absl::Span<const backend::LookupRequest>)>;
// Called once when a call is to be cut, before any piece runs: a backend
// that checks values while staging checks the whole call there, so that
// nothing is applied before a bad value in a later piece is seen, and
// errors name the caller's requests. Null: nothing to check.
using CheckWhole = std::function<absl::Status()>;
using GradientRun = std::function<absl::Status(absl::Span<const backend::GradientRequest>)>;

// Runs a validated Lookup call (`plan`: its PlanLookup) through `run`: the
// call itself when it fits `scratch`, else pieces that each fit, in request
// order, cut between the bags of pooled requests and between the ids of
// NONE ones (each piece's requests are views of the caller's ids and
// outputs). RESOURCE_EXHAUSTED, before anything runs, when a single pooled
// bag does not fit.
absl::Status ForEachLookupPiece(absl::Span<const backend::LookupRequest> requests,
                                const LookupPlan& plan, const ShardResolver& shards,
                                const Scratch& scratch, const LookupRun& run,
                                const CheckWhole& check_whole = nullptr);

// Runs a validated ApplyGradients call (`plan`: its PlanGradients) through
// `run`: the call itself when it fits `scratch`, else pieces over disjoint
// ranges of (shard, row), so that each row's occurrences all fall in one
// piece, in the call's order, and its update is the one the whole call
// gives it. In a piece every id is a bag of its own (SUM, weighted by the
// factor the call gives it: its weight, times 1/length for MEAN) with a copy
// of its gradient row. `run` must not advance Adam's step; the caller does,
// once for the whole call. RESOURCE_EXHAUSTED, before anything runs, when
// one row's occurrences alone do not fit.
absl::Status ForEachGradientPiece(absl::Span<const backend::GradientRequest> requests,
                                  const GradientPlan& plan, const ShardResolver& shards,
                                  const Scratch& scratch, const GradientRun& run,
                                  const CheckWhole& check_whole = nullptr);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_CUDA_CALL_SPLIT_H_
