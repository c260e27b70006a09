// Hand-written SVG plots: step duration against step index, warm-up shaded, block
// boundaries dashed, one panel per run for crossovers. No dependencies; the output is
// plain SVG 1.1 that browsers and rsvg render alike.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>

#include "leanstep/core.h"
#include "leanstep/stats.h"
#include "stats/util.h"

namespace leanstep::stats {

namespace {

std::string esc(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// Tick positions at 1, 2, 2.5 or 5 x 10^k covering [lo, hi] with about `target` ticks.
std::vector<double> nice_ticks(double lo, double hi, int target) {
  if (!(hi > lo)) return {lo};
  const double raw = (hi - lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  std::vector<double> ticks;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push_back(std::fabs(t) < step * 1e-9 ? 0 : t);
  return ticks;
}

std::string tick_label(double v, double step) {
  const int decimals = step >= 1 ? 0 : static_cast<int>(std::ceil(-std::log10(step) - 1e-9));
  return fmt::format("{:.{}f}", v, std::min(decimals, 6));
}

}  // namespace

const std::vector<std::string>& palette() {
  // Okabe-Ito, readable for colour-blind readers, then a few extra distinct colours.
  static const std::vector<std::string> k = {"#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00",
                                             "#56B4E9", "#F0E442", "#000000", "#7F3C8D", "#11A579"};
  return k;
}

void write_svg_figure(const std::string& path, const std::string& title, const std::string& subtitle,
                      const std::vector<PlotPanel>& panels, const std::vector<PlotLegendItem>& legend) {
  const int columns = panels.size() > 4 ? 2 : 1;
  const int rows = static_cast<int>((panels.size() + columns - 1) / columns);
  const double width = columns == 1 ? 980 : 1180;
  const double panel_h = panels.size() == 1 ? 360 : (panels.size() <= 4 ? 220 : 190);
  const double top = 86, gap = 26, left = 74, right = 22, bottom_axis = 34;
  const double cell_w = (width - 20) / columns;
  const double height = top + rows * (panel_h + gap) + 16;

  // Shared axes: x over every panel's data, y from the steps outside warm-up (warm-up
  // outliers would squash the rest; they are clipped and counted).
  double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
  for (const auto& p : panels) {
    for (const auto& s : p.series)
      for (size_t i = 0; i < s.x.size(); ++i) {
        xmin = std::min(xmin, s.x[i]);
        xmax = std::max(xmax, s.x[i]);
        bool in_warmup = false;
        for (const auto& [a, b] : p.shaded) in_warmup = in_warmup || (s.x[i] >= a && s.x[i] < b);
        if (in_warmup || !std::isfinite(s.y[i])) continue;
        ymin = std::min(ymin, s.y[i]);
        ymax = std::max(ymax, s.y[i]);
      }
  }
  if (!std::isfinite(xmin)) xmin = 0, xmax = 1;
  if (xmax <= xmin) xmax = xmin + 1;
  if (!std::isfinite(ymin)) {
    for (const auto& p : panels)
      for (const auto& s : p.series)
        for (double y : s.y)
          if (std::isfinite(y)) ymin = std::min(ymin, y), ymax = std::max(ymax, y);
  }
  if (!std::isfinite(ymin)) ymin = 0, ymax = 1;
  const double pad = std::max((ymax - ymin) * 0.08, std::fabs(ymax) * 0.01 + 1e-12);
  ymin -= pad;
  ymax += pad;
  if (ymin < 0 && ymax > 0 && ymin > -pad * 1.5) ymin = 0;
  const auto yticks = nice_ticks(ymin, ymax, 5);
  const auto xticks = nice_ticks(xmin, xmax, 8);
  const double ystep = yticks.size() > 1 ? yticks[1] - yticks[0] : 1;
  const double xstep = xticks.size() > 1 ? xticks[1] - xticks[0] : 1;

  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n",
      width, height);
  svg += fmt::format("<rect width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>\n", width, height);
  svg += fmt::format("<text x=\"20\" y=\"30\" font-size=\"18\" font-weight=\"bold\" fill=\"#222\">{}</text>\n", esc(title));
  svg += fmt::format("<text x=\"20\" y=\"50\" font-size=\"12\" fill=\"#555\">{}</text>\n", esc(subtitle));
  // Legend: series colours, then the marks.
  double lx = 20;
  const double ly = 70;
  for (const auto& item : legend) {
    svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"14\" height=\"4\" rx=\"1\" fill=\"{}\"/>\n", lx, ly - 6, item.color);
    svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"12\" fill=\"#333\">{}</text>\n", lx + 19, ly, esc(item.label));
    lx += 19 + 7.2 * static_cast<double>(item.label.size()) + 18;
  }
  bool any_shaded = false, any_boundary = false, any_light = false;
  for (const auto& p : panels) {
    any_shaded = any_shaded || !p.shaded.empty();
    any_boundary = any_boundary || !p.boundaries.empty();
    any_light = any_light || !p.light.empty();
  }
  if (any_shaded) {
    svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"14\" height=\"10\" fill=\"#000\" fill-opacity=\"0.09\"/>\n", lx, ly - 9);
    svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"12\" fill=\"#333\">warm-up</text>\n", lx + 19, ly);
    lx += 90;
  }
  if (any_boundary) {
    svg += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#666\" stroke-dasharray=\"4 3\"/>\n", lx + 7, ly - 11, ly + 2);
    svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"12\" fill=\"#333\">block boundary</text>\n", lx + 19, ly);
    lx += 130;
  }
  if (any_light) {
    svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"14\" height=\"10\" fill=\"#E69F00\" fill-opacity=\"0.10\"/>\n", lx, ly - 9);
    svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"12\" fill=\"#333\">excluded at block start</text>\n", lx + 19, ly);
  }

  for (size_t pi = 0; pi < panels.size(); ++pi) {
    const auto& p = panels[pi];
    const double ox = 10 + static_cast<double>(pi % columns) * cell_w;
    const double oy = top + static_cast<double>(pi / columns) * (panel_h + gap);
    const double x0 = ox + left, x1 = ox + cell_w - right;
    const double y0 = oy + 18, y1 = oy + panel_h - bottom_axis;
    auto X = [&](double x) { return x0 + (x - xmin) / (xmax - xmin) * (x1 - x0); };
    auto Y = [&](double y) { return y1 - (y - ymin) / (ymax - ymin) * (y1 - y0); };
    const std::string clip = fmt::format("clip{}", pi);
    svg += fmt::format("<clipPath id=\"{}\"><rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\"/></clipPath>\n", clip, x0,
                       y0, x1 - x0, y1 - y0);
    svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"13\" font-weight=\"bold\" fill=\"#333\">{}</text>\n", x0,
                       oy + 12, esc(p.title));
    svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#fafafa\" stroke=\"#ccc\"/>\n", x0, y0,
                       x1 - x0, y1 - y0);
    for (const auto& [a, b] : p.light)
      svg += fmt::format("<rect x=\"{:.2f}\" y=\"{}\" width=\"{:.2f}\" height=\"{}\" fill=\"#E69F00\" fill-opacity=\"0.10\" clip-path=\"url(#{})\"/>\n",
                         X(a - 0.5), y0, X(b - 0.5) - X(a - 0.5), y1 - y0, clip);
    for (const auto& [a, b] : p.shaded) {
      svg += fmt::format("<rect x=\"{:.2f}\" y=\"{}\" width=\"{:.2f}\" height=\"{}\" fill=\"#000\" fill-opacity=\"0.09\" clip-path=\"url(#{})\"/>\n",
                         X(a - 0.5), y0, X(b - 0.5) - X(a - 0.5), y1 - y0, clip);
      svg += fmt::format("<text x=\"{:.2f}\" y=\"{}\" font-size=\"10\" fill=\"#666\" stroke=\"#fff\" stroke-width=\"3\" paint-order=\"stroke\">warm-up</text>\n",
                         std::max(X(a - 0.5), x0) + 3, y0 + 24);
    }
    for (double t : yticks) {
      svg += fmt::format("<line x1=\"{}\" y1=\"{:.2f}\" x2=\"{}\" y2=\"{:.2f}\" stroke=\"#e4e4e4\"/>\n", x0, Y(t), x1, Y(t));
      svg += fmt::format("<text x=\"{}\" y=\"{:.2f}\" font-size=\"11\" fill=\"#555\" text-anchor=\"end\">{}</text>\n",
                         x0 - 6, Y(t) + 4, tick_label(t, ystep));
    }
    for (double t : xticks) {
      svg += fmt::format("<line x1=\"{0:.2f}\" y1=\"{1}\" x2=\"{0:.2f}\" y2=\"{2}\" stroke=\"#999\"/>\n", X(t), y1, y1 + 4);
      svg += fmt::format("<text x=\"{:.2f}\" y=\"{}\" font-size=\"11\" fill=\"#555\" text-anchor=\"middle\">{}</text>\n",
                         X(t), y1 + 16, tick_label(t, xstep));
    }
    for (double b : p.boundaries)
      svg += fmt::format("<line x1=\"{0:.2f}\" y1=\"{1}\" x2=\"{0:.2f}\" y2=\"{2}\" stroke=\"#666\" stroke-dasharray=\"4 3\"/>\n",
                         X(b - 0.5), y0, y1);
    size_t above = 0;
    for (const auto& s : p.series) {
      std::string points;
      auto flush = [&]() {
        if (!points.empty())
          svg += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" stroke-linejoin=\"round\" "
                             "points=\"{}\" clip-path=\"url(#{})\"/>\n",
                             s.color, points, clip);
        points.clear();
      };
      for (size_t i = 0; i < s.x.size(); ++i) {
        if (i > 0 && s.x[i] > s.x[i - 1] + 1) flush();
        if (!std::isfinite(s.y[i])) {
          flush();
          continue;
        }
        if (s.y[i] > ymax) ++above;
        points += fmt::format("{:.2f},{:.2f} ", X(s.x[i]), Y(s.y[i]));
      }
      flush();
      if (s.markers)
        for (size_t i = 0; i < s.x.size(); ++i)
          if (std::isfinite(s.y[i]))
            svg += fmt::format("<circle cx=\"{:.2f}\" cy=\"{:.2f}\" r=\"1.8\" fill=\"{}\" clip-path=\"url(#{})\"/>\n",
                               X(s.x[i]), Y(s.y[i]), s.color, clip);
    }
    for (const auto& [label, y] : p.hlines) {
      if (!std::isfinite(y)) continue;
      svg += fmt::format("<line x1=\"{}\" y1=\"{:.2f}\" x2=\"{}\" y2=\"{:.2f}\" stroke=\"#333\" stroke-width=\"0.8\" stroke-dasharray=\"2 2\"/>\n",
                         x0, Y(y), x1, Y(y));
      svg += fmt::format("<text x=\"{}\" y=\"{:.2f}\" font-size=\"10\" fill=\"#333\" text-anchor=\"end\" stroke=\"#fff\" stroke-width=\"3\" paint-order=\"stroke\">{}</text>\n",
                         x1 - 4, Y(y) - 3, esc(label));
    }
    if (above)
      svg += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"10\" fill=\"#a33\" text-anchor=\"end\">{} point(s) above the axis</text>\n",
                         x1 - 4, y0 + 11, above);
    svg += fmt::format("<text x=\"{}\" y=\"{:.2f}\" font-size=\"11\" fill=\"#555\" text-anchor=\"middle\" "
                       "transform=\"rotate(-90 {} {:.2f})\">step duration (ms)</text>\n",
                       ox + 16, (y0 + y1) / 2, ox + 16, (y0 + y1) / 2);
    if (pi + columns >= panels.size())
      svg += fmt::format("<text x=\"{:.2f}\" y=\"{}\" font-size=\"11\" fill=\"#555\" text-anchor=\"middle\">step (position in run)</text>\n",
                         (x0 + x1) / 2, y1 + 30);
  }
  svg += "</svg>\n";
  std::ofstream out(path);
  if (!out) throw Error(fmt::format("plot: cannot open '{}' for writing", path));
  out << svg;
  if (!out) throw Error(fmt::format("plot: writing '{}' failed", path));
}

