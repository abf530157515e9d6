// Tests for ctxpool/telemetry/svg.h: the memory map is well-formed XML (a
// small parser below checks tags, attributes, entities and nesting) and has
// the rows, legend, axes and plot lines it promises.
#include "ctxpool/telemetry/svg.h"

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

// ---- A minimal XML parser (elements, attributes, text, comments, the XML
// declaration, the five predefined entities and numeric references). --------

struct XmlNode {
  std::string name;
  std::map<std::string, std::string> attrs;
  std::string text;  // concatenated character data, entities decoded
  std::vector<std::unique_ptr<XmlNode>> children;

  bool HasClass(absl::string_view c) const {
    auto it = attrs.find("class");
    if (it == attrs.end()) return false;
    for (absl::string_view part : absl::StrSplit(it->second, ' ')) {
      if (part == c) return true;
    }
    return false;
  }
  // All descendants (and this) for which pred is true.
  template <typename Pred>
  void Find(Pred pred, std::vector<const XmlNode*>* out) const {
    if (pred(*this)) out->push_back(this);
    for (const auto& c : children) c->Find(pred, out);
  }
  std::vector<const XmlNode*> ByClass(absl::string_view c) const {
    std::vector<const XmlNode*> out;
    Find([&](const XmlNode& n) { return n.HasClass(c); }, &out);
    return out;
  }
  std::vector<const XmlNode*> ByName(absl::string_view name) const {
    std::vector<const XmlNode*> out;
    Find([&](const XmlNode& n) { return n.name == name; }, &out);
    return out;
  }
  // Text of this node and all descendants.
  std::string AllText() const {
    std::string s = text;
    for (const auto& c : children) {
      s += ' ';
      s += c->AllText();
    }
    return s;
  }
};

class XmlParser {
 public:
  explicit XmlParser(absl::string_view in) : in_(in) {}

