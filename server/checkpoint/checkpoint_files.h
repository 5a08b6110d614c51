// Checkpoint files: the on-disk layout of a collection checkpoint.
//
//   ROOT/<collection>/ckpt-<created_unix_ms>-e<epoch>/
//     <n>-<table>.<shard_index>.shard   one per shard (replicas: one)
//     MANIFEST                          the commit record
//
// A shard file is "EMBSHRD1", then int64 rows, cols, state_width, step,
// applied_count, then fp32 weights [rows, cols], fp32 optimizer state
// [rows, state_width] (row-major), and the shard's exactly-once record:
// uint64 request id hashes [applied_count], then int64 Unix ms when each was
// applied [applied_count]; then, for a dynamic table's shard (the manifest
// entry's `dynamic`), int64 slot bookkeeping [rows, 4]
// (EmbeddingBackend::PackSlots), int64 (id, count) pending admission
// counts [pending_counts, 2] and, where the entry says pending_sketch,
// uint32 sketch counters [kPendingSketchCounters]; little-endian.
//
// Incremental checkpoints. A delta file ("<n>-<table>.<shard_index>.delta.
// shard", the entry's `delta`) is "EMBDELT1", then int64 rows, cols,
// state_width, step, applied_count, changed, then int64 changed row
// indices [changed] (shard-local, strictly ascending), fp32 weights
// [changed, cols] and state [changed, state_width] of those rows, then the
// rest exactly as a shard file's (exactly-once record; a dynamic shard's
// bookkeeping of every slot, pending counts and sketch). Its rows are the
// ones changed since the same shard's entry in the checkpoint named by the
// manifest's info.base, a directory beside this one; a restore reads the
// chain's full file and lays each delta's rows over it, oldest first
// (ReadShardChain). The manifest names every shard file with its
// size and CRC-32 (zlib's), the spec and the plan. A checkpoint exists only
// once MANIFEST is committed: written to MANIFEST.tmp, fsynced, renamed,
// and the directory fsynced, so a crash at any point leaves either no
// MANIFEST (the directory is ignored, and removed by the next prune) or a
// complete one. Every read checks sizes and checksums: a damaged file gets
// DATA_LOSS naming it.
//
// Thread-safe: functions with no shared state.
#ifndef EMBER_SERVER_CHECKPOINT_CHECKPOINT_FILES_H_
#define EMBER_SERVER_CHECKPOINT_CHECKPOINT_FILES_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "proto/service.pb.h"