namespace {

// Positions where the block (or the condition) changes: block boundaries.
std::vector<double> boundaries_of(const StepSeries& s) {
  std::vector<double> out;
  for (size_t i = 1; i < s.steps.size(); ++i) {
    const bool block_change = s.block[i] >= 0 && s.block[i - 1] >= 0 ? s.block[i] != s.block[i - 1]
                                                                      : s.condition[i] != s.condition[i - 1];
    if (block_change) out.push_back(static_cast<double>(s.steps[i] - s.first_step));
  }
  return out;
}

PlotSeries series_of(const StepSeries& s, const std::string& label, const std::string& color) {
  PlotSeries p;
  p.label = label;
  p.color = color;
  for (size_t i = 0; i < s.steps.size(); ++i) {
    p.x.push_back(static_cast<double>(s.steps[i] - s.first_step));
    p.y.push_back(s.duration_s[i] * 1e3);
  }
  p.markers = s.steps.size() <= 400;
  return p;
}

}  // namespace

void plot_summary(const std::string& svg_path, const std::vector<StepSeries>& series, int64_t warmup) {
  PlotPanel panel;
  panel.title = "step duration (max over ranks) per run";
  std::vector<PlotLegendItem> legend;
  std::set<double> boundaries;
  for (size_t i = 0; i < series.size(); ++i) {
    const auto& color = palette()[i % palette().size()];
    panel.series.push_back(series_of(series[i], series[i].run, color));
    legend.push_back({series[i].run, color});
    for (double b : boundaries_of(series[i])) boundaries.insert(b);
    if (series.size() <= 3) {
      const RunSummary r = summarize_series(series[i], warmup, 1);
      panel.hlines.emplace_back(fmt::format("{} mean {:.3f} ms", series[i].run, r.mean_s * 1e3), r.mean_s * 1e3);
    }
  }
  panel.boundaries.assign(boundaries.begin(), boundaries.end());
  if (warmup > 0) panel.shaded.emplace_back(0, static_cast<double>(warmup));
  write_svg_figure(svg_path, "leanstep steps summarize",
                   fmt::format("{} run(s); warm-up {} step(s); dashed: means after warm-up", series.size(), warmup),
                   {panel}, legend);
}

