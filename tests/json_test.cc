#include "ctxpool/telemetry/json.h"

#include <cctype>
#include <memory>
#include <string>

#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

// A strict JSON (RFC 8259) syntax checker: true when all of `s` is one value.
class JsonChecker {
 public:
  explicit JsonChecker(const std::string& s) : s_(s) {}
  bool Check() {
    Ws();
    if (!Value()) return false;
    Ws();
    return i_ == s_.size();
  }

 private:
  void Ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_])))
      ++i_;
  }
  bool Eat(char c) {
    Ws();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  bool Value() {
    Ws();
    if (i_ >= s_.size()) return false;
    const char c = s_[i_];
    if (c == '{') return Object();
    if (c == '[') return Array();
    if (c == '"') return String();
    if (s_.compare(i_, 4, "null") == 0 || s_.compare(i_, 4, "true") == 0) {
      i_ += 4;
      return true;
    }
    if (s_.compare(i_, 5, "false") == 0) {
      i_ += 5;
      return true;
    }
    return Number();
  }
  bool Object() {
    ++i_;
    if (Eat('}')) return true;
    do {
      Ws();
      if (!String() || !Eat(':') || !Value()) return false;
    } while (Eat(','));
    return Eat('}');
  }
  bool Array() {
    ++i_;
    if (Eat(']')) return true;
    do {
      if (!Value()) return false;
    } while (Eat(','));
    return Eat(']');
  }
  bool String() {
    if (i_ >= s_.size() || s_[i_] != '"') return false;
    for (++i_; i_ < s_.size(); ++i_) {
      const unsigned char c = s_[i_];
      if (c == '"') {
        ++i_;
        return true;
      }
      if (c < 0x20) return false;
      if (c == '\\') {
        ++i_;
        if (i_ >= s_.size()) return false;
        if (s_[i_] == 'u') {
          for (int k = 0; k < 4; ++k) {
            if (++i_ >= s_.size() ||
                !std::isxdigit(static_cast<unsigned char>(s_[i_])))
              return false;
          }
        } else if (std::string("\"\\/bfnrt").find(s_[i_]) ==
                   std::string::npos) {
          return false;
        }
      }
    }
    return false;
  }
  bool Number() {
    const std::size_t start = i_;
    if (i_ < s_.size() && s_[i_] == '-') ++i_;
    while (i_ < s_.size() &&
           (std::isdigit(static_cast<unsigned char>(s_[i_])) || s_[i_] == '.' ||
            s_[i_] == 'e' || s_[i_] == 'E' || s_[i_] == '+' || s_[i_] == '-'))
      ++i_;
    return i_ > start;
  }
  const std::string& s_;
  std::size_t i_ = 0;
};

bool IsJson(const std::string& s) { return JsonChecker(s).Check(); }

int Count(const std::string& s, const std::string& what) {
  int n = 0;
  for (std::size_t p = s.find(what); p != std::string::npos;
       p = s.find(what, p + 1))
    ++n;
  return n;
}

TEST(JsonSnapshot, IsValidJsonAndAttributesBlocksToModels) {
  auto sim = SimDriver::Create();
  DeviceContextOptions o;
  o.use_option_table = false;
  auto dc = std::move(DeviceContext::Create(*sim, 0, o)).value();
  auto bert = std::move(dc->OpenSession("bert", {.streams = 1})).value();
  auto odd = std::move(dc->OpenSession("q\"uote\n", {.streams = 1})).value();
  auto a = bert->Allocate(3 << 20, bert->stream(0), "kv\tcache");
  auto b = odd->Allocate(4096, odd->stream(0));
  ASSERT_TRUE(a.ok() && b.ok());

  const std::string json = RenderJsonSnapshot(*dc);
  EXPECT_TRUE(IsJson(json)) << json;
  EXPECT_NE(json.find("\"name\":\"bert\""), std::string::npos);
  EXPECT_NE(json.find("\"q\\\"uote\\n\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"label\":\"kv\\tcache\""), std::string::npos);
  const AllocatorSnapshot snap = dc->device_allocator().Snapshot();
  EXPECT_EQ(Count(json, "\"base\":"), static_cast<int>(snap.segments.size()));
  std::size_t blocks = 0;
  for (const SegmentInfo& s : snap.segments) blocks += s.blocks.size();
  EXPECT_EQ(Count(json, "\"requested\":"), static_cast<int>(blocks));
  EXPECT_EQ(Count(json, "\"state\":\"allocated\",\"model\":\"bert\""), 1);
  ASSERT_TRUE(bert->Deallocate(*a).ok());
  ASSERT_TRUE(odd->Deallocate(*b).ok());
  EXPECT_TRUE(IsJson(RenderJsonSnapshot(*dc)));
}

TEST(JsonSnapshot, RuntimeSnapshotListsEveryDevice) {
  auto rt = std::move(Runtime::Create({.driver = "sim:2xt4-16gb"})).value();
  const std::string json = RenderJsonSnapshot(*rt);
  EXPECT_TRUE(IsJson(json)) << json;
  EXPECT_NE(json.find("\"driver\":\"sim\""), std::string::npos);
  EXPECT_EQ(Count(json, "\"context_bytes\":"), 2);
}

TEST(JsonString, EscapesControlCharacters) {
  EXPECT_EQ(JsonString("a\"b\\c\n\x01"), "\"a\\\"b\\\\c\\n\\u0001\"");
  EXPECT_TRUE(IsJson(JsonString(std::string("\x1f\t\r", 3))));
  EXPECT_FALSE(IsJson("{\"a\":}"));
  EXPECT_FALSE(IsJson("\"\n\""));
}

}  // namespace
}  // namespace ctxpool
