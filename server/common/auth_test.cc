#include "server/common/auth.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace ember {
namespace {

constexpr char kGood[] =
    "# Ember roles\n"
    "worker  w0rker-token-0123456789\n"
    "trainer tr4iner-token-0123456789   # trainers\n"
    "\n"
    "admin   adm1n-token-0123456789\n";

TEST(TokenTableTest, ParsesRolesAndComments) {
  auto t = TokenTable::Parse(kGood, "f");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->enabled());
  EXPECT_EQ(t->TokenOf(Role::kWorker), "w0rker-token-0123456789");
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