void plot_comparison(const std::string& svg_path, const StepSeries& old_series, const StepSeries& new_series,
                     int64_t warmup) {
  PlotPanel panel;
  panel.title = fmt::format("old '{}' vs new '{}'", old_series.run, new_series.run);
  const std::string old_color = "#0072B2", new_color = "#D55E00";
  panel.series.push_back(series_of(old_series, "old", old_color));
  panel.series.push_back(series_of(new_series, "new", new_color));
  const RunSummary a = summarize_series(old_series, warmup, 1), b = summarize_series(new_series, warmup, 1);
  panel.hlines.emplace_back(fmt::format("old mean {:.3f} ms", a.mean_s * 1e3), a.mean_s * 1e3);
  panel.hlines.emplace_back(fmt::format("new mean {:.3f} ms", b.mean_s * 1e3), b.mean_s * 1e3);
  std::set<double> boundaries;
  for (double x : boundaries_of(old_series)) boundaries.insert(x);
  for (double x : boundaries_of(new_series)) boundaries.insert(x);
  panel.boundaries.assign(boundaries.begin(), boundaries.end());
  if (warmup > 0) panel.shaded.emplace_back(0, static_cast<double>(warmup));
  write_svg_figure(svg_path, "leanstep steps compare",
                   fmt::format("new/old - 1: mean {}, median {}; warm-up {} step(s)",
                               format_percent(b.mean_s / a.mean_s - 1), format_percent(b.median_s / a.median_s - 1),
                               warmup),
                   {panel}, {{"old: " + old_series.run, old_color}, {"new: " + new_series.run, new_color}});
}

