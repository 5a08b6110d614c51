// The key_value kernel over any backend (TorchRec's
// EmbeddingComputeKernel.KEY_VALUE): a fixed shard whose rows all live in a
// file on local SSD (row_file.h), with ShardSpec::cache_rows of them held
// in memory as a shard of the wrapped backend, whose own gather, update
// and optimizer kernels then run on them.
//
// Layout. The file is a log of row versions: rows + KeyValueSlackRows
// records (row_file.h), each a row's dim fp32 weights, then its fp32
// optimizer state (OptimizerStateWidth). A row's latest version lies in the
// record its `loc` names; a new version goes to a record that is not live
// (no row's latest), ahead of a cursor that goes round the file, so the
// writes of a call are ascending and mostly side by side, and no live
// record is ever overwritten. A row never written is its initial value
// (InitialValues of its global row) and fresh state, made when it is first
// read; so a new shard costs no writes.
//
// The cache: fully associative, CLOCK replacement (a used bit a slot, a
// hand that clears it; an approximation of LRU). Each Lookup or
// ApplyGradients call first maps its ids to cache slots:
//   1. every distinct row of the call is pinned for the call (a call
//      naming more distinct rows of a shard than its cache holds runs in
//      pieces that each fit: a lookup by bags, an update by rows, with
//      every occurrence of a row in one piece, as one optimizer step, and
//      atomically: a refused piece puts back the earlier pieces' rows; a
//      single bag past the cache is RESOURCE_EXHAUSTED, nothing done);
//   2. rows not cached take victims; victims changed since they were
//      filled are written to the file as the missing rows are read from
//      it, in one batch (a write that fails answers its status,
//      RESOURCE_EXHAUSTED for a full disk, and leaves every row where it
//      was: nothing is lost, cached rows still serve);
//   3. the rows read (or made, never written) go into the victims' slots
//      with ImportRowsAt, with their optimizer state;
//   4. the wrapped backend runs the call on the slots; an update marks its
//      slots changed.
// Numerics are the wrapped backend's on the same values: results equal the
// shard held whole in memory bit for bit (fp32 weights, and fp16/bf16
// rounded to nearest; stochastic rounding of fp16/bf16 updates draws its
// bits by the global row, which a cache slot does not have, so such a
// spec is refused).
//
// ExportRows / ImportRows (and the *At forms, rows anywhere, in one batch)
// read and write through: cached rows from or to the cache (an import
// marks them changed), the rest from or to the file; except that an
// ImportRowsAt whose rows all fit the cache puts the uncached ones in it
// (victims written back as for a miss, nothing read), where the next call
// finds them (a dynamic shard's admissions, then their update). A range
// ImportRows (a restore, a move, a whole table) leaves the cache to the
// rows in use: its uncached rows always go to the file. A checkpoint or
// a move reads a shard a range at a time and never needs it whole in
// memory. An import whose write fails part way has imported some of its
// rows and not others, each whole (a row's version is only taken once it
// has landed); the caller imports again.
//
// fused_uvm_caching (a spec with cache_rows that is host_mapped; only over
// a backend that MapsHostMemory, the CUDA backend): the same cache, in the
// wrapped backend's device memory, over a fused_uvm shard of it instead of
// a file: every row in pinned host memory mapped into the GPU, each in its
// own record (written back in place, no log: memory has no torn writes),
// holding its initial value from the start. No SSD directory is needed;
// the rows count against the backend's mapped memory.
//
// Dynamic shards: the dynamic wrapper above this one (dynamic/) keeps
// their ids and hands this one a fixed shard of slots, which it tiers as
// any other; a spec still marked dynamic here is refused.
//
// Thread-safe: calls that name a key_value shard are serialised by one
// lock (the CPU backend serialises its calls anyway); calls on other
// shards pass straight through.
#ifndef EMBER_SERVER_BACKEND_KEY_VALUE_KEY_VALUE_BACKEND_H_
#define EMBER_SERVER_BACKEND_KEY_VALUE_KEY_VALUE_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {

struct KeyValueOptions {
  // Where shard files go (--ssd_dir). Empty: key_value shards are refused.
  std::string dir;
  // Bytes of files the shards may take together (KeyValueFileBytes); 0: as
  // much as the disk has.
  int64_t capacity_bytes = 0;
};

std::unique_ptr<EmbeddingBackend> WithKeyValueShards(std::unique_ptr<EmbeddingBackend> inner,
                                                     const KeyValueOptions& options);

// INVALID_ARGUMENT naming the field for a key_value spec's bad values
// (cache_rows outside [1, rows], a dynamic spec, stochastic rounding of
// fp16/bf16 weights).
absl::Status ValidateKeyValueSpec(const ShardSpec& spec);

}  // namespace backend
}  // namespace ember

#endif  // EMBER_SERVER_BACKEND_KEY_VALUE_KEY_VALUE_BACKEND_H_