namespace ember {
namespace checkpoint {

constexpr char kManifestName[] = "MANIFEST";
constexpr int kFormatVersion = 1;
// A manifest with delta shards (an incremental checkpoint) is committed as
// version 2, so a build that knows no chains refuses it (and cannot
// mistake it for a whole checkpoint); this build reads both.
constexpr int kIncrementalFormatVersion = 2;

// A shard's contents, fp32.
struct ShardData {
  int64_t rows = 0, cols = 0, state_width = 0, step = 0;
  std::vector<float> weights;  // [rows, cols]
  std::vector<float> state;    // [rows, state_width]
  // The update request ids (stable hashes) the shard had applied, with
  // when (Unix ms), oldest first: a shard restored with the same rows and
  // columns takes them back, so a retried update is not applied twice.
  std::vector<uint64_t> applied_ids;
  std::vector<int64_t> applied_unix_ms;
  // A dynamic table's shard: each slot's bookkeeping, int64 [rows, 4]
  // (EmbeddingBackend::PackSlots); empty for a fixed shard.
  std::vector<int64_t> slot_meta;
  // A dynamic table's shard: the admission counts of ids without a row,
  // int64 [n, 2] (id, count) (EmbeddingBackend::ExportPendingCounts).
  std::vector<int64_t> pending_counts;
  // A dynamic table's shard: its count-min sketch of the counts past the
  // exact ones (kPendingSketchCounters uint32), or empty while unused.
  std::vector<uint32_t> pending_sketch;
  // A delta: weights and state hold only these rows (shard-local,
  // ascending), [changed_rows.size(), cols] and [.., state_width]; the
  // rest of the shard is its base's.
  bool delta = false;
  std::vector<int64_t> changed_rows;
};

// Lays `delta`'s rows over `base` and takes its step, exactly-once record
// and dynamic bookkeeping. DATA_LOSS (naming `what`) when their shapes
// differ or a row lies outside the base.
absl::Status ApplyDelta(const ShardData& delta, const std::string& what, ShardData* base);

// The shard file's name for `ref`: "<n>-<table>.<shard_index>.shard" with the
// table's name made file-safe and `n` a hash of the raw name (two names that
// sanitise alike stay apart); a delta's ends ".delta.shard".
std::string ShardFileName(const ember::v1::ShardRef& ref, bool delta = false);

// Writes and fsyncs `dir`/ShardFileName(ref); returns its manifest entry
// (geometry fields other than rows/cols/state_width/step are the caller's).
absl::StatusOr<ember::v1::CheckpointShard> WriteShardFile(const std::string& dir,
                                                          const ember::v1::ShardRef& ref,
                                                          const ShardData& data);

// Reads `dir`/entry.file, checking its size, CRC-32 and header against the
// entry: DATA_LOSS naming the file on any difference, NOT_FOUND if absent.
absl::StatusOr<ShardData> ReadShardFile(const std::string& dir,
                                        const ember::v1::CheckpointShard& entry);
// The same checks, streaming (nothing kept in memory).
absl::Status VerifyShardFile(const std::string& dir, const ember::v1::CheckpointShard& entry);

// One file of a shard's chain: the checkpoint directory and its entry.
struct ChainLink {
  std::string dir;
  ember::v1::CheckpointShard entry;
};
// The files that make up `entry` of the checkpoint in `dir`, the full one
// first, then each delta: the base checkpoints are found beside `dir` by
// their manifests' info.base, and each link's entry by the shard's ref,
// with the same rows, columns, state width and lineage, and the
// generation the delta was taken against. DATA_LOSS naming the delta for
// a base missing or not matching; a chain longer than 10000 is refused.
// `root` (non-empty) confines every base directory (ConfinedPath).
absl::StatusOr<std::vector<ChainLink>> ShardChain(const std::string& dir,
                                                  const ember::v1::CheckpointShard& entry,
                                                  const std::string& root);
// The shard as `entry` holds it, its chain read and the deltas applied
// (every file checked as ReadShardFile does); *bytes_read, when given,
// gets the files' sizes added.
absl::StatusOr<ShardData> ReadShardChain(const std::string& dir,
                                         const ember::v1::CheckpointShard& entry,
                                         const std::string& root,
                                         int64_t* bytes_read = nullptr);
// The checkpoint directories a restore of `dir` reads: `dir` and its bases
// (info.base, followed; confined under `root` when non-empty), newest
// first. DATA_LOSS for a base that is missing.
absl::StatusOr<std::vector<std::string>> CheckpointChain(const std::string& dir,
                                                         const std::string& root);

// Rewrites the incremental checkpoint in `dir` as a full one: each delta
// shard's chain is read and written whole beside it, the manifest is
// committed again without deltas or base (info.base cleared, lineage and
// generation kept, so later deltas build on it), then the delta files are
// kept. A crash before the commit leaves the incremental checkpoint as
// it was (the new files are left over until the directory is removed);
// after it, a full one. The delta files stay (a reader of the old manifest
// may still want them) until RemoveUnlistedShardFiles. Returns the bytes
// written (0: nothing to compact).
absl::StatusOr<int64_t> CompactCheckpoint(const std::string& dir, const std::string& root);

// Removes the shard files ("*.shard") of a committed checkpoint that its
// manifest does not name (a compaction's old deltas), once its MANIFEST
// is older than `grace` (a reader of the manifest before may still be
// reading them); returns how many.
int RemoveUnlistedShardFiles(const std::string& dir, absl::Duration grace);

// Commits `manifest` as `dir`/MANIFEST atomically (see above), at
// kIncrementalFormatVersion when it has a delta shard, else kFormatVersion
// (its format_version field set to match).
absl::Status CommitManifest(const std::string& dir, const ember::v1::CheckpointManifest& manifest);
// NOT_FOUND if `dir` has no MANIFEST; DATA_LOSS naming it if it is damaged.
absl::StatusOr<ember::v1::CheckpointManifest> ReadManifest(const std::string& dir);

// The checks and parsing of ReadManifest on a MANIFEST's text; `path`
// names it in errors.
absl::StatusOr<ember::v1::CheckpointManifest> ParseManifest(const std::string& text,
                                                            const std::string& path);

// Rows [row0, row1) x columns [col0, col1) of a table.
struct CellBlock {
  int64_t row0 = 0, row1 = 0, col0 = 0, col1 = 0;

