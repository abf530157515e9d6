// ctxpool/telemetry/svg.h — an SVG memory map of one or more allocators.
//
// RenderMemoryMapSvg() draws a picture a person reads without explanation:
//
//   * one panel per allocator snapshot (side by side, e.g. "today" and
//     "ctxpool"): every segment is a row, drawn to a common byte scale with
//     an x axis in MiB/GiB; its blocks are coloured by model (a palette per
//     tenant or session name) and by state — allocated: the model's colour;
//     pending free (freed, waiting for a stream): the model's colour, pale
//     and dashed; free (cached): light grey. Panels with more segments than
//     `max_rows` show the largest ones and say how many were left out.
//   * a legend of the states and the models;
//   * line plots under the panels, e.g. fragmentation over time, with
//     labelled axes and units.
//
//   MemoryMapPanel panel;
//   panel.title = "ctxpool: one context, shared cache";
//   panel.snapshot = gpu0->device_allocator().Snapshot();
//   panel.stream_models = {{bert->stream(0), "bert"}};
//   SvgPlot frag{.title = "External fragmentation",
//                .x_label = "trace event", .y_label = "fragmentation (%)",
//                .y_max = 100};
//   frag.series.push_back({.name = "ctxpool", .points = {{0, 0}, {10, 12}}});
//   std::ofstream("map.svg") << RenderMemoryMapSvg({panel}, {frag}, {});
//
// The output is a standalone SVG 1.1 document (UTF-8, no scripts, no
// external references); every text is XML-escaped. Elements carry classes a
// test can find: "panel", "segment-row", "block" (with "allocated",
// "pending-free" or "free"), "legend", "axis", "plot", "series".
//
// Thread-safety: pure functions of their arguments.
#ifndef CTXPOOL_TELEMETRY_SVG_H_
#define CTXPOOL_TELEMETRY_SVG_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/types.h"

namespace ctxpool {

// One allocator's memory at one moment.
struct MemoryMapPanel {
  std::string title;
  AllocatorSnapshot snapshot;
  // The model that owns each stream: a block belongs to the model of the
  // segment's stream unless `block_models` names another.
  std::vector<std::pair<StreamHandle, std::string>> stream_models;
  // Per-block owners (allocated blocks charged to a model).
  std::vector<std::pair<DevicePtr, std::string>> block_models;
  // A one-line caption under the title ("reserved 42.0 GiB, live 30.1 GiB").
  std::string caption;
};

// A line on a plot: (x, y) points in increasing x.
struct SvgSeries {
  std::string name;
  std::vector<std::pair<double, double>> points;
  bool dashed = false;  // drawn dashed, on top of the solid lines
};

struct SvgPlot {
  std::string title;
  std::string x_label;  // with its unit: "trace event (#)"
  std::string y_label;  // with its unit: "fragmentation (%)"
  // The y axis spans [0, y_max]; 0: the largest y rounded up.
  double y_max = 0;
  std::vector<SvgSeries> series;
  // Stacked: the solid series are filled areas, each on top of the ones
  // before it (the k-th point of every solid series shares one x; a series
  // with fewer points counts 0 where it has none), coloured by the model
  // palette; dashed series stay lines (a capacity line). Class
  // "stacked-area" on each area.
  bool stacked = false;
};

struct SvgOptions {
  std::string title = "ctxpool memory map";
  std::string subtitle;
  int width = 1400;       // pixels
  int max_rows = 32;      // segment rows per panel
  int row_height = 14;    // pixels
  int plot_height = 260;  // pixels
};

// The name's colour in the model palette ("#1f77b4"...): the same name gets
// the same colour within one rendering (assigned in order of first use).
// Exposed for tests: the palette has 10 distinct colours, then repeats.
std::string PaletteColor(int index);

// REQUIRES: nothing; empty panels and plots are drawn as empty frames.
std::string RenderMemoryMapSvg(const std::vector<MemoryMapPanel>& panels,
                               const std::vector<SvgPlot>& plots,
                               const SvgOptions& options = {});

// `text` with &, <, >, " and ' replaced by XML entities.
std::string XmlEscape(absl::string_view text);

}  // namespace ctxpool

#endif  // CTXPOOL_TELEMETRY_SVG_H_