  absl::StatusOr<std::unique_ptr<XmlNode>> Parse() {
    SkipMisc();
    if (absl::StartsWith(in_.substr(pos_), "<?xml")) {
      const std::size_t end = in_.find("?>", pos_);
      if (end == absl::string_view::npos) return Error("unclosed declaration");
      pos_ = end + 2;
    }
    SkipMisc();
    auto root = std::make_unique<XmlNode>();
    if (absl::Status s = Element(root.get()); !s.ok()) return s;
    SkipMisc();
    if (pos_ != in_.size()) return Error("content after the root element");
    return root;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("XML error at offset ", pos_, ": ", what));
  }
  bool IsNameChar(char c) const {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' ||
           c == '-' || c == ':' || c == '.';
  }
  void SkipSpace() {
    while (pos_ < in_.size() &&
           std::isspace(static_cast<unsigned char>(in_[pos_]))) {
      ++pos_;
    }
  }
  // Whitespace and comments.
  void SkipMisc() {
    for (;;) {
      SkipSpace();
      if (absl::StartsWith(in_.substr(pos_), "<!--")) {
        const std::size_t end = in_.find("-->", pos_);
        pos_ = end == absl::string_view::npos ? in_.size() : end + 3;
      } else {
        return;
      }
    }
  }
  absl::StatusOr<std::string> Name() {
    const std::size_t start = pos_;
    while (pos_ < in_.size() && IsNameChar(in_[pos_])) ++pos_;
    if (pos_ == start) return Error("expected a name");
    return std::string(in_.substr(start, pos_ - start));
  }
  // Decodes character data up to `stop`; rejects a bare '&' or '<'.
  absl::StatusOr<std::string> Chars(char stop) {
    std::string out;
    while (pos_ < in_.size() && in_[pos_] != stop) {
      const char c = in_[pos_];
      if (c == '<') return Error("'<' in character data");
      if (c == '&') {
        const std::size_t semi = in_.find(';', pos_);
        if (semi == absl::string_view::npos || semi - pos_ > 10) {
          return Error("bare '&'");
        }
        const absl::string_view ent = in_.substr(pos_ + 1, semi - pos_ - 1);
        if (ent == "amp") {
          out += '&';
        } else if (ent == "lt") {
          out += '<';
        } else if (ent == "gt") {
          out += '>';
        } else if (ent == "quot") {
          out += '"';
        } else if (ent == "apos") {
          out += '\'';
        } else if (!ent.empty() && ent[0] == '#') {
          out += '?';
        } else {
          return Error(absl::StrCat("unknown entity &", ent, ";"));
        }
        pos_ = semi + 1;
        continue;
      }
      out += c;
      ++pos_;
    }
    return out;
  }
  absl::Status Element(XmlNode* node) {
    if (pos_ >= in_.size() || in_[pos_] != '<') return Error("expected '<'");
    ++pos_;
    absl::StatusOr<std::string> name = Name();
    if (!name.ok()) return name.status();
    node->name = *name;
    for (;;) {
      const std::size_t before_space = pos_;
      SkipSpace();
      if (pos_ >= in_.size()) return Error("unclosed start tag");
      if (in_[pos_] == '/') {
        if (pos_ + 1 >= in_.size() || in_[pos_ + 1] != '>') {
          return Error("expected '/>'");
        }
        pos_ += 2;
        return absl::OkStatus();
      }
      if (in_[pos_] == '>') {
        ++pos_;
        break;
      }
      if (pos_ == before_space) {
        return Error("attributes must be separated by whitespace");
      }
      absl::StatusOr<std::string> attr = Name();
      if (!attr.ok()) return attr.status();
      SkipSpace();
      if (pos_ >= in_.size() || in_[pos_] != '=') return Error("expected '='");
      ++pos_;
      SkipSpace();
      if (pos_ >= in_.size() || (in_[pos_] != '"' && in_[pos_] != '\'')) {
        return Error("expected a quoted value");
      }
      const char quote = in_[pos_++];
      absl::StatusOr<std::string> value = Chars(quote);
      if (!value.ok()) return value.status();
      if (pos_ >= in_.size()) return Error("unclosed attribute value");
      ++pos_;
      if (!node->attrs.emplace(*attr, *value).second) {
        return Error(absl::StrCat("duplicate attribute ", *attr));
      }
    }
    // Content.
    for (;;) {
      if (pos_ >= in_.size()) {
        return Error(absl::StrCat("unclosed element <", node->name, ">"));
      }
      if (absl::StartsWith(in_.substr(pos_), "<!--")) {
        SkipMisc();
        continue;
      }
      if (absl::StartsWith(in_.substr(pos_), "</")) {
        pos_ += 2;
        absl::StatusOr<std::string> end = Name();
        if (!end.ok()) return end.status();
        if (*end != node->name) {
          return Error(absl::StrCat("</", *end, "> closes <", node->name, ">"));
        }
        SkipSpace();
        if (pos_ >= in_.size() || in_[pos_] != '>') return Error("expected >");
        ++pos_;
        return absl::OkStatus();
      }
      if (in_[pos_] == '<') {
        auto child = std::make_unique<XmlNode>();
        if (absl::Status s = Element(child.get()); !s.ok()) return s;
        node->children.push_back(std::move(child));
        continue;
      }
      absl::StatusOr<std::string> text = Chars('<');
      if (!text.ok()) return text.status();
      node->text += *text;
    }
  }

  absl::string_view in_;
  std::size_t pos_ = 0;
};

absl::StatusOr<std::unique_ptr<XmlNode>> ParseXml(absl::string_view text) {
  return XmlParser(text).Parse();
}

// ---- The parser itself -----------------------------------------------------