void plot_crossover(const std::string& svg_path, const CrossoverResult& result) {
  std::vector<PlotPanel> panels;
  std::vector<PlotLegendItem> legend;
  auto color_of = [&](const std::string& c) {
    const auto it = std::find(result.conditions.begin(), result.conditions.end(), c);
    return palette()[static_cast<size_t>(it - result.conditions.begin()) % palette().size()];
  };
  for (const auto& c : result.conditions) legend.push_back({c, color_of(c)});
  constexpr size_t kMaxPanels = 16;
  for (size_t r = 0; r < result.series.size() && r < kMaxPanels; ++r) {
    const auto& s = result.series[r];
    PlotPanel panel;
    panel.title = s.run + (s.allocation.empty() ? "" : " (" + s.allocation + ")");
    // One line per contiguous stretch of a condition, coloured by condition.
    for (size_t i = 0; i < s.steps.size();) {
      size_t j = i;
      while (j < s.steps.size() && s.condition[j] == s.condition[i] && s.block[j] == s.block[i]) ++j;
      PlotSeries ps;
      ps.label = s.condition[i];
      ps.color = color_of(s.condition[i]);
      for (size_t k = i; k < j; ++k) {
        ps.x.push_back(static_cast<double>(s.steps[k] - s.first_step));
        ps.y.push_back(s.duration_s[k] * 1e3);
      }
      ps.markers = s.steps.size() <= 300;
      panel.series.push_back(std::move(ps));
      i = j;
    }
    panel.boundaries = boundaries_of(s);
    if (result.warmup > 0) panel.shaded.emplace_back(0, static_cast<double>(result.warmup));
    // Excluded: the first K steps of every block, block 0 counted from the end of warm-up.
    const double k = static_cast<double>(result.exclude_after_transition), w = static_cast<double>(result.warmup);
    if (k > 0) {
      panel.light.emplace_back(w, w + k);
      for (double b : panel.boundaries)
        if (b > w) panel.light.emplace_back(b, b + k);
    }
    panels.push_back(std::move(panel));
  }
  std::string subtitle = fmt::format("baseline '{}'; ", result.baseline);
  for (size_t i = 0; i < result.comparisons.size() && i < 3; ++i) {
    const auto& p = result.comparisons[i];
    subtitle += fmt::format("{} vs {}: {}; ", p.condition, p.versus, format_percent(p.reduction));
  }
  if (result.series.size() > kMaxPanels) subtitle += fmt::format("first {} of {} runs shown", kMaxPanels, result.series.size());
  write_svg_figure(svg_path, "leanstep crossover analyze: step duration per run, coloured by condition", subtitle,
                   panels, legend);
}

}  // namespace leanstep::stats

