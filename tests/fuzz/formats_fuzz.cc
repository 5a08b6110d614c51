// libFuzzer target: the text formats Ember reads: checkpoint MANIFESTs (and
// their coverage, against a cell-by-cell count), KJT and KeyedTensor JSON
// (emberctl lookup/apply-gradients), collection specs in JSON (emberctl
// create/plan) with the planner's spec validation, the KJT layout check,
// token files (whose accepted tables must hold what auth.h promises) and
// checkpoint paths (an accepted one must lie under its root).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "cli/json_io.h"
#include "cli/spec_io.h"
#include "client/kjt.h"
#include "planner/spec_validation.h"
#include "server/checkpoint/checkpoint_files.h"
#include "server/common/auth.h"

namespace {

void Require(bool ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "invariant broken: %s\n", what);
    std::abort();
  }
}

// CheckCoverage's verdict against a count of every cell, for tables small
// enough to count.
void CheckCoverageAgainstCells(const ember::v1::CheckpointManifest& m) {
  const bool ok = ember::checkpoint::CheckCoverage(m).ok();
  bool cells_ok = true;
  for (const auto& t : m.spec().tables()) {
    const int64_t rows = t.num_embeddings(), cols = t.embedding_dim();
    if (rows < 0 || cols < 0 || rows > 64 || cols > 64) return;  // too large to count
    std::vector<int> count(rows * cols, 0);
    for (const auto& s : m.shards()) {
      if (s.ref().table() != t.name()) continue;
      if (s.row_offset() < 0 || s.col_offset() < 0 || s.rows() < 0 || s.cols() < 0 ||
          s.row_offset() > rows || s.rows() > rows - s.row_offset() || s.col_offset() > cols ||
          s.cols() > cols - s.col_offset()) {
        cells_ok = false;
        continue;
      }
      for (int64_t r = s.row_offset(); r < s.row_offset() + s.rows(); ++r) {
        for (int64_t c = s.col_offset(); c < s.col_offset() + s.cols(); ++c) ++count[r * cols + c];
      }
    }
    for (int n : count) cells_ok = cells_ok && n == 1;
  }
  std::map<std::string, int> names;
  for (const auto& t : m.spec().tables()) ++names[t.name()];
  for (const auto& [name, n] : names) {
    if (n > 1) return;  // two tables of one name: the shards' owner is ambiguous
  }
  Require(ok == cells_ok, "CheckCoverage disagrees with the cell count");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 7) {
    case 0: {
      auto m = ember::checkpoint::ParseManifest(text, "MANIFEST");
      if (m.ok()) CheckCoverageAgainstCells(*m);
      break;
    }
    case 4: {
      auto t = ember::TokenTable::Parse(text, "tokens");
      if (!t.ok()) break;
      Require(t->enabled() && t->TokenOf(ember::Role::kAdmin).size() >= 16, "admin token");
      for (const std::string& name : t->worker_names()) {
        ember::TokenTable self = *t;
        Require(self.SetSelf(name).ok() && self.SelfToken().size() >= 16, "a worker's line");
        Require(self.SelfToken() != t->TokenOf(ember::Role::kAdmin), "a worker holds admin");
        Require(t->CoordinatorTokenFor(name).size() == 64, "the coordinator credential");
      }
      break;
    }
    case 5: {
      // An accepted path lies under the root, with no ".." and no control
      // byte in it.
      static const std::string root = "/tmp/ember-fuzz-confined";
      auto p = ember::checkpoint::ConfinedPath(root, text);
      if (!p.ok()) break;
      Require(*p == root || p->rfind(root + "/", 0) == 0, "a path outside the root");
      Require(p->find("/../") == std::string::npos && p->find('\0') == std::string::npos,
              "a '..' or NUL in an accepted path");
      break;
    }
    case 6: {
      ember::v1::CollectionSpec spec;
      ember::v1::Topology topology;
      const size_t half = text.size() / 2;
      if (spec.ParseFromString(text.substr(0, half)) &&
          topology.ParseFromString(text.substr(half))) {
        const bool ok = ember::planner::ValidatePlanInputs(spec, topology).ok();
        if (ok) {
          Require(spec.tables_size() <= ember::planner::kMaxTables &&
                      topology.world_size() <= ember::planner::kMaxWorldSize &&
                      int64_t{spec.tables_size()} * topology.world_size() <=
                          ember::planner::kMaxTableRanks,
                  "a plan past the limits accepted");
        }
      }
      break;
    }
    case 1: {
      auto kjt = ember::cli::ParseKjtJson(text);
      if (kjt.ok()) {
        (void)kjt->Validate();
        (void)kjt->key_offsets();
      }
      break;
    }
    case 2: {
      auto kt = ember::cli::ParseKeyedTensorJson(text);
      if (kt.ok()) (void)ember::client::CheckGradientLayout(*kt, kt->keys, kt->length_per_key,
                                                            kt->batch_size);
      break;
    }
    default: {
      auto spec = ember::cli::ParseCollectionSpecJson(text);
      if (spec.ok()) (void)ember::planner::ValidateCollectionSpec(*spec);
    }
  }
  return 0;
}
