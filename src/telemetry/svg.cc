// The SVG memory map (ctxpool/telemetry/svg.h).
//
// Layout, top to bottom: the title and subtitle; the legend (block states,
// then one swatch per model); the panels side by side, each a column of
// segment rows over a byte axis; the plots side by side, each with a y axis
// (ticks, gridlines, label) and an x axis.
#include "ctxpool/telemetry/svg.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace ctxpool {
namespace {

constexpr const char* kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                                    "#9467bd", "#8c564b", "#e377c2", "#17becf",
                                    "#bcbd22", "#7f7f7f"};
constexpr int kPaletteSize = 10;
constexpr const char* kFreeColor = "#dcdcdc";
constexpr const char* kUnownedColor = "#555555";
constexpr const char* kFont = "font-family=\"DejaVu Sans, Arial, sans-serif\"";

// A "nice" step (1, 2 or 5 x 10^k) giving about `ticks` intervals over span.
double NiceStep(double span, int ticks) {
  if (span <= 0) return 1;
  const double raw = span / ticks;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  double nice = 10;
  if (norm <= 1) {
    nice = 1;
  } else if (norm <= 2) {
    nice = 2;
  } else if (norm <= 5) {
    nice = 5;
  }
  return nice * mag;
}

// A byte unit for an axis whose largest value is `max_bytes`.
std::pair<double, const char*> ByteUnit(double max_bytes) {
  if (max_bytes >= 2.0 * (1ull << 30)) return {double(1ull << 30), "GiB"};
  if (max_bytes >= 2.0 * (1ull << 20)) return {double(1ull << 20), "MiB"};
  if (max_bytes >= 2.0 * (1ull << 10)) return {double(1ull << 10), "KiB"};
  return {1.0, "B"};
}

std::string Num(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    return absl::StrFormat("%.0f", v);
  }
  if (std::fabs(v) >= 10) return absl::StrFormat("%.0f", v);
  return absl::StrFormat("%.3g", v);
}

std::string HumanBytes(double bytes) {
  const auto [scale, unit] = ByteUnit(bytes);
  return absl::StrFormat("%.1f %s", bytes / scale, unit);
}

// Plot lines use darker colours than the models, so that a line is never
// mistaken for a model.
constexpr const char* kSeriesPalette[] = {"#b2182b", "#2166ac", "#1b7837",
                                          "#762a83", "#000000"};

class Palette {
 public:
  explicit Palette(bool series = false) : series_(series) {}
  const std::string& Color(const std::string& model) {
    auto it = colors_.find(model);
    if (it != colors_.end()) return it->second;
    order_.push_back(model);
    const int i = static_cast<int>(order_.size()) - 1;
    return colors_
        .emplace(model,
                 series_ ? std::string(kSeriesPalette[i % 5]) : PaletteColor(i))
        .first->second;
  }
  const std::vector<std::string>& order() const { return order_; }

 private:
  bool series_;
  absl::flat_hash_map<std::string, std::string> colors_;
  std::vector<std::string> order_;
};

struct Box {
  double x = 0, y = 0, w = 0, h = 0;
};

void Text(std::string& out, double x, double y, absl::string_view text,
          int size = 12, absl::string_view anchor = "start",
          absl::string_view extra = "") {
  absl::StrAppendFormat(&out,
                        "<text x=\"%.1f\" y=\"%.1f\" font-size=\"%d\" "
                        "text-anchor=\"%s\" %s %s>%s</text>\n",
                        x, y, size, anchor, kFont, extra, XmlEscape(text));
}

// The model owning each block of a panel.
std::string BlockModel(
    const BlockInfo& block, const SegmentInfo& segment,
    const absl::flat_hash_map<std::uint64_t, std::string>& by_block,
    const absl::flat_hash_map<std::uint64_t, std::string>& by_stream) {
  if (auto it = by_block.find(block.ptr.address()); it != by_block.end()) {
    return it->second;
  }
  if (auto it = by_stream.find(segment.stream.value()); it != by_stream.end()) {
    return it->second;
  }
  return "";
}