TEST(XmlParserTest, AcceptsWellFormedAndRejectsBroken) {
  EXPECT_TRUE(ParseXml("<a x=\"1\"><b/>t &amp; u</a>").ok());
  EXPECT_FALSE(ParseXml("<a><b></a>").ok());
  EXPECT_FALSE(ParseXml("<a x=\"1\" x=\"2\"/>").ok());
  EXPECT_FALSE(ParseXml("<a x=\"1\"y=\"2\"/>").ok());
  EXPECT_FALSE(ParseXml("<a>x & y</a>").ok());
  EXPECT_FALSE(ParseXml("<a>1 < 2</a>").ok());
  EXPECT_FALSE(ParseXml("<a></a><b/>").ok());
  EXPECT_FALSE(ParseXml("<a>").ok());
}

// ---- The memory map --------------------------------------------------------

TEST(SvgTest, XmlEscapeEscapesTheFiveCharacters) {
  EXPECT_EQ(XmlEscape("a<b>&\"c'"), "a&lt;b&gt;&amp;&quot;c&apos;");
}

TEST(SvgTest, PaletteHasTenDistinctColours) {
  std::vector<std::string> colors;
  for (int i = 0; i < 10; ++i) colors.push_back(PaletteColor(i));
  for (int i = 0; i < 10; ++i) {
    for (int j = i + 1; j < 10; ++j) EXPECT_NE(colors[i], colors[j]);
  }
  EXPECT_EQ(PaletteColor(10), PaletteColor(0));
}

// Two models on two streams of one real allocator on SimDriver, with an
// allocated, a pending-free and a free block.
struct Fixture {
  std::unique_ptr<SimDriver> sim = SimDriver::Create();
  std::unique_ptr<CachingDeviceAllocator> alloc;
  StreamHandle s1, s2;
  MemoryMapPanel panel;

  Fixture() {
    alloc = *CachingDeviceAllocator::Create(*sim, 0);
    ContextHandle ctx = *sim->PrimaryCtxRetain(0);
    EXPECT_TRUE(sim->CtxPushCurrent(ctx).ok());
    s1 = *sim->StreamCreate(kStreamNonBlocking, 0);
    s2 = *sim->StreamCreate(kStreamNonBlocking, 0);
    DevicePtr a = *alloc->Allocate(64 << 20, s1);   // own segment
    DevicePtr b = *alloc->Allocate(4 << 20, s1);    // 20 MiB segment
    DevicePtr c = *alloc->Allocate(512 << 10, s2);  // small pool
    DevicePtr d = *alloc->Allocate(8 << 20, s2);
    (void)a;
    (void)b;
    (void)c;
    // d: pending free (used on s1, which is held).
    EXPECT_TRUE(alloc->RecordStream(d, s1).ok());
    sim->Hold(s1);
    EXPECT_TRUE(alloc->Deallocate(d).ok());
    panel.title = "shared <allocator> & co";
    panel.caption = "two models";
    panel.snapshot = alloc->Snapshot();
    panel.stream_models = {{s1, "bert"}, {s2, "t5"}};
  }
  ~Fixture() {
    sim->Release(s1);
    alloc.reset();
    (void)sim->StreamDestroy(s1);
    (void)sim->StreamDestroy(s2);
    (void)sim->CtxPopCurrent();
    (void)sim->PrimaryCtxRelease(0);
  }
};

SvgPlot FragPlot() {
  SvgPlot plot;
  plot.title = "External fragmentation over time";
  plot.x_label = "trace event (#)";
  plot.y_label = "fragmentation (%)";
  plot.y_max = 100;
  plot.series.push_back({"today", {{0, 0}, {50, 30}, {100, 45}}});
  plot.series.push_back({"ctxpool", {{0, 0}, {50, 5}, {100, 2}}});
  return plot;
}

