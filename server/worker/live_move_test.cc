// A live move's worker calls, in process: shards staged for a later epoch
// beside a collection that serves on, rows copied by change mark and
// caught up by changed rows while updates go on, the switch that adopts
// the stage, and every misuse refused with nothing changed. The reference
// is the source shard itself (the copy must equal it bit for bit) and the
// set of rows the test's updates named.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/backend/backend_factory.h"
#include "server/backend/table_spec.h"
#include "server/common/wire.h"
#include "server/worker/applied_ids.h"
#include "server/worker/worker_service.h"

namespace ember {
namespace worker {
namespace {

using ember::v1::TableConfig;

constexpr int64_t kDim = 4;

ember::v1::ShardAssignment Assignment(const std::string& table, int64_t rows,
                                      bool dynamic = false) {
  ember::v1::ShardAssignment a;
  a.mutable_ref()->set_table(table);
  TableConfig* t = a.mutable_table();
  t->set_name(table);
  t->set_num_embeddings(dynamic ? 0 : rows);
  t->set_embedding_dim(kDim);
  t->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::ADAGRAD);
  t->mutable_optimizer()->set_learning_rate(0.5);
  t->mutable_initializer()->set_type(ember::v1::InitializerSpec::UNIFORM);
  t->mutable_initializer()->set_seed(7);
  if (dynamic) t->mutable_dynamic()->set_capacity(rows);
  a.set_rows(rows);
  a.set_cols(kDim);
  return a;
}

// A worker over the CPU backend as the worker binary builds it (change
// tracking, dynamic shards), holding collection "c" at epoch 1 with `shards`.
std::unique_ptr<WorkerService> Worker(const std::vector<ember::v1::ShardAssignment>& shards) {
  backend::BackendConfig config;
  config.memory_limit_bytes = 8 << 20;
  auto made = backend::CreateBackend(config);
  EXPECT_TRUE(made.ok()) << made.status();
  auto s = std::make_unique<WorkerService>(std::move(made->backend), WorkerServiceOptions());
  ember::v1::CreateShardsRequest req;
  req.set_collection("c");
  req.set_epoch(1);
  for (const auto& a : shards) *req.add_shards() = a;
  ember::v1::CreateShardsResponse resp;
  EXPECT_TRUE(s->CreateShards(nullptr, &req, &resp).ok());
  return s;
}

grpc::Status Stage(WorkerService* s, int64_t epoch,
                   const std::vector<ember::v1::ShardAssignment>& shards,
                   const std::string& collection = "c") {
  ember::v1::CreateShardsRequest req;
  req.set_collection(collection);
  req.set_epoch(epoch);
  req.set_staged(true);
  for (const auto& a : shards) *req.add_shards() = a;
  ember::v1::CreateShardsResponse resp;
  return s->CreateShards(nullptr, &req, &resp);
}

grpc::Status Switch(WorkerService* s, int64_t epoch,
                    const std::vector<ember::v1::ShardAssignment>& shards) {
  ember::v1::UpdateShardsRequest req;
  req.set_collection("c");
  req.set_epoch(epoch);
  req.set_require_staged(true);
  for (const auto& a : shards) *req.add_create() = a;
  ember::v1::UpdateShardsResponse resp;
  return s->UpdateShards(nullptr, &req, &resp);
}

// Weights and optimizer state of rows [0, rows) of `table`.
std::vector<float> Rows(WorkerService* s, const std::string& table, int64_t rows) {
  ember::v1::ExportRowsRequest req;
  req.set_collection("c");
  req.mutable_shard()->set_table(table);
  req.set_row_end(rows);
  ember::v1::ExportRowsResponse resp;
  const grpc::Status st = s->ExportRows(nullptr, &req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  std::vector<float> w, state;
  EXPECT_TRUE(wire::Decode(resp.weights(), "weights", &w).ok());
  EXPECT_TRUE(wire::Decode(resp.state(), "state", &state).ok());
  w.insert(w.end(), state.begin(), state.end());
  return w;
}

// One id per bag of table `table` at `epoch`, with random gradients.
grpc::Status Update(WorkerService* s, int64_t epoch, const std::string& table,
                    const std::vector<int64_t>& ids, std::mt19937* rng) {
  static int requests = 0;
  ember::v1::WorkerApplyGradientsRequest r;
  r.set_collection("c");
  r.set_epoch(epoch);
  r.set_request_id(std::to_string(++requests));
  auto* g = r.add_gradients();
  g->mutable_feature()->mutable_shard()->set_table(table);
  g->mutable_feature()->set_pooling(TableConfig::SUM);
  g->mutable_feature()->set_lengths(
      wire::Encode<int64_t>(std::vector<int64_t>(ids.size(), 1)));
  g->mutable_feature()->set_ids(wire::Encode<int64_t>(ids));
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> grad(ids.size() * kDim);
  for (float& x : grad) x = u(*rng);
  g->set_grad(wire::Encode<float>(grad));
  ember::v1::WorkerApplyGradientsResponse resp;
  return s->ApplyGradients(nullptr, &r, &resp);
}

// Copies rows [b, e) of `table` from `from` (changed since `since`, or all
// with a new mark into *mark) into the shard at `epoch` on `to`. Returns
// the rows copied.
int64_t Copy(WorkerService* from, WorkerService* to, int64_t epoch, const std::string& table,
             int64_t b, int64_t e, const ember::v1::ChangeMark* since,
             ember::v1::ChangeMark* mark) {
  ember::v1::ExportRowsRequest ex;
  ex.set_collection("c");
  ex.mutable_shard()->set_table(table);
  ex.set_row_begin(b);
  ex.set_row_end(e);
  if (since != nullptr) *ex.mutable_changed_since() = *since;
  if (mark != nullptr) ex.set_mark(true);
  ember::v1::ExportRowsResponse got;
  const grpc::Status xs = from->ExportRows(nullptr, &ex, &got);
  EXPECT_TRUE(xs.ok()) << xs.error_message();
  if (mark != nullptr) *mark = got.mark();
  if (since != nullptr && got.rows().empty()) return 0;  // nothing changed here
  ember::v1::ImportRowsRequest im;
  im.set_collection("c");
  im.set_epoch(epoch);
  im.mutable_shard()->set_table(table);
  im.set_row_begin(b);
  im.set_row_end(e);
  im.set_weights(got.weights());
  im.set_state(got.state());
  im.set_rows(got.rows());
  im.set_step(got.step());
  ember::v1::ImportRowsResponse done;
  const grpc::Status is = to->ImportRows(nullptr, &im, &done);
  EXPECT_TRUE(is.ok()) << is.error_message();
  return since == nullptr ? e - b : static_cast<int64_t>(got.rows().size() / 8);
}

// A shard copied while updates go on: after the bulk copy and a catch-up
// of exactly the rows the updates named, the staged copy equals the
// source bit for bit, and the switch puts it into service with its rows.
TEST(LiveMoveTest, ACopyCaughtUpByChangedRowsEqualsTheSource) {
  constexpr int64_t kRows = 600;
  auto src = Worker({Assignment("t", kRows)});
  auto dst = Worker({Assignment("held", 8)});
  ASSERT_TRUE(Stage(dst.get(), 2, {Assignment("t", kRows)}).ok());
  std::mt19937 rng(3);
  std::uniform_int_distribution<int64_t> id(0, kRows - 1);
  auto updates = [&](int n, std::set<int64_t>* named) {
    for (int k = 0; k < n; ++k) {
      std::vector<int64_t> ids = {id(rng), id(rng), id(rng)};
      const grpc::Status st = Update(src.get(), 1, "t", ids, &rng);
      ASSERT_TRUE(st.ok()) << st.error_message();
      named->insert(ids.begin(), ids.end());
    }
  };
  // The bulk copy in three chunks, updates landing between them.
  ember::v1::ChangeMark mark, first;
  std::set<int64_t> named;
  for (int64_t b = 0; b < kRows; b += 200) {
    Copy(src.get(), dst.get(), 2, "t", b, b + 200, nullptr, b == 0 ? &first : nullptr);
    updates(5, &named);
  }
  // A catch-up: the rows changed since the first mark are those named.
  int64_t caught = 0;
  for (int64_t b = 0; b < kRows; b += 256) {
    caught += Copy(src.get(), dst.get(), 2, "t", b, std::min(kRows, b + 256), &first,
                   b == 0 ? &mark : nullptr);
  }
  EXPECT_EQ(caught, static_cast<int64_t>(named.size()));
  // More updates, and the last catch-up after them.
  named.clear();
  updates(4, &named);
  EXPECT_EQ(Copy(src.get(), dst.get(), 2, "t", 0, kRows, &mark, nullptr),
            static_cast<int64_t>(named.size()));
  // The held collection served at epoch 1 all along; the staged shard is
  // not in its reach.
  std::mt19937 other(5);
  EXPECT_TRUE(Update(dst.get(), 1, "held", {1}, &other).ok());
  EXPECT_EQ(Update(dst.get(), 1, "t", {1}, &other).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(Switch(dst.get(), 2, {Assignment("held", 8), Assignment("t", kRows)}).ok());
  EXPECT_EQ(Rows(dst.get(), "t", kRows), Rows(src.get(), "t", kRows));
  // It serves at epoch 2 and trains on alike.
  std::mt19937 r1(11), r2(11);
  ASSERT_TRUE(Update(dst.get(), 2, "t", {4, 5}, &r1).ok());
  ASSERT_TRUE(Update(src.get(), 1, "t", {4, 5}, &r2).ok());
  EXPECT_EQ(Rows(dst.get(), "t", kRows), Rows(src.get(), "t", kRows));
}

// A staged shard of a held ref (a re-cut shard) replaces it at the switch;
// shards staged but not named are dropped, and their memory comes back.
TEST(LiveMoveTest, TheSwitchAdoptsTheStageAndDropsTheRest) {
  auto w = Worker({Assignment("t", 8)});
  ember::v1::ShardStatusRequest sq;
  ember::v1::ShardStatusResponse before, staged, after;
  ASSERT_TRUE(w->ShardStatus(nullptr, &sq, &before).ok());
  ASSERT_TRUE(Stage(w.get(), 3, {Assignment("t", 16), Assignment("u", 100)}).ok());
  ASSERT_TRUE(Stage(w.get(), 3, {Assignment("t", 16), Assignment("u", 100)}).ok());  // a retry
  ASSERT_TRUE(w->ShardStatus(nullptr, &sq, &staged).ok());
  EXPECT_LT(staged.available_bytes(), before.available_bytes());
  EXPECT_EQ(staged.shards_size(), 1);  // a stage is not held yet
  ASSERT_TRUE(Switch(w.get(), 3, {Assignment("t", 16)}).ok());
  ASSERT_TRUE(w->ShardStatus(nullptr, &sq, &after).ok());
  ASSERT_EQ(after.shards_size(), 1);
  EXPECT_EQ(after.shards(0).rows(), 16);
  EXPECT_EQ(after.shards(0).epoch(), 3);
  // The 8-row shard and the unnamed "u" are gone: 8 more rows than before.
  EXPECT_EQ(before.available_bytes() - after.available_bytes(),
            backend::ShardBytes(ShardSpecFromTable(Assignment("t", 16).table(), 0, 0, 16, kDim)) -
                backend::ShardBytes(ShardSpecFromTable(Assignment("t", 8).table(), 0, 0, 8, kDim)));
}

// A shard filled from two sources keeps each one's record for its rows: an
// update the first source applied and the second did not, sent again,
// applies to the second's rows alone; sent once more, to none.
TEST(LiveMoveTest, ARetryAfterAMergeAppliesOnlyToTheRowsThatLackedIt) {
  auto merged = Worker({Assignment("t", 6)});
  auto plain = Worker({Assignment("t", 6)});  // the same rows (same seed)
  auto record = [&](int64_t begin, int64_t end, const std::string& request_id) {
    ember::v1::ImportRowsRequest im;
    im.set_collection("c");
    im.set_epoch(1);
    im.mutable_shard()->set_table("t");
    im.set_row_begin(begin);
    im.set_row_end(end);
    im.set_applied_for_rows(true);
    im.set_step(-1);
    im.add_applied_ids(RequestIdHash(request_id));
    im.add_applied_unix_ms(absl::ToUnixMillis(absl::Now()));
    ember::v1::ImportRowsResponse done;
    return merged->ImportRows(nullptr, &im, &done);
  };
  ASSERT_TRUE(record(0, 3, "half").ok());  // the first source's rows had it
  ASSERT_TRUE(record(3, 6, "other").ok());
  // Bags {1, 4} and {5}: rows 1 (first source) and 4, 5 (second).
  auto update = [](const std::vector<int64_t>& lengths, const std::vector<int64_t>& ids,
                   const std::vector<float>& grad, const std::string& id) {
    ember::v1::WorkerApplyGradientsRequest r;
    r.set_collection("c");
    r.set_epoch(1);
    r.set_request_id(id);
    auto* g = r.add_gradients();
    g->mutable_feature()->mutable_shard()->set_table("t");
    g->mutable_feature()->set_pooling(TableConfig::SUM);
    g->mutable_feature()->set_lengths(wire::Encode<int64_t>(lengths));
    g->mutable_feature()->set_ids(wire::Encode<int64_t>(ids));
    g->set_grad(wire::Encode<float>(grad));
    return r;
  };
  const std::vector<float> grad = {1, 2, 3, 4, -1, -2, -3, -4};
  auto retried = update({2, 1}, {1, 4, 5}, grad, "half");
  ember::v1::WorkerApplyGradientsResponse resp;
  ASSERT_TRUE(merged->ApplyGradients(nullptr, &retried, &resp).ok());
  EXPECT_FALSE(resp.duplicate());
  auto owed = update({1, 1}, {4, 5}, grad, "half");  // what the second source's rows lacked
  ASSERT_TRUE(plain->ApplyGradients(nullptr, &owed, &resp).ok());
  EXPECT_EQ(Rows(merged.get(), "t", 6), Rows(plain.get(), "t", 6));
  // Once more: applied everywhere now.
  ASSERT_TRUE(merged->ApplyGradients(nullptr, &retried, &resp).ok());
  EXPECT_TRUE(resp.duplicate());
  EXPECT_EQ(Rows(merged.get(), "t", 6), Rows(plain.get(), "t", 6));
  // MEAN: the retried bag {1, 4} owes row 4 half its gradient (the bag's
  // whole length is 2), not all of it (the one id left).
  auto mean = update({2, 1}, {1, 4, 5}, grad, "half-mean");
  mean.mutable_gradients(0)->mutable_feature()->set_pooling(TableConfig::MEAN);
  ASSERT_TRUE(record(0, 3, "half-mean").ok());
  ASSERT_TRUE(merged->ApplyGradients(nullptr, &mean, &resp).ok());
  auto owed_mean = update({1, 1}, {4, 5}, grad, "half-mean");
  owed_mean.mutable_gradients(0)->mutable_feature()->set_weights(
      wire::Encode<float>(std::vector<float>{0.5f, 1.0f}));
  ASSERT_TRUE(plain->ApplyGradients(nullptr, &owed_mean, &resp).ok());
  EXPECT_EQ(Rows(merged.get(), "t", 6), Rows(plain.get(), "t", 6));
  // A record for rows outside the shard, or with values, is refused.
  EXPECT_EQ(record(4, 9, "x").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(record(2, 2, "x").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

// A block that stays on its worker is copied there (copy_from): all of it,
// then what changed since a mark; the staged shard equals the source's rows.
TEST(LiveMoveTest, ABlockThatStaysIsCopiedWithinTheWorker) {
  auto w = Worker({Assignment("t", 8), Assignment("u", 8)});
  ember::v1::ShardAssignment second = Assignment("t", 8);  // rows [0, 4) of t as shard 1
  second.mutable_ref()->set_shard_index(1);
  second.set_rows(4);
  ASSERT_TRUE(Stage(w.get(), 2, {second}).ok());
  ember::v1::ExportRowsRequest mark;
  mark.set_collection("c");
  mark.mutable_shard()->set_table("t");
  mark.set_mark(true);
  ember::v1::ExportRowsResponse marked;
  ASSERT_TRUE(w->ExportRows(nullptr, &mark, &marked).ok());
  auto copy = [&](const ember::v1::ChangeMark* since, int64_t* copied) {
    ember::v1::ImportRowsRequest im;
    im.set_collection("c");
    im.set_epoch(2);
    im.mutable_shard()->set_table("t");
    im.mutable_shard()->set_shard_index(1);
    im.set_row_begin(0);
    im.set_row_end(4);
    im.mutable_copy_from()->set_table("t");
    im.set_copy_from_row(2);  // t's rows 2..5 become shard 1's 0..3
    if (since != nullptr) *im.mutable_copy_changed_since() = *since;
    im.set_step(-1);
    ember::v1::ImportRowsResponse done;
    const grpc::Status s = w->ImportRows(nullptr, &im, &done);
    *copied = done.rows_copied();
    return s;
  };
  int64_t copied = 0;
  ASSERT_TRUE(copy(nullptr, &copied).ok());
  EXPECT_EQ(copied, 4);
  std::mt19937 rng(2);
  ASSERT_TRUE(Update(w.get(), 1, "t", {3, 7}, &rng).ok());  // row 3 is in the block, 7 not
  ASSERT_TRUE(copy(&marked.mark(), &copied).ok());
  EXPECT_EQ(copied, 1);
  const std::vector<float> t = Rows(w.get(), "t", 8);
  ASSERT_TRUE(Switch(w.get(), 2, {second, Assignment("u", 8)}).ok());
  ember::v1::ExportRowsRequest ex;
  ex.set_collection("c");
  ex.mutable_shard()->set_table("t");
  ex.mutable_shard()->set_shard_index(1);
  ex.set_row_end(4);
  ember::v1::ExportRowsResponse got;
  ASSERT_TRUE(w->ExportRows(nullptr, &ex, &got).ok());
  std::vector<float> weights, state;
  ASSERT_TRUE(wire::Decode(got.weights(), "weights", &weights).ok());
  ASSERT_TRUE(wire::Decode(got.state(), "state", &state).ok());
  // Rows() lists 8 rows of weights, then 8 of state.
  const std::vector<float> want_w(t.begin() + 2 * kDim, t.begin() + 6 * kDim);
  const size_t width = state.size() / 4;
  const std::vector<float> want_s(t.begin() + 8 * kDim + 2 * width,
                                  t.begin() + 8 * kDim + 6 * width);
  EXPECT_EQ(weights, want_w);
  EXPECT_EQ(state, want_s);
}

TEST(LiveMoveTest, CopyWithinRefusesMismatches) {
  auto w = Worker({Assignment("t", 8), Assignment("u", 8)});
  ember::v1::ShardAssignment staged = Assignment("t", 8);
  staged.mutable_ref()->set_shard_index(1);
  ASSERT_TRUE(Stage(w.get(), 2, {staged}).ok());
  auto copy = [&](const std::string& from, int64_t from_row, int64_t end, bool with_weights) {
    ember::v1::ImportRowsRequest im;
    im.set_collection("c");
    im.set_epoch(2);
    im.mutable_shard()->set_table("t");
    im.mutable_shard()->set_shard_index(1);
    im.set_row_end(end);
    im.mutable_copy_from()->set_table(from);
    im.set_copy_from_row(from_row);
    if (with_weights) im.set_weights(wire::Encode<float>(std::vector<float>(kDim, 1.0f)));
    ember::v1::ImportRowsResponse done;
    return w->ImportRows(nullptr, &im, &done).error_code();
  };
  EXPECT_EQ(copy("u", 0, 4, false), grpc::StatusCode::INVALID_ARGUMENT);  // another table
  EXPECT_EQ(copy("t", 6, 4, false), grpc::StatusCode::INVALID_ARGUMENT);  // past its rows
  EXPECT_EQ(copy("t", 0, 9, false), grpc::StatusCode::INVALID_ARGUMENT);  // past the target's
  EXPECT_EQ(copy("t", 0, 1, true), grpc::StatusCode::INVALID_ARGUMENT);   // values too
  EXPECT_EQ(copy("nope", 0, 1, false), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(copy("t", 0, 8, false), grpc::StatusCode::OK);
}

// Misuse is refused precisely and changes nothing.
TEST(LiveMoveTest, MisuseIsRefusedAndChangesNothing) {
  auto w = Worker({Assignment("t", 8), Assignment("d", 16, /*dynamic=*/true)});
  ember::v1::ShardStatusRequest sq;
  ember::v1::ShardStatusResponse st;
  ASSERT_TRUE(w->ShardStatus(nullptr, &sq, &(st = {})).ok());
  const int64_t free_bytes = st.available_bytes();
  // Staging at the held epoch or an older one, or for a collection not held.
  EXPECT_EQ(Stage(w.get(), 1, {Assignment("u", 4)}).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(Stage(w.get(), 2, {Assignment("u", 4)}, "other").error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  // A switch naming a shard neither held nor staged.
  EXPECT_EQ(Switch(w.get(), 2, {Assignment("t", 8), Assignment("u", 4)}).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(w->ShardStatus(nullptr, &sq, &(st = {})).ok());
  EXPECT_EQ(st.available_bytes(), free_bytes);
  EXPECT_EQ(st.shards(0).epoch(), 1);

  // Rows that do not ascend, or lie outside the range, are refused whole.
  ASSERT_TRUE(Stage(w.get(), 2, {Assignment("u", 4)}).ok());
  {
    ember::v1::ExportRowsRequest ex;  // a stage is out of reach until the switch
    ex.set_collection("c");
    ex.mutable_shard()->set_table("u");
    ex.set_row_end(4);
    ember::v1::ExportRowsResponse got;
    EXPECT_EQ(w->ExportRows(nullptr, &ex, &got).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  for (const std::vector<int64_t>& rows :
       {std::vector<int64_t>{2, 1}, std::vector<int64_t>{1, 1}, std::vector<int64_t>{0, 4}}) {
    ember::v1::ImportRowsRequest im;
    im.set_collection("c");
    im.set_epoch(2);
    im.mutable_shard()->set_table("u");
    im.set_row_begin(0);
    im.set_row_end(4);
    im.set_rows(wire::Encode<int64_t>(rows));
    im.set_weights(wire::Encode<float>(std::vector<float>(2 * kDim, 9.0f)));
    im.set_state(wire::Encode<float>(std::vector<float>(2 * kDim, 1.0f)));
    im.set_step(-1);
    ember::v1::ImportRowsResponse done;
    EXPECT_EQ(w->ImportRows(nullptr, &im, &done).error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << rows[0] << ", " << rows[1];
  }
  // Importing into the stage at the held epoch finds no such shard.
  {
    ember::v1::ImportRowsRequest im;
    im.set_collection("c");
    im.set_epoch(1);
    im.mutable_shard()->set_table("u");
    im.set_row_end(1);
    im.set_weights(wire::Encode<float>(std::vector<float>(kDim, 1.0f)));
    im.set_state(wire::Encode<float>(std::vector<float>(kDim, 1.0f)));
    ember::v1::ImportRowsResponse done;
    EXPECT_EQ(w->ImportRows(nullptr, &im, &done).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  // A mark of another shard; a dynamic table's shard takes no mark.
  ember::v1::ExportRowsRequest ex;
  ex.set_collection("c");
  ex.mutable_shard()->set_table("t");
  ex.set_mark(true);
  ember::v1::ExportRowsResponse got;
  ASSERT_TRUE(w->ExportRows(nullptr, &ex, &got).ok());
  ex.set_mark(false);
  ember::v1::ChangeMark foreign = got.mark();
  foreign.set_lineage(foreign.lineage() ^ 1);
  *ex.mutable_changed_since() = foreign;
  ex.set_row_end(8);
  EXPECT_EQ(w->ExportRows(nullptr, &ex, &got).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ex.clear_changed_since();
  ex.set_mark(true);
  ex.mutable_shard()->set_table("d");
  EXPECT_EQ(w->ExportRows(nullptr, &ex, &got).error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // A dropped stage gives its memory back; the collection serves on.
  ember::v1::DropShardsRequest drop;
  drop.set_collection("c");
  drop.set_epoch(2);
  drop.set_staged(true);
  ember::v1::DropShardsResponse dropped;
  ASSERT_TRUE(w->DropShards(nullptr, &drop, &dropped).ok());
  ASSERT_TRUE(w->ShardStatus(nullptr, &sq, &(st = {})).ok());
  EXPECT_EQ(st.available_bytes(), free_bytes);
  EXPECT_EQ(st.shards_size(), 2) << st.DebugString();
  std::mt19937 rng(1);
  EXPECT_TRUE(Update(w.get(), 1, "t", {3}, &rng).ok());
  EXPECT_EQ(Switch(w.get(), 2, {Assignment("t", 8), Assignment("u", 4)}).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  // A stage outlives a move to an earlier epoch (a live move's fence) and
  // gives way to a later one.
  ASSERT_TRUE(Stage(w.get(), 5, {Assignment("u", 4)}).ok());
  ember::v1::UpdateShardsRequest up;
  up.set_collection("c");
  up.set_epoch(4);
  ember::v1::UpdateShardsResponse upr;
  ASSERT_TRUE(w->UpdateShards(nullptr, &up, &upr).ok());
  ASSERT_TRUE(w->ShardStatus(nullptr, &sq, &(st = {})).ok());
  EXPECT_LT(st.available_bytes(), free_bytes);
  up.set_epoch(6);
  ASSERT_TRUE(w->UpdateShards(nullptr, &up, &upr).ok());
  ASSERT_TRUE(w->ShardStatus(nullptr, &sq, &(st = {})).ok());
  EXPECT_EQ(st.available_bytes(), free_bytes);
  // `exact` keeps only the shards named.
  up.set_epoch(7);
  up.set_exact(true);
  *up.add_create() = Assignment("t", 8);
  ASSERT_TRUE(w->UpdateShards(nullptr, &up, &upr).ok());
  ASSERT_TRUE(w->ShardStatus(nullptr, &sq, &(st = {})).ok());
  ASSERT_EQ(st.shards_size(), 1);
  EXPECT_EQ(st.shards(0).shard().table(), "t");
  EXPECT_TRUE(Update(w.get(), 7, "t", {2}, &rng).ok());
}

}  // namespace
}  // namespace worker
}  // namespace ember