void DrawPanel(std::string& out, const MemoryMapPanel& panel, const Box& box,
               const SvgOptions& options, Palette& palette) {
  absl::StrAppendFormat(&out, "<g class=\"panel\" id=\"panel-%s\">\n",
                        XmlEscape(panel.title));
  Text(out, box.x, box.y + 14, panel.title, 15, "start",
       "font-weight=\"bold\" ");
  Text(out, box.x, box.y + 32, panel.caption, 12);

  absl::flat_hash_map<std::uint64_t, std::string> by_block;
  absl::flat_hash_map<std::uint64_t, std::string> by_stream;
  for (const auto& [ptr, model] : panel.block_models) {
    by_block[ptr.address()] = model;
  }
  for (const auto& [stream, model] : panel.stream_models) {
    by_stream[stream.value()] = model;
  }

  // Rows: the largest max_rows segments, kept in address order. A classic
  // segment is drawn whole; an expandable one (a stream's virtual range) only
  // up to the end of its last mapped or used block: unmapped virtual space
  // holds no memory and is not drawn.
  const std::vector<SegmentInfo>& segs = panel.snapshot.segments;
  std::vector<std::uint64_t> extent(segs.size());
  for (std::size_t i = 0; i < segs.size(); ++i) {
    if (!segs[i].expandable) {
      extent[i] = segs[i].size;
      continue;
    }
    for (const BlockInfo& b : segs[i].blocks) {
      // Free blocks are drawn as wide as their mapped bytes (below).
      const std::size_t drawn =
          b.state == BlockState::kFree ? b.mapped_bytes : b.size;
      if (drawn > 0) {
        extent[i] = b.ptr.address() - segs[i].base.address() + drawn;
      }
    }
  }
  std::vector<std::size_t> shown(segs.size());
  for (std::size_t i = 0; i < segs.size(); ++i) shown[i] = i;
  const std::size_t max_rows =
      static_cast<std::size_t>(std::max(options.max_rows, 1));
  std::size_t hidden = 0;
  std::uint64_t hidden_bytes = 0;
  if (shown.size() > max_rows) {
    std::stable_sort(
        shown.begin(), shown.end(),
        [&](std::size_t a, std::size_t b) { return extent[a] > extent[b]; });
    for (std::size_t i = max_rows; i < shown.size(); ++i) {
      const SegmentInfo& h = segs[shown[i]];
      hidden_bytes += h.expandable ? h.mapped_bytes : h.size;
    }
    hidden = shown.size() - max_rows;
    shown.resize(max_rows);
    std::sort(shown.begin(), shown.end());
  }
  std::uint64_t max_size = 0;
  for (std::size_t i : shown)
    max_size = std::max<std::uint64_t>(max_size, extent[i]);

  const double label_w = 150;
  const double plot_x = box.x + label_w;
  const double plot_w = std::max(50.0, box.w - label_w - 10);
  const double top = box.y + 48;
  const double row_h = options.row_height;
  const double rows_h =
      std::max<double>(static_cast<double>(shown.size()), 1.0) * row_h;

  // Axis frame and y label.
  absl::StrAppendFormat(&out,
                        "<g class=\"axis y-axis\"><line x1=\"%.1f\" "
                        "y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/>",
                        plot_x, top, plot_x, top + rows_h);
  Text(out, box.x, top - 4, "segment (size, model)", 11, "start",
       "fill=\"#333\" class=\"axis-label\" ");
  out += "</g>\n";

  if (shown.empty()) {
    Text(out, plot_x + 8, top + row_h * 0.8, "no segments: nothing reserved",
         12, "start", "fill=\"#666\" ");
  }
  const double scale =
      max_size == 0 ? 0.0 : plot_w / static_cast<double>(max_size);
  for (std::size_t r = 0; r < shown.size(); ++r) {
    const SegmentInfo& seg = segs[shown[r]];
    const double y = top + static_cast<double>(r) * row_h;
    const std::string seg_model = by_stream.contains(seg.stream.value())
                                      ? by_stream[seg.stream.value()]
                                      : std::string();
    absl::StrAppendFormat(
        &out, "<g class=\"segment-row\" data-base=\"0x%x\" data-size=\"%d\">\n",
        seg.base.address(), seg.size);
    Text(out, plot_x - 6, y + row_h * 0.78,
         absl::StrCat(HumanBytes(static_cast<double>(
                          seg.expandable ? seg.mapped_bytes : seg.size)),
                      seg.expandable ? " mapped" : "",
                      seg_model.empty() ? "" : " ", seg_model),
         10, "end");
    for (const BlockInfo& b : seg.blocks) {
      const double bx =
          plot_x +
          static_cast<double>(b.ptr.address() - seg.base.address()) * scale;
      // A free block of an expandable range is drawn as wide as its mapped
      // bytes (where in the block they lie is not shown); wholly unmapped
      // free blocks are not drawn.
      const std::size_t drawn = seg.expandable && b.state == BlockState::kFree
                                    ? b.mapped_bytes
                                    : b.size;
      if (drawn == 0) continue;
      const double bw = std::max(1.0, static_cast<double>(drawn) * scale);
      const std::string model = BlockModel(b, seg, by_block, by_stream);
      const std::string color =
          model.empty() ? std::string(kUnownedColor) : palette.Color(model);
      const char* cls = "free";
      std::string style;
      switch (b.state) {
        case BlockState::kAllocated:
          cls = "allocated";
          style = absl::StrCat("fill=\"", color, "\"");
          break;
        case BlockState::kPendingFree:
          cls = "pending-free";
          style =
              absl::StrCat("fill=\"", color, "\" fill-opacity=\"0.35\" ",
                           "stroke=\"", color, "\" stroke-dasharray=\"3,2\"");
          break;
        case BlockState::kFree:
          cls = "free";
          style = absl::StrCat("fill=\"", kFreeColor, "\"");
          break;
      }
      absl::StrAppendFormat(
          &out,
          "<rect class=\"block %s\" x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" "
          "height=\"%.1f\" %s><title>%s %s%s%s</title></rect>\n",
          cls, bx, y + 1, bw, row_h - 2, style, cls,
          XmlEscape(HumanBytes(static_cast<double>(b.size))),
          model.empty() ? "" : " ", XmlEscape(model));
    }
    // Segment outline.
    absl::StrAppendFormat(
        &out,
        "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" "
        "height=\"%.1f\" fill=\"none\" stroke=\"#888\" "
        "stroke-width=\"0.5\"/>\n</g>\n",
        plot_x, y + 1,
        std::max(1.0, static_cast<double>(extent[shown[r]]) * scale),
        row_h - 2);
  }

  // X axis: offset in the segment.
  const double axis_y = top + rows_h + 2;
  absl::StrAppendFormat(&out,
                        "<g class=\"axis x-axis\"><line x1=\"%.1f\" "
                        "y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                        "stroke=\"#333\"/>\n",
                        plot_x, axis_y, plot_x + plot_w, axis_y);
  const auto [unit_scale, unit] = ByteUnit(static_cast<double>(max_size));
  const double span = static_cast<double>(max_size) / unit_scale;
  if (max_size > 0) {
    const double step = NiceStep(span, 5);
    for (double v = 0; v <= span + 1e-9; v += step) {
      const double x = plot_x + v * unit_scale * scale;
      absl::StrAppendFormat(&out,
                            "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" "
                            "y2=\"%.1f\" stroke=\"#333\"/>",
                            x, axis_y, x, axis_y + 4);
      Text(out, x, axis_y + 15, Num(v), 10, "middle");
    }
  }
  Text(out, plot_x + plot_w / 2, axis_y + 30,
       absl::StrCat("offset in segment (", unit, ")"), 11, "middle",
       "class=\"axis-label\" ");
  out += "</g>\n";
  if (hidden > 0) {
    Text(out, plot_x, axis_y + 46,
         absl::StrCat("+ ", hidden, " smaller segments not shown (",
                      HumanBytes(static_cast<double>(hidden_bytes)), ")"),
         11, "start", "fill=\"#444\" ");
  }
  out += "</g>\n";
}

