#include "server/checkpoint/recut.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace ember {
namespace checkpoint {

using backend::OptimizerType;

RecutTarget::RecutTarget(OptimizerType type, int64_t row_offset, int64_t col_offset, int64_t rows,
                         int64_t cols)
    : type(type),
      row_offset(row_offset),
      col_offset(col_offset),
      rows(rows),
      cols(cols),
      state_width(backend::OptimizerStateWidth(type, cols)),
      weights(rows * cols, 0.0f),
      state(rows * state_width, 0.0f),
      rowwise_sum(type == OptimizerType::kRowwiseAdagrad ? rows : 0, 0.0) {}

bool Overlaps(const ember::v1::CheckpointShard& s, const RecutTarget& t) {
  return !CellBlock::Of(s).Intersection(t.block()).empty();
}

absl::Status CopyOverlap(const ember::v1::CheckpointShard& s, const ShardData& d, RecutTarget* t) {
  const int64_t scols = s.cols();
  if (d.rows != s.rows() || d.cols != scols ||
      d.state_width != backend::OptimizerStateWidth(t->type, scols)) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint shard ", s.file(), " has ", d.rows, " x ", d.cols, " with state width ",
        d.state_width, ", which does not fit its table's optimizer"));
  }
  const CellBlock cells = CellBlock::Of(s).Intersection(t->block());
  if (cells.empty()) return absl::OkStatus();
  for (const auto& [filled, file] : t->filled) {
    const CellBlock both = cells.Intersection(filled);
    if (!both.empty()) {
      return absl::DataLossError(absl::StrCat("checkpoint shards ", file, " and ", s.file(),
                                              " both hold rows [", both.row0, ", ", both.row1,
                                              ") columns [", both.col0, ", ", both.col1, ")"));
    }
  }
  t->filled.emplace_back(cells, s.file());
  const int64_t r0 = cells.row0, r1 = cells.row1, c0 = cells.col0, c1 = cells.col1;
  const int64_t n = c1 - c0, tc = c0 - t->col_offset, sc = c0 - s.col_offset();
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t tr = r - t->row_offset, sr = r - s.row_offset();
    std::copy_n(&d.weights[sr * scols + sc], n, &t->weights[tr * t->cols + tc]);
    switch (t->type) {
      case OptimizerType::kSgd:
        break;
      case OptimizerType::kAdagrad:
        std::copy_n(&d.state[sr * scols + sc], n, &t->state[tr * t->cols + tc]);
        break;
      case OptimizerType::kAdam:  // [m (cols), v (cols)] per row
        std::copy_n(&d.state[sr * 2 * scols + sc], n, &t->state[tr * 2 * t->cols + tc]);
        std::copy_n(&d.state[sr * 2 * scols + scols + sc], n,
                    &t->state[tr * 2 * t->cols + t->cols + tc]);
        break;
      case OptimizerType::kRowwiseAdagrad:  // weighted by the shared columns
        t->rowwise_sum[tr] += static_cast<double>(d.state[sr]) * static_cast<double>(n);
        break;
    }
  }
  t->covered += (r1 - r0) * n;
  t->step = std::max(t->step, d.step);
  return absl::OkStatus();
}

absl::Status FinishTarget(const std::string& table, RecutTarget* t) {
  if (t->covered != t->rows * t->cols) {
    return absl::DataLossError(absl::StrCat(
        "the checkpoint covers ", t->covered, " of the ", t->rows * t->cols, " cells of table '",
        table, "' rows [", t->row_offset, ", ", t->row_offset + t->rows, ") columns [",
        t->col_offset, ", ", t->col_offset + t->cols, ")"));
  }
  if (t->type == OptimizerType::kRowwiseAdagrad) {
    for (int64_t r = 0; r < t->rows; ++r) {
      t->state[r] = static_cast<float>(t->rowwise_sum[r] / static_cast<double>(t->cols));
    }
  }
  return absl::OkStatus();
}

}  // namespace checkpoint
}  // namespace ember
