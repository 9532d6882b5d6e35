#!/usr/bin/env python3
"""Loss curves of several training runs in one SVG picture.

    bench/plot_runs.py --out curves.svg LABEL=RUN_DIR [LABEL=RUN_DIR ...]

Each RUN_DIR holds the metrics.jsonl `deepseek train` writes; the picture
shows each run's training lm_loss (a thin line) and eval_loss (dots joined by
a thick line, dashed after the first run) against the step, on shared axes.
Standard library only.
"""
import argparse
import json
import os
import sys

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def read_run(path):
    train, evals = [], []
    with open(os.path.join(path, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            if isinstance(m.get("lm_loss"), (int, float)):
                train.append((m["step"], m["lm_loss"]))
            if "eval_loss" in m:
                evals.append((m["step"], m["eval_loss"]))
    if not train:
        sys.exit(f"error: {path}/metrics.jsonl has no lm_loss")
    return train, evals


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the SVG file to write")
    ap.add_argument("--title", default="", help="a line above the plot")
    ap.add_argument("runs", nargs="+", help="LABEL=RUN_DIR")
    args = ap.parse_args(argv)
    runs = []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            ap.error(f"{spec}: expected LABEL=RUN_DIR")
        runs.append((label, *read_run(path)))
    W, H, L, R, T, B = 720, 420, 60, 170, 30, 40
    pts = [p for _, tr, ev in runs for p in tr + ev]
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1e-9)
    sx = lambda x: L + (x - x0) / (x1 - x0) * (W - L - R)
    sy = lambda y: T + (y1 - y) / (y1 - y0) * (H - T - B)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="18">{args.title}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>']
    for i in range(5):
        y = y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{L - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
        x = x0 + (x1 - x0) * i / 4
        out.append(f'<text x="{sx(x):.1f}" y="{H - B + 16}" text-anchor="middle">{x:.0f}</text>')
    out.append(f'<text x="{(L + W - R) / 2}" y="{H - 6}" text-anchor="middle">step</text>')
    for n, (label, tr, ev) in enumerate(runs):
        c = COLORS[n % len(COLORS)]
        line = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in tr)
        out.append(f'<polyline points="{line}" fill="none" stroke="{c}" stroke-width="0.8" opacity="0.6"/>')
        if ev:
            line = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in ev)
            dash = ' stroke-dasharray="8,4"' if n else ""  # overlapping curves stay apart
            out.append(f'<polyline points="{line}" fill="none" stroke="{c}" stroke-width="2.5"{dash}/>')
            out += [f'<circle cx="{sx(s):.1f}" cy="{sy(v):.1f}" r="3" fill="{c}"/>' for s, v in ev]
        last = f", eval {ev[-1][1]:.4f}" if ev else ""
        out.append(f'<text x="{W - R + 10}" y="{T + 16 + 18 * n}" fill="{c}">{label}{last}</text>')
    out.append("</svg>")
    with open(args.out, "w") as f:
        f.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