void DrawPlot(std::string& out, const SvgPlot& plot, const Box& box,
              Palette& series_palette) {
  out += "<g class=\"plot\">\n";
  Text(out, box.x, box.y + 14, plot.title, 14, "start",
       "font-weight=\"bold\" ");
  const double left = box.x + 60;
  const double right = box.x + box.w - 10;
  const double top = box.y + 28;
  const double bottom = box.y + box.h - 62;
  double x_min = 0, x_max = 0, y_max = plot.y_max;
  bool any = false;
  // Stacked plots: the top of each solid series, point by point.
  std::vector<std::vector<std::pair<double, double>>> tops;
  if (plot.stacked) {
    std::vector<std::pair<double, double>> sum;
    for (const SvgSeries& s : plot.series) {
      if (s.dashed) continue;
      if (sum.size() < s.points.size()) {
        for (std::size_t k = sum.size(); k < s.points.size(); ++k) {
          sum.emplace_back(s.points[k].first, 0.0);
        }
      }
      for (std::size_t k = 0; k < s.points.size(); ++k) {
        sum[k].second += std::max(0.0, s.points[k].second);
      }
      tops.push_back(sum);
    }
  }
  auto extend = [&](const std::vector<std::pair<double, double>>& points) {
    for (const auto& [x, y] : points) {
      if (!any) {
        x_min = x_max = x;
        any = true;
      }
      x_min = std::min(x_min, x);
      x_max = std::max(x_max, x);
      if (plot.y_max <= 0) y_max = std::max(y_max, y);
    }
  };
  for (const auto& top : tops) extend(top);
  for (const SvgSeries& s : plot.series) {
    if (!plot.stacked || s.dashed) extend(s.points);
  }
  if (x_max <= x_min) x_max = x_min + 1;
  const double y_step = NiceStep(y_max > 0 ? y_max : 1, 5);
  if (plot.y_max <= 0)
    y_max = std::max(1.0, std::ceil(y_max / y_step)) * y_step;
  if (y_max <= 0) y_max = 1;
  auto px = [&](double x) {
    return left + (x - x_min) / (x_max - x_min) * (right - left);
  };
  auto py = [&](double y) { return bottom - y / y_max * (bottom - top); };

  // Y axis with gridlines.
  out += "<g class=\"axis y-axis\">\n";
  for (double v = 0; v <= y_max + 1e-9; v += y_step) {
    absl::StrAppendFormat(&out,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" "
                          "y2=\"%.1f\" stroke=\"#e4e4e4\"/>",
                          left, py(v), right, py(v));
    Text(out, left - 6, py(v) + 4, Num(v), 10, "end");
  }
  absl::StrAppendFormat(&out,
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" "
                        "y2=\"%.1f\" stroke=\"#333\"/>\n",
                        left, top, left, bottom);
  Text(out, box.x + 14, (top + bottom) / 2, plot.y_label, 11, "middle",
       absl::StrFormat("class=\"axis-label\" transform=\"rotate(-90 %.1f "
                       "%.1f)\" ",
                       box.x + 14, (top + bottom) / 2));
  out += "</g>\n<g class=\"axis x-axis\">\n";
  absl::StrAppendFormat(&out,
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" "
                        "y2=\"%.1f\" stroke=\"#333\"/>\n",
                        left, bottom, right, bottom);
  const double x_step = NiceStep(x_max - x_min, 6);
  for (double v = std::ceil(x_min / x_step) * x_step; v <= x_max + 1e-9;
       v += x_step) {
    absl::StrAppendFormat(&out,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" "
                          "y2=\"%.1f\" stroke=\"#333\"/>",
                          px(v), bottom, px(v), bottom + 4);
    Text(out, px(v), bottom + 16, Num(v), 10, "middle");
  }
  Text(out, (left + right) / 2, bottom + 32, plot.x_label, 11, "middle",
       "class=\"axis-label\" ");
  out += "</g>\n";

  // Series and their key.
  double key_x = left;
  std::vector<const SvgSeries*> order;
  for (const SvgSeries& s : plot.series) order.push_back(&s);
  std::stable_partition(order.begin(), order.end(),
                        [](const SvgSeries* s) { return !s->dashed; });
  // A swatch (a line: 4 px high; an area: 8 px) and the name.
  auto key = [&](const std::string& name, const std::string& color,
                 int height) {
    absl::StrAppendFormat(&out,
                          "<rect x=\"%.1f\" y=\"%.1f\" width=\"14\" "
                          "height=\"%d\" fill=\"%s\"/>",
                          key_x, bottom + 50 - 2 - height, height, color);
    Text(out, key_x + 18, bottom + 50, name, 11);
    key_x += 30 + 7.0 * static_cast<double>(name.size());
  };
  Palette area_palette;
  std::size_t area = 0;
  for (const SvgSeries* sp : order) {
    const SvgSeries& s = *sp;
    if (plot.stacked && !s.dashed) {
      // The area between the previous top and this one.
      const std::string& color = area_palette.Color(s.name);
      const auto& top = tops[area];
      std::string d;
      for (const auto& [x, y] : top) {
        absl::StrAppendFormat(&d, "%s%.1f,%.1f ", d.empty() ? "M" : "L", px(x),
                              py(std::min(y, y_max)));
      }
      if (area == 0) {
        for (auto it = top.rbegin(); it != top.rend(); ++it) {
          absl::StrAppendFormat(&d, "L%.1f,%.1f ", px(it->first), py(0));
        }
      } else {
        const auto& below = tops[area - 1];
        for (std::size_t k = top.size(); k-- > 0;) {
          const double y = k < below.size() ? below[k].second : 0.0;
          absl::StrAppendFormat(&d, "L%.1f,%.1f ", px(top[k].first),
                                py(std::min(y, y_max)));
        }
      }
      ++area;
      absl::StrAppendFormat(
          &out,
          "<path class=\"series stacked-area\" data-name=\"%s\" d=\"%sZ\" "
          "fill=\"%s\" fill-opacity=\"0.85\" stroke=\"%s\" "
          "stroke-width=\"0.5\"/>\n",
          XmlEscape(s.name), d, color, color);
      key(s.name, color, 8);
      continue;
    }
    const std::string& color = series_palette.Color(s.name);
    std::string d;
    for (const auto& [x, y] : s.points) {
      absl::StrAppendFormat(&d, "%s%.1f,%.1f ", d.empty() ? "M" : "L", px(x),
                            py(std::min(y, y_max)));
    }
    absl::StrAppendFormat(
        &out,
        "<path class=\"series\" data-name=\"%s\" d=\"%s\" "
        "fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s/>\n",
        XmlEscape(s.name), d, color,
        s.dashed ? " stroke-dasharray=\"6,4\"" : "");
    key(s.name, color, 4);
  }
  out += "</g>\n";
}