TEST(SvgTest, MemoryMapIsWellFormedWithRowsLegendAndAxes) {
  Fixture f;
  const AllocatorSnapshot& snap = f.panel.snapshot;
  ASSERT_GE(snap.segments.size(), 3u);
  const std::string svg =
      RenderMemoryMapSvg({f.panel}, {FragPlot()}, {.title = "map & test"});
  absl::StatusOr<std::unique_ptr<XmlNode>> root = ParseXml(svg);
  ASSERT_TRUE(root.ok()) << root.status() << "\n" << svg;
  const XmlNode& svg_node = **root;
  EXPECT_EQ(svg_node.name, "svg");
  EXPECT_EQ(svg_node.attrs.at("xmlns"), "http://www.w3.org/2000/svg");
  EXPECT_GT(std::stoi(svg_node.attrs.at("width")), 0);
  EXPECT_GT(std::stoi(svg_node.attrs.at("height")), 0);

  // Titles survive escaping.
  EXPECT_THAT(svg_node.AllText(), testing::HasSubstr("map & test"));
  EXPECT_THAT(svg_node.AllText(),
              testing::HasSubstr("shared <allocator> & co"));

  // One row per segment, each with its blocks tiling it.
  std::vector<const XmlNode*> rows = svg_node.ByClass("segment-row");
  ASSERT_EQ(rows.size(), snap.segments.size());
  std::size_t blocks = 0;
  for (const SegmentInfo& s : snap.segments) blocks += s.blocks.size();
  EXPECT_EQ(svg_node.ByClass("block").size(), blocks);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(std::stoull(rows[i]->attrs.at("data-size")),
              snap.segments[i].size);
    EXPECT_EQ(rows[i]->ByClass("block").size(), snap.segments[i].blocks.size());
  }
  EXPECT_EQ(svg_node.ByClass("allocated").size(), 3u);
  EXPECT_EQ(svg_node.ByClass("pending-free").size(), 1u);
  EXPECT_FALSE(svg_node.ByClass("free").empty());

  // Allocated blocks are coloured by model: bert's and t5's differ.
  std::map<std::string, std::string> fill_by_model;
  for (const XmlNode* b : svg_node.ByClass("allocated")) {
    const std::string title = b->AllText();
    const std::string model = absl::StrContains(title, "bert") ? "bert" : "t5";
    fill_by_model[model] = b->attrs.at("fill");
  }
  ASSERT_EQ(fill_by_model.size(), 2u);
  EXPECT_NE(fill_by_model["bert"], fill_by_model["t5"]);

  // Legend: the three states and both models.
  std::vector<const XmlNode*> legend = svg_node.ByClass("legend");
  ASSERT_EQ(legend.size(), 1u);
  const std::string legend_text = legend[0]->AllText();
  EXPECT_THAT(legend_text, testing::HasSubstr("allocated"));
  EXPECT_THAT(legend_text, testing::HasSubstr("pending free"));
  EXPECT_THAT(legend_text, testing::HasSubstr("free, cached"));
  EXPECT_THAT(legend_text, testing::HasSubstr("bert"));
  EXPECT_THAT(legend_text, testing::HasSubstr("t5"));
  EXPECT_EQ(legend[0]->ByClass("legend-model").size(), 2u);
  EXPECT_EQ(legend[0]->ByClass("legend-state").size(), 3u);

  // Axes: the panel has an x axis in bytes and a y axis; the plot has both
  // with its labels and units, and one line per series.
  std::vector<const XmlNode*> panels = svg_node.ByClass("panel");
  ASSERT_EQ(panels.size(), 1u);
  ASSERT_EQ(panels[0]->ByClass("x-axis").size(), 1u);
  EXPECT_EQ(panels[0]->ByClass("y-axis").size(), 1u);
  EXPECT_THAT(panels[0]->ByClass("x-axis")[0]->AllText(),
              testing::HasSubstr("offset in segment (MiB)"));
  std::vector<const XmlNode*> plots = svg_node.ByClass("plot");
  ASSERT_EQ(plots.size(), 1u);
  ASSERT_EQ(plots[0]->ByClass("x-axis").size(), 1u);
  ASSERT_EQ(plots[0]->ByClass("y-axis").size(), 1u);
  EXPECT_THAT(plots[0]->ByClass("x-axis")[0]->AllText(),
              testing::HasSubstr("trace event (#)"));
  const std::string y_text = plots[0]->ByClass("y-axis")[0]->AllText();
  EXPECT_THAT(y_text, testing::HasSubstr("fragmentation (%)"));
  EXPECT_THAT(y_text, testing::HasSubstr("100"));
  std::vector<const XmlNode*> series = plots[0]->ByClass("series");
  ASSERT_EQ(series.size(), 2u);
  EXPECT_EQ(series[0]->attrs.at("data-name"), "today");
  EXPECT_NE(series[0]->attrs.at("stroke"), series[1]->attrs.at("stroke"));
  // Three points: a move and two lines.
  EXPECT_EQ(std::count(series[0]->attrs.at("d").begin(),
                       series[0]->attrs.at("d").end(), 'L'),
            2);
}