  static CellBlock Of(const ember::v1::CheckpointShard& s) {
    return {s.row_offset(), s.row_offset() + s.rows(), s.col_offset(), s.col_offset() + s.cols()};
  }
  // The cells both hold (empty() when none).
  CellBlock Intersection(const CellBlock& o) const {
    return {std::max(row0, o.row0), std::min(row1, o.row1), std::max(col0, o.col0),
            std::min(col1, o.col1)};
  }
  bool empty() const { return row0 >= row1 || col0 >= col1; }
};

// A manifest's shards against its spec, before anything is read: every
// table's shards lie inside it, no two overlap, and together they cover it
// (by distinct rows and columns). DATA_LOSS naming the table and the shards.
absl::Status CheckCoverage(const ember::v1::CheckpointManifest& manifest);

// Reads the manifest of `dir` and verifies every shard file it names and
// every file of their chains (not its coverage: CheckCoverage). `progress`,
// when given, is called with (bytes verified, total bytes) before the
// first file and after each.
absl::StatusOr<ember::v1::CheckpointManifest> VerifyCheckpoint(
    const std::string& dir,
    const std::function<void(int64_t done, int64_t total)>& progress = nullptr,
    const std::string& root = "");

// `requested` confined under `root`, for a path a request names: "" is root
// itself, a relative path is taken under root, an absolute one must lie
// under it. INVALID_ARGUMENT for a NUL or other control byte, a ".."
// component, or a path outside root (after following the links of the part
// that exists); FAILED_PRECONDITION when root is "" (a server without a
// checkpoint root accepts no path). Errors name only the request: they never
// tell what exists outside root.
absl::StatusOr<std::string> ConfinedPath(const std::string& root, const std::string& requested);

// A new, empty checkpoint directory under `root` (created with parents).
// INVALID_ARGUMENT for a NUL byte in root or collection; ALREADY_EXISTS after
// 1000 names taken (never an endless retry).
absl::StatusOr<std::string> MakeCheckpointDir(const std::string& root,
                                              const std::string& collection, int64_t epoch,
                                              int64_t created_unix_ms);

// `path` itself if it holds a MANIFEST; otherwise the latest committed
// checkpoint (by creation time) in `path`/* or `path`/*/*. NOT_FOUND when
// there is none; INVALID_ARGUMENT when they belong to several collections.
absl::StatusOr<std::string> ResolveCheckpoint(const std::string& path);

// Committed checkpoint directories of `collection` under `root`, oldest first.
std::vector<std::string> ListCommitted(const std::string& root, const std::string& collection);

// The size of a shard file holding rows x (cols + state_width) floats,
// `applied` exactly-once entries and, for a dynamic shard, the slots'
// bookkeeping, `pending` (id, count) pairs and, with `sketch`, the pending
// ids' sketch.
int64_t ShardFileBytes(int64_t rows, int64_t cols, int64_t state_width, int64_t applied = 0,
                       bool dynamic = false, int64_t pending = 0, bool sketch = false);
// The size of the file `entry` describes (a shard file or a delta).
int64_t EntryFileBytes(const ember::v1::CheckpointShard& entry);

// Bytes in the shard files (ShardFileName's "*.shard") of `dir`: a
// checkpoint being written, its progress (the MANIFEST written at its end
// is not a shard's).
int64_t ShardBytesInDirectory(const std::string& dir);

// Removes a checkpoint directory: MANIFEST first (so a crash half-way leaves
// an uncommitted directory, never a torn committed one), then the rest.
absl::Status RemoveCheckpoint(const std::string& dir);

// Uncommitted directories (no MANIFEST) of `collection` under `root`: what a
// crash during a write leaves behind.
std::vector<std::string> ListUncommitted(const std::string& root, const std::string& collection);

}  // namespace checkpoint
}  // namespace ember

#endif  // EMBER_SERVER_CHECKPOINT_CHECKPOINT_FILES_H_