void DrawLegend(std::string& out, double x, double y, Palette& palette) {
  out += "<g class=\"legend\">\n";
  Text(out, x, y + 11, "blocks:", 12, "start", "font-weight=\"bold\" ");
  double cx = x + 55;
  struct Item {
    const char* name;
    std::string style;
  };
  const Item states[] = {
      {"allocated (model colour)", "fill=\"#1f77b4\""},
      {"pending free (waits for a stream)",
       "fill=\"#1f77b4\" fill-opacity=\"0.35\" stroke=\"#1f77b4\" "
       "stroke-dasharray=\"3,2\""},
      {"free, cached (unmapped virtual space is not drawn)",
       absl::StrCat("fill=\"", kFreeColor, "\"")},
  };
  for (const Item& item : states) {
    absl::StrAppendFormat(&out,
                          "<rect class=\"legend-state\" x=\"%.1f\" "
                          "y=\"%.1f\" width=\"14\" height=\"12\" %s/>",
                          cx, y, item.style);
    Text(out, cx + 18, y + 11, item.name, 12);
    cx += 30 + 6.4 * static_cast<double>(std::string(item.name).size());
  }
  y += 20;
  Text(out, x, y + 11, "models:", 12, "start", "font-weight=\"bold\" ");
  cx = x + 55;
  std::vector<std::string> models = palette.order();
  std::sort(models.begin(), models.end());
  for (const std::string& model : models) {
    absl::StrAppendFormat(&out,
                          "<rect class=\"legend-model\" x=\"%.1f\" y=\"%.1f\" "
                          "width=\"14\" height=\"12\" fill=\"%s\"/>",
                          cx, y, palette.Color(model));
    Text(out, cx + 18, y + 11, model, 12);
    cx += 30 + 6.8 * static_cast<double>(model.size());
  }
  if (palette.order().empty()) Text(out, cx, y + 11, "(none)", 12);
  out += "</g>\n";
}

}  // namespace

