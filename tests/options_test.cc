#include "ctxpool/options.h"

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace ctxpool {
namespace {

class OptionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const OptionSpec& spec : AllOptions()) {
      unsetenv(std::string(spec.env).c_str());
    }
    ReloadOptions();
  }
  void TearDown() override { SetUp(); }
};

TEST_F(OptionsTest, TableIsInIdOrderWithUniqueCtxpoolNames) {
  ASSERT_EQ(AllOptions().size(), static_cast<std::size_t>(kOptionCount));
  for (int i = 0; i < kOptionCount; ++i) {
    const OptionSpec& spec = AllOptions()[i];
    EXPECT_EQ(static_cast<int>(spec.id), i) << spec.name;
    EXPECT_EQ(spec.env.substr(0, 8), "CTXPOOL_") << spec.env;
    EXPECT_FALSE(spec.description.empty()) << spec.name;
    for (int j = 0; j < i; ++j) {
      EXPECT_NE(AllOptions()[j].env, spec.env);
      EXPECT_NE(AllOptions()[j].name, spec.name);
    }
  }
}

TEST_F(OptionsTest, EveryDefaultParsesAsItsKind) {
  for (const OptionSpec& spec : AllOptions()) {
    switch (spec.kind) {
      case OptionKind::kBool:
        EXPECT_TRUE(GetOptionBool(spec.id).ok()) << spec.env;
        break;
      case OptionKind::kInt:
        EXPECT_TRUE(GetOptionInt(spec.id).ok()) << spec.env;
        break;
      case OptionKind::kBytes:
        EXPECT_TRUE(GetOptionBytes(spec.id).ok()) << spec.env;
        break;
      case OptionKind::kString:
        break;
    }
    EXPECT_FALSE(IsOptionOverridden(spec.id));
    EXPECT_EQ(GetOption(spec.id), spec.default_value);
  }
}

TEST_F(OptionsTest, DocumentedOptionsExist) {
  for (absl::string_view env :
       {"CTXPOOL_DRIVER", "CTXPOOL_BACKING", "CTXPOOL_TRACE",
        "CTXPOOL_SESSION_MAX_BYTES", "CTXPOOL_SESSION_HIGH_BYTES",
        "CTXPOOL_SESSION_MIN_BYTES", "CTXPOOL_DEVICES"}) {
    EXPECT_TRUE(FindOption(env).ok()) << env;
  }
  EXPECT_EQ(*FindOption("driver"), OptionId::kDriver);
  EXPECT_EQ(FindOption("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(GetOption(OptionId::kDriver), "auto");
}

TEST_F(OptionsTest, EnvironmentIsReadOnceAndOverridesDefault) {
  setenv("CTXPOOL_DRIVER", "sim:a10-24gb", 1);
  setenv("CTXPOOL_SESSION_MAX_BYTES", "8GiB", 1);
  setenv("CTXPOOL_TRACE", "on", 1);
  ReloadOptions();
  EXPECT_EQ(GetOption(OptionId::kDriver), "sim:a10-24gb");
  EXPECT_TRUE(IsOptionOverridden(OptionId::kDriver));
  EXPECT_EQ(*GetOptionBytes(OptionId::kSessionMaxBytes), std::size_t{8} << 30);
  EXPECT_TRUE(*GetOptionBool(OptionId::kTrace));
  // Changing the environment later has no effect until ReloadOptions.
  setenv("CTXPOOL_DRIVER", "cuda", 1);
  EXPECT_EQ(GetOption(OptionId::kDriver), "sim:a10-24gb");
  ReloadOptions();
  EXPECT_EQ(GetOption(OptionId::kDriver), "cuda");
}

TEST_F(OptionsTest, SetOptionWinsOverEnvironmentAndValidates) {
  setenv("CTXPOOL_SESSION_STREAMS", "3", 1);
  ReloadOptions();
  EXPECT_EQ(*GetOptionInt(OptionId::kSessionStreams), 3);
  ASSERT_TRUE(SetOption(OptionId::kSessionStreams, "5").ok());
  EXPECT_EQ(*GetOptionInt(OptionId::kSessionStreams), 5);
  absl::Status bad = SetOption(OptionId::kSessionStreams, "five");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("CTXPOOL_SESSION_STREAMS"), std::string::npos);
  EXPECT_EQ(*GetOptionInt(OptionId::kSessionStreams), 5);
  ReloadOptions();  // drops SetOption
  EXPECT_EQ(*GetOptionInt(OptionId::kSessionStreams), 3);
}

TEST_F(OptionsTest, BadEnvironmentValueNamesTheVariable) {
  setenv("CTXPOOL_SESSION_MAX_BYTES", "lots", 1);
  setenv("CTXPOOL_TRACE", "maybe", 1);
  ReloadOptions();
  absl::StatusOr<std::size_t> max = GetOptionBytes(OptionId::kSessionMaxBytes);
  ASSERT_FALSE(max.ok());
  EXPECT_EQ(max.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(max.status().message().find("CTXPOOL_SESSION_MAX_BYTES"),
            std::string::npos);
  EXPECT_NE(max.status().message().find("lots"), std::string::npos);
  EXPECT_FALSE(GetOptionBool(OptionId::kTrace).ok());
}

TEST(ParseBytes, UnitsArePowersOfTwo) {
  EXPECT_EQ(*ParseBytes("4096"), 4096u);
  EXPECT_EQ(*ParseBytes("0"), 0u);
  EXPECT_EQ(*ParseBytes("512KiB"), 512u << 10);
  EXPECT_EQ(*ParseBytes("512 kb"), 512u << 10);
  EXPECT_EQ(*ParseBytes("20M"), 20u << 20);
  EXPECT_EQ(*ParseBytes("1.5GiB"), std::size_t{3} << 29);
  EXPECT_EQ(*ParseBytes("8G"), std::size_t{8} << 30);
  EXPECT_EQ(*ParseBytes("2TiB"), std::size_t{2} << 40);
  EXPECT_EQ(*ParseBytes(" 7B "), 7u);
  for (absl::string_view bad : {"", "GiB", "-1", "1.2.3", "12PB", "ten",
                                "99999999999999999999", "20000000TiB"}) {
    EXPECT_FALSE(ParseBytes(bad).ok()) << bad;
  }
}

TEST(ParseBool, AcceptsTheUsualSpellings) {
  for (absl::string_view t : {"1", "true", "TRUE", "on", "yes", " Yes "}) {
    EXPECT_TRUE(*ParseBool(t)) << t;
  }
  for (absl::string_view f : {"0", "false", "off", "no", "NO"}) {
    EXPECT_FALSE(*ParseBool(f)) << f;
  }
  EXPECT_FALSE(ParseBool("2").ok());
  EXPECT_FALSE(ParseBool("").ok());
}

TEST_F(OptionsTest, DescribeOptionsListsEveryVariableAndMarksOverrides) {
  ASSERT_TRUE(SetOption(OptionId::kVerbose, "1").ok());
  const std::string text = DescribeOptions();
  for (const OptionSpec& spec : AllOptions()) {
    EXPECT_NE(text.find(std::string(spec.env)), std::string::npos) << spec.env;
  }
  EXPECT_NE(text.find("'1' [set]"), std::string::npos) << text;
}

}  // namespace
}  // namespace ctxpool