TEST(SvgTest, LimitsRowsAndSaysHowManyWereLeftOut) {
  Fixture f;
  const std::size_t n = f.panel.snapshot.segments.size();
  ASSERT_GE(n, 3u);
  const std::string svg = RenderMemoryMapSvg({f.panel}, {}, {.max_rows = 2});
  absl::StatusOr<std::unique_ptr<XmlNode>> root = ParseXml(svg);
  ASSERT_TRUE(root.ok()) << root.status();
  EXPECT_EQ((*root)->ByClass("segment-row").size(), 2u);
  EXPECT_THAT((*root)->AllText(), testing::HasSubstr(absl::StrCat(
                                      "+ ", n - 2, " smaller segments")));
  EXPECT_TRUE((*root)->ByClass("plot").empty());
}

// An expandable segment is a stream's whole virtual range (here 160 GiB);
// the map draws what is mapped and used, not the virtual space, so a 1 GiB
// block is not a sliver on a 160 GiB axis.
TEST(SvgTest, ExpandableRangesAreDrawnToTheirMappedExtent) {
  constexpr std::size_t kGiBytes = std::size_t{1} << 30;
  SegmentInfo seg;
  seg.base = DevicePtr(std::uint64_t{1} << 44);
  seg.size = 160 * kGiBytes;
  seg.expandable = true;
  seg.mapped_bytes = kGiBytes + (2 << 20);
  BlockInfo used{.ptr = seg.base,
                 .size = kGiBytes,
                 .requested_bytes = kGiBytes,
                 .state = BlockState::kAllocated,
                 .mapped_bytes = kGiBytes};
  BlockInfo rest{.ptr = seg.base + kGiBytes,
                 .size = 159 * kGiBytes,
                 .state = BlockState::kFree,
                 .mapped_bytes = 2 << 20};
  seg.blocks = {used, rest};
  MemoryMapPanel panel;
  panel.title = "expandable";
  panel.snapshot.segments = {seg};
  const std::string svg = RenderMemoryMapSvg({panel}, {});
  absl::StatusOr<std::unique_ptr<XmlNode>> root = ParseXml(svg);
  ASSERT_TRUE(root.ok()) << root.status();
  const std::string text = (*root)->AllText();
  EXPECT_THAT(text, testing::HasSubstr("1026.0 MiB mapped"));
  EXPECT_THAT(text, testing::Not(testing::HasSubstr("160")));
  EXPECT_THAT(text, testing::Not(testing::HasSubstr("150")));
  EXPECT_EQ((*root)->ByClass("segment-row").size(), 1u);
}

