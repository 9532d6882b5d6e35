// The run folder's pictures: loss.svg and timeline.svg.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "io/atomic_file.h"
#include "train/trainer.h"

namespace ds::train {

void write_loss_svg(const std::string& path, const std::vector<std::pair<int64_t, double>>& train_loss,
                    const std::vector<std::pair<int64_t, double>>& eval_loss, const std::string& title) {
  const double W = 720, H = 420, L = 64, R = 20, T = 40, B = 48;
  double x0 = 0, x1 = 1, y0 = 1e300, y1 = -1e300;
  for (const auto* v : {&train_loss, &eval_loss})
    for (const auto& [s, l] : *v) {
      if (!std::isfinite(l)) continue;
      x1 = std::max(x1, static_cast<double>(s));
      y0 = std::min(y0, l);
      y1 = std::max(y1, l);
    }
  if (y0 > y1) y0 = 0, y1 = 1;
  if (y1 - y0 < 1e-9) y0 -= 0.5, y1 += 0.5;
  const double pad = 0.05 * (y1 - y0);
  y0 -= pad;
  y1 += pad;
  auto px = [&](double s) { return L + (s - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double l) { return T + (y1 - l) / (y1 - y0) * (H - T - B); };
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"22\" font-size=\"15\">{3}</text>\n",
      W, H, L, title);
  // Axes, ticks and grid.
  svg += fmt::format("<path d=\"M{0} {1} V{2} H{3}\" stroke=\"black\" fill=\"none\"/>\n", L, T, H - B, W - R);
  for (int i = 0; i <= 5; ++i) {
    const double l = y0 + (y1 - y0) * i / 5, y = py(l);
    svg += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>\n", L, y, W - R, y);
    svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.3g}</text>\n", L - 6, y + 4, l);
    const double s = x0 + (x1 - x0) * i / 5;
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:.0f}</text>\n", px(s), H - B + 18, s);
  }
  svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n", (L + W - R) / 2, H - 10);
  std::string d;
  for (const auto& [s, l] : train_loss)
    if (std::isfinite(l)) d += fmt::format("{}{:.1f} {:.1f}", d.empty() ? "M" : " L", px(double(s)), py(l));
  if (!d.empty()) svg += "<path d=\"" + d + "\" stroke=\"#1f77b4\" stroke-width=\"1.5\" fill=\"none\"/>\n";
  for (const auto& [s, l] : eval_loss)
    if (std::isfinite(l))
      svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"#d62728\"/>\n", px(double(s)), py(l));
  svg += fmt::format(
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"#1f77b4\" stroke-width=\"2\"/>"
      "<text x=\"{3}\" y=\"{4}\">train lm_loss</text>\n",
      W - 250, T + 6, W - 230, W - 224, T + 10);
  if (!eval_loss.empty())
    svg += fmt::format(
        "<circle cx=\"{}\" cy=\"{}\" r=\"3.5\" fill=\"#d62728\"/><text x=\"{}\" y=\"{}\">eval loss</text>\n", W - 110,
        T + 6, W - 100, T + 10);
  svg += "</svg>\n";
  io::write_file_atomic(path, svg);
}

void write_timeline_svg(const std::string& path, const std::vector<model::TimelineSpan>& spans, int64_t layer,
                        const std::string& title) {
  int parts = 0;
  double t_begin[2] = {1e300, 1e300}, t_end[2] = {0, 0};
  for (const auto& x : spans) {
    if (x.layer != layer) continue;
    parts = std::max(parts, x.part + 1);
    t_begin[x.backward] = std::min(t_begin[x.backward], x.t0);
    t_end[x.backward] = std::max(t_end[x.backward], x.t1);
  }
  const double W = 900, L = 150, R = 20, row = 34, panel_gap = 50, T = 50;
  const double span_ms = std::max({1e-6, (t_end[0] - t_begin[0]) * 1e3, (t_end[1] - t_begin[1]) * 1e3});
  const double H = T + 2 * (parts * row + panel_gap) + 30;
  auto px = [&](double ms) { return L + ms / span_ms * (W - L - R); };
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"10\" y=\"22\" font-size=\"15\">{2}</text>\n"
      "<rect x=\"{3}\" y=\"30\" width=\"14\" height=\"10\" fill=\"#1f77b4\"/><text x=\"{4}\" y=\"39\">compute</text>"
      "<rect x=\"{5}\" y=\"33\" width=\"14\" height=\"5\" fill=\"#ff7f0e\"/>"
      "<text x=\"{6}\" y=\"39\">expert exchange in flight</text>\n",
      W, H, title, W - 330, W - 312, W - 240, W - 222);
  for (int b = 0; b < 2; ++b) {
    const double y0 = T + b * (parts * row + panel_gap) + 20;
    svg +=
        fmt::format("<text x=\"10\" y=\"{:.0f}\" font-weight=\"bold\">{}</text>\n", y0 - 6, b ? "backward" : "forward");
    for (int p = 0; p < parts; ++p)
      svg += fmt::format("<text x=\"10\" y=\"{:.0f}\">micro-batch {}</text>\n", y0 + p * row + 18, p);
    for (int i = 0; i <= 4; ++i) {
      const double ms = span_ms * i / 4, x = px(ms);
      svg += fmt::format(
          "<line x1=\"{0:.1f}\" y1=\"{1:.0f}\" x2=\"{0:.1f}\" y2=\"{2:.0f}\" stroke=\"#ddd\"/>"
          "<text x=\"{0:.1f}\" y=\"{3:.0f}\" text-anchor=\"middle\">{4:.2f} ms</text>\n",
          x, y0, y0 + parts * row, y0 + parts * row + 14, ms);
    }
    for (const auto& x : spans) {
      if (x.layer != layer || x.backward != (b == 1)) continue;
      const double a = px((x.t0 - t_begin[b]) * 1e3), e = px((x.t1 - t_begin[b]) * 1e3);
      const double y = y0 + x.part * row + (x.computing ? 4 : 24);
      svg += fmt::format("<rect x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{}\" fill=\"{}\"/>\n", a, y,
                         std::max(0.5, e - a), x.computing ? 18 : 6, x.computing ? "#1f77b4" : "#ff7f0e");
    }
  }
  svg += "</svg>\n";
  io::write_file_atomic(path, svg);
}

}  // namespace ds::train
