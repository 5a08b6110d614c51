#include "server/common/auth.h"

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace ember {
namespace {

constexpr char kGood[] =
    "# Ember roles\n"
    "worker  w0 w0rker-token-0123456789\n"
    "worker  w1 w1rker-token-0123456789\n"
    "trainer tr4iner-token-0123456789   # trainers\n"
    "\n"
    "admin   adm1n-token-0123456789\n";

TEST(TokenTableTest, ParsesRolesAndComments) {
  auto t = TokenTable::Parse(kGood, "f");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->enabled());
  EXPECT_EQ(t->TokenOf(Role::kWorker), "");  // workers have a token each
  EXPECT_EQ(t->worker_names(), (std::vector<std::string>{"w0", "w1"}));
  EXPECT_EQ(t->TokenOf(Role::kTrainer), "tr4iner-token-0123456789");
  EXPECT_EQ(t->TokenOf(Role::kAdmin), "adm1n-token-0123456789");
  EXPECT_FALSE(TokenTable().enabled());
}

TEST(TokenTableTest, RefusesBadFilesNamingTheLine) {
  struct Case {
    const char* text;
    const char* needle;
  } cases[] = {
      {"admin short\n", "line 1: tokens need at least 16"},
      {"admin adm1n-token-0123456789\nroot r00t-token-0123456789\n", "line 2: unknown role"},
      {"admin adm1n-token-0123456789\nadmin adm2n-token-0123456789\n", "line 2: role admin given twice"},
      {"admin adm1n-token-0123456789 extra\n", "line 1: expected"},
      {"trainer same-token-0123456789\nadmin same-token-0123456789\n", "line 2: the same token"},
      {"admin adm1n-token-0123456789\nworker w0rker-token-0123456789\n",
       "line 2: a worker line names its worker"},
      {"admin adm1n-token-0123456789\nworker a w0rker-token-0123456789\n"
       "worker a w1rker-token-0123456789\n",
       "line 3: worker a given twice"},
      {"admin adm1n-token-0123456789\nworker a adm1n-token-0123456789\n",
       "line 2: the same token"},
      {"admin adm1n-token-0123456789\nworker a b w0rker-token-0123456789\n",
       "line 2: expected \"worker NAME TOKEN\""},
      {"trainer tr4iner-token-0123456789\n", "no admin token"},
  };
  for (const Case& c : cases) {
    auto t = TokenTable::Parse(c.text, "f");
    ASSERT_FALSE(t.ok()) << c.text;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find(c.needle), std::string::npos) << t.status();
  }
  EXPECT_EQ(TokenTable::Load("/nonexistent/tokens").status().code(), absl::StatusCode::kNotFound);
}

TEST(TokenTableTest, AWorkerKnowsItselfAndTheCoordinatorCredentialMadeForIt) {
  auto t = TokenTable::Parse(kGood, "f");
  ASSERT_TRUE(t.ok()) << t.status();
  // Two worker lines: the name must be given, and must be in the file.
  EXPECT_EQ(t->SetSelf("").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t->SetSelf("w7").code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(t->SetSelf("w1").ok());
  EXPECT_EQ(t->self(), "w1");
  EXPECT_EQ(t->SelfToken(), "w1rker-token-0123456789");
  auto one = TokenTable::Parse("admin adm1n-token-0123456789\nworker solo s0lo-token-0123456789\n",
                               "f");
  ASSERT_TRUE(one.ok());
  ASSERT_TRUE(one->SetSelf("").ok());
  EXPECT_EQ(one->SelfToken(), "s0lo-token-0123456789");

  // The coordinator's credential: one per worker, none of them a token of
  // the file, and not the admin token it is keyed by. Pinned against an
  // independent computation (Python's hmac module:
  // hmac.new(b"adm1n-token-0123456789",
  //          b"ember coordinator credential for worker w0", "sha256").hexdigest()).
  const std::string c0 = t->CoordinatorTokenFor("w0");
  const std::string c1 = t->CoordinatorTokenFor("w1");
  EXPECT_EQ(c0, "163eb2d16b9a7493a848f6610144b950c4c6a098c12dcef9c62c9c847fbbe9fb");
  EXPECT_EQ(c0.size(), 64u);
  EXPECT_NE(c0, c1);
  for (const char* token : {"w0rker-token-0123456789", "w1rker-token-0123456789",
                            "tr4iner-token-0123456789", "adm1n-token-0123456789"}) {
    EXPECT_NE(c0, token);
    EXPECT_NE(c1, token);
  }
  EXPECT_EQ(TokenTable().CoordinatorTokenFor("w0"), "");
}

TEST(TokenTableTest, ClientTokenFromOwnFileOrServerFile) {
  const std::string dir = ::testing::TempDir();
  const std::string own = dir + "/own", server = dir + "/server", bad = dir + "/bad";
  std::ofstream(own) << "tr4iner-token-0123456789\n";
  std::ofstream(server) << kGood;
  std::ofstream(bad) << "short\n";
  EXPECT_EQ(*LoadClientToken(own), "tr4iner-token-0123456789");
  EXPECT_EQ(*LoadClientToken(server), "adm1n-token-0123456789");
  EXPECT_EQ(LoadClientToken(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ember