std::string PaletteColor(int index) {
  if (index < 0) index = -index;
  return kPalette[index % kPaletteSize];
}

std::string XmlEscape(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // Control characters are not allowed in XML 1.0 text.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t') {
          out += ' ';
        } else {
          out += c;
        }
    }
  }
  return out;
}

std::string RenderMemoryMapSvg(const std::vector<MemoryMapPanel>& panels,
                               const std::vector<SvgPlot>& plots,
                               const SvgOptions& options) {
  const double width = std::max(options.width, 400);
  const double margin = 20;
  Palette palette;
  // Assign model colours in panel order so the legend reads left to right.
  for (const MemoryMapPanel& p : panels) {
    for (const auto& [stream, model] : p.stream_models) palette.Color(model);
    for (const auto& [ptr, model] : p.block_models) palette.Color(model);
  }

  std::size_t max_rows = 1;
  for (const MemoryMapPanel& p : panels) {
    max_rows = std::max(max_rows,
                        std::min<std::size_t>(p.snapshot.segments.size(),
                                              std::max(options.max_rows, 1)));
  }
  const double header_h = options.subtitle.empty() ? 40 : 58;
  // The block legend explains the memory-map panels: plots alone (each
  // with its own key) have none.
  const double legend_h = panels.empty() ? 0 : 46;
  const double panel_h =
      panels.empty()
          ? 0
          : 48 + static_cast<double>(max_rows) * options.row_height + 64;
  const double plots_h = plots.empty() ? 0 : options.plot_height + 10;
  const double height = margin + header_h + legend_h + panel_h + plots_h + 10;

  std::string body;
  const double panels_top = margin + header_h + legend_h;
  if (!panels.empty()) {
    const double col_w =
        (width - 2 * margin) / static_cast<double>(panels.size());
    for (std::size_t i = 0; i < panels.size(); ++i) {
      DrawPanel(body, panels[i],
                Box{margin + static_cast<double>(i) * col_w, panels_top,
                    col_w - 10, panel_h},
                options, palette);
    }
  }
  Palette series_palette(/*series=*/true);
  if (!plots.empty()) {
    const double plots_top = panels_top + panel_h;
    const double col_w =
        (width - 2 * margin) / static_cast<double>(plots.size());
    for (std::size_t i = 0; i < plots.size(); ++i) {
      DrawPlot(body, plots[i],
               Box{margin + static_cast<double>(i) * col_w, plots_top,
                   col_w - 20, static_cast<double>(options.plot_height)},
               series_palette);
    }
  }

  std::string out;
  absl::StrAppendFormat(
      &out,
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" "
      "width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
      width, height, width, height);
  Text(out, margin, margin + 18, options.title, 20, "start",
       "font-weight=\"bold\" class=\"title\" ");
  if (!options.subtitle.empty()) {
    Text(out, margin, margin + 38, options.subtitle, 12, "start",
         "fill=\"#444\" ");
  }
  if (!panels.empty()) DrawLegend(out, margin, margin + header_h, palette);
  out += body;
  out += "</svg>\n";
  return out;
}

}  // namespace ctxpool