namespace leanstep::stats {

void plot_reductions(const std::string& svg_path, const CrossoverResult& result, const std::string& title) {
  // One row per (quantity, condition): the step first, then every field; a dot at the paired
  // reduction, a bar over its 95% interval (none below kMinIntervalRuns runs), zero dashed.
  struct Row {
    std::string group, condition;
    double reduction, low, high;
  };
  std::vector<Row> rows;
  for (const auto& p : result.comparisons)
    if (p.versus == result.baseline) rows.push_back({"step", p.condition, p.reduction, p.ci_low, p.ci_high});
  for (const auto& f : result.fields)
    for (const auto& p : f.comparisons) rows.push_back({f.field, p.condition, p.reduction, p.ci_low, p.ci_high});
  double lo = 0, hi = 0;
  for (const auto& r : rows)
    for (double v : {r.reduction, r.low, r.high})
      if (std::isfinite(v)) lo = std::min(lo, v * 100), hi = std::max(hi, v * 100);
  const double pad = std::max(1.0, (hi - lo) * 0.05);
  lo -= pad;
  hi += pad;
  const double row_h = 22, top = 78, left = 250, right = 110, width = 980;
  const double plot_w = width - left - right;
  const double height = top + row_h * static_cast<double>(rows.size() + 1) + 40;
  auto x_of = [&](double percent) { return left + (percent - lo) / (hi - lo) * plot_w; };
  auto color_of = [&](const std::string& c) {
    const auto it = std::find(result.conditions.begin(), result.conditions.end(), c);
    return palette()[static_cast<size_t>(it - result.conditions.begin()) % palette().size()];
  };
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
      width, height);
  svg += fmt::format("<text x=\"12\" y=\"24\" font-size=\"15\">{}</text>\n", esc(title));
  svg += fmt::format(
      "<text x=\"12\" y=\"44\" fill=\"#555\">paired reduction vs '{}' (positive = faster), 95% interval over runs; "
      "step = max over ranks</text>\n",
      esc(result.baseline));
  const double axis_y = top + row_h * static_cast<double>(rows.size()) + 6;
  const auto ticks = nice_ticks(lo, hi, 8);
  const double tick_step = ticks.size() > 1 ? ticks[1] - ticks[0] : 1;
  for (double t : ticks) {
    svg += fmt::format("<line x1=\"{0:.1f}\" x2=\"{0:.1f}\" y1=\"{1:.1f}\" y2=\"{2:.1f}\" stroke=\"#eee\"/>\n", x_of(t),
                       top - 6, axis_y);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" fill=\"#555\">{}%</text>\n", x_of(t),
                       axis_y + 16, tick_label(t, tick_step));
  }
  svg += fmt::format(
      "<line x1=\"{0:.1f}\" x2=\"{0:.1f}\" y1=\"{1:.1f}\" y2=\"{2:.1f}\" stroke=\"#333\" stroke-dasharray=\"4 3\"/>\n",
      x_of(0), top - 6, axis_y);
  std::string previous;
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const double y = top + row_h * static_cast<double>(i) + row_h / 2;
    if (r.group != previous) {
      if (i > 0)
        svg += fmt::format("<line x1=\"12\" x2=\"{:.0f}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#ccc\"/>\n",
                           width - 12, y - row_h / 2, y - row_h / 2);
      svg += fmt::format("<text x=\"12\" y=\"{:.1f}\" font-weight=\"bold\">{}</text>\n", y + 4, esc(r.group));
      previous = r.group;
    }
    const std::string color = color_of(r.condition);
    svg += fmt::format("<text x=\"{:.0f}\" y=\"{:.1f}\" text-anchor=\"end\" fill=\"{}\">{}</text>\n", left - 8, y + 4,
                       color, esc(r.condition));
    const bool interval = std::isfinite(r.low) && std::isfinite(r.high);
    if (interval)
      svg += fmt::format("<line x1=\"{:.1f}\" x2=\"{:.1f}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"{}\" stroke-width=\"3\"/>\n",
                         x_of(r.low * 100), x_of(r.high * 100), y, y, color);
    if (std::isfinite(r.reduction))
      svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4.5\" fill=\"{}\"/>\n", x_of(r.reduction * 100), y,
                         color);
    svg += fmt::format("<text x=\"{:.0f}\" y=\"{:.1f}\" fill=\"#333\">{}{}</text>\n", width - right + 8, y + 4,
                       std::isfinite(r.reduction) ? format_percent(r.reduction) : "n/a", interval ? "" : " (no CI)");
  }
  svg += "</svg>\n";
  std::FILE* f = std::fopen(svg_path.c_str(), "wb");
  if (!f) throw Error(fmt::format("plot: cannot open '{}' for writing", svg_path));
  const bool ok = std::fwrite(svg.data(), 1, svg.size(), f) == svg.size();
  if (std::fclose(f) != 0 || !ok) throw Error(fmt::format("plot: writing '{}' failed", svg_path));
}

}  // namespace leanstep::stats
