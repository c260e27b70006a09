// Internal helpers of the stats area.
#pragma once

#include <string>
#include <vector>

#include "leanstep/stats.h"

namespace leanstep::stats {

// Throws Error naming both places when a (run, rank, step) appears twice.
void check_unique_records(const std::vector<StepRecord>& records);

double mean_of(const std::vector<double>& v);
double median_of(std::vector<double> v);  // mean of the middle two for even counts
double stddev_of(const std::vector<double>& v);  // sample standard deviation (n - 1)
// Linear-interpolation percentile (q in [0, 1]) of sorted values.
double percentile_sorted(const std::vector<double>& sorted, double q);

// "3 (40, 41, 57)" style lists, shortened after `limit` items.
// `total` (when larger than steps.size()) is the full count of which `steps` lists the first.
std::string list_steps(const std::vector<int64_t>& steps, size_t limit = 8, int64_t total = 0);
std::string format_seconds(double s);    // "12.345 ms" / "1.234 s"
std::string format_percent(double x);    // "+12.34%"

// Plot model shared by the SVG writers.
struct PlotSeries {
  std::string label;
  std::string color;
  std::vector<double> x, y;  // a gap in x (step > previous + 1) breaks the line
  bool markers = false;
};
struct PlotPanel {
  std::string title;
  std::vector<PlotSeries> series;
  std::vector<double> boundaries;                 // vertical dashed lines (x)
  std::vector<std::pair<double, double>> shaded;  // warm-up spans [x0, x1)
  std::vector<std::pair<double, double>> light;   // excluded transition spans
  std::vector<std::pair<std::string, double>> hlines;  // labelled horizontal lines (y)
};
struct PlotLegendItem {
  std::string label, color;
};
void write_svg_figure(const std::string& path, const std::string& title, const std::string& subtitle,
                      const std::vector<PlotPanel>& panels, const std::vector<PlotLegendItem>& legend);
const std::vector<std::string>& palette();

}  // namespace leanstep::stats
