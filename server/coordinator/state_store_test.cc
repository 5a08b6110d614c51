#include "server/coordinator/state_store.h"

#include <stdlib.h>

#include "gtest/gtest.h"

namespace ember {
namespace coordinator {
namespace {

TEST(StateStoreTest, WhatIsWrittenSurvivesAReopen) {
  std::string tmpl = ::testing::TempDir() + "/ember_state_XXXXXX";
  const std::string dir = mkdtemp(tmpl.data());
  {
    auto store = StateStore::Open(dir);
    ASSERT_TRUE(store.ok()) << store.status();
    ember::v1::StoredWorker w;
    w.set_worker_id("w3");
    w.mutable_info()->set_address("127.0.0.1:5");
    w.set_seq(3);
    ember::v1::StoredCollection c;
    c.mutable_info()->mutable_spec()->set_name("c");
    c.mutable_info()->mutable_plan()->set_epoch(7);
    c.add_rank_worker_ids("w3");
    ember::v1::CheckpointInfo k1, k2;
    k1.set_path("/a");
    k1.set_created_unix_ms(20);
    k2.set_path("/b");
    k2.set_created_unix_ms(10);
    ASSERT_TRUE((*store)
                    ->Write(StateStore::Batch().Epoch(7).NextWorker(3).PutWorker(w).PutCollection(
                        c).PutCheckpoint(k1).PutCheckpoint(k2))
                    .ok());
    ember::v1::StoredCollection gone;
    gone.mutable_info()->mutable_spec()->set_name("gone");
    ASSERT_TRUE((*store)->Write(StateStore::Batch().PutCollection(gone)).ok());
    ASSERT_TRUE((*store)->Write(StateStore::Batch().DeleteCollection("gone")).ok());
    // A second process (or instance) cannot open a held store.
    EXPECT_FALSE(StateStore::Open(dir).ok());
  }
  auto store = StateStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  auto state = (*store)->Load();
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->epoch, 7);
  EXPECT_EQ(state->next_worker, 3);
  ASSERT_EQ(state->workers.size(), 1u);
  EXPECT_EQ(state->workers[0].info().address(), "127.0.0.1:5");
  ASSERT_EQ(state->collections.size(), 1u);
  EXPECT_EQ(state->collections[0].info().plan().epoch(), 7);
  EXPECT_EQ(state->collections[0].rank_worker_ids(0), "w3");
  ASSERT_EQ(state->checkpoints.size(), 2u);
  EXPECT_EQ(state->checkpoints[0].path(), "/b");  // oldest first
  EXPECT_EQ(state->checkpoints[1].path(), "/a");
}

}  // namespace
}  // namespace coordinator
}  // namespace ember