TEST(SvgTest, PanelsSideBySideAndEmptyInputsStayWellFormed) {
  Fixture f;
  MemoryMapPanel empty;
  empty.title = "after trim";
  const std::string svg = RenderMemoryMapSvg({f.panel, empty}, {FragPlot()});
  absl::StatusOr<std::unique_ptr<XmlNode>> root = ParseXml(svg);
  ASSERT_TRUE(root.ok()) << root.status();
  EXPECT_EQ((*root)->ByClass("panel").size(), 2u);
  EXPECT_THAT((*root)->AllText(), testing::HasSubstr("nothing reserved"));

  const std::string bare = RenderMemoryMapSvg({}, {SvgPlot{}});
  absl::StatusOr<std::unique_ptr<XmlNode>> bare_root = ParseXml(bare);
  ASSERT_TRUE(bare_root.ok()) << bare_root.status() << "\n" << bare;
  EXPECT_EQ((*bare_root)->ByClass("plot").size(), 1u);
  // Plots alone: the block legend (blocks, models) belongs to memory-map
  // panels and is left out.
  EXPECT_TRUE((*bare_root)->ByClass("legend").empty()) << bare;
  EXPECT_THAT((*bare_root)->AllText(),
              testing::Not(testing::HasSubstr("blocks:")));
}

// Stacked plots: each solid series is an area on top of the ones before it,
// sharing its lower edge with the previous top; dashed series stay lines.
TEST(SvgTest, StackedAreasSitOnTopOfEachOther) {
  SvgPlot p;
  p.title = "memory";
  p.x_label = "event (#)";
  p.y_label = "GiB";
  p.y_max = 4;
  p.stacked = true;
  p.series.push_back({"bert", {{0, 1}, {10, 1}}});
  p.series.push_back({"llama", {{0, 2}, {10, 2}}});
  SvgSeries cap{"capacity", {{0, 4}, {10, 4}}};
  cap.dashed = true;
  p.series.push_back(cap);
  const std::string svg = RenderMemoryMapSvg({}, {p});
  absl::StatusOr<std::unique_ptr<XmlNode>> root = ParseXml(svg);
  ASSERT_TRUE(root.ok()) << root.status() << "\n" << svg;
  const std::vector<const XmlNode*> areas = (*root)->ByClass("stacked-area");
  ASSERT_EQ(areas.size(), 2u);
  // The y of each "x,y" point of a path.
  auto ys = [](const XmlNode* n) {
    std::vector<double> out;
    for (absl::string_view pt :
         absl::StrSplit(n->attrs.at("d"), ' ', absl::SkipEmpty())) {
      const std::size_t comma = pt.find(',');
      if (comma == absl::string_view::npos) continue;
      double y = 0;
      EXPECT_TRUE(
          absl::SimpleAtod(absl::StripSuffix(pt.substr(comma + 1), "Z"), &y))
          << pt;
      out.push_back(y);
    }
    return out;
  };
  const std::vector<double> bert = ys(areas[0]), llama = ys(areas[1]);
  ASSERT_EQ(bert.size(), 4u);
  ASSERT_EQ(llama.size(), 4u);
  // bert: its top (y of 1) then the axis (y of 0); llama: its top (y of 3)
  // then bert's top. SVG y grows downwards.
  const double zero = bert[2], one = bert[0], three = llama[0];
  EXPECT_GT(zero, one);
  EXPECT_GT(one, three);
  EXPECT_DOUBLE_EQ(llama[2], one);
  EXPECT_NEAR((zero - one) * 3, zero - three, 0.2);
  EXPECT_EQ(areas[0]->attrs.at("data-name"), "bert");
  EXPECT_EQ(areas[1]->attrs.at("data-name"), "llama");
  // The capacity line is a plain dashed series, not an area.
  int lines = 0;
  for (const XmlNode* n : (*root)->ByClass("series")) {
    if (n->attrs.at("data-name") == "capacity") {
      ++lines;
      EXPECT_TRUE(n->attrs.contains("stroke-dasharray"));
      EXPECT_EQ(n->attrs.at("fill"), "none");
    }
  }
  EXPECT_EQ(lines, 1);
}

}  // namespace
}  // namespace ctxpool
