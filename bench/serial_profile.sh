#!/usr/bin/env bash
# Where a generation step leaves threads idle: samples `deepseek bench` with
# perf's DWARF call graphs and splits the main thread's time inside
# Engine::step into
#   parallel  inside an OpenMP region (a GOMP_parallel frame), working;
#   waiting   in libgomp itself (starting or ending a team, at a barrier);
#   serial    outside every region: the other threads wait meanwhile;
# and each worker thread's samples into working and waiting. The serial
# samples are then listed by the innermost ds:: function on their stack.
# Usage:
#   bench/serial_profile.sh [BUILD_DIR] [deepseek bench options...]
# e.g. bench/serial_profile.sh build --batch 1 --prompt-len 128 --new-tokens 1 --repeat 30
# The model defaults to a random `small` checkpoint made in a temporary
# folder (pass --model DIR to use another). Needs Debian's linux-perf and
# python3; perf must be allowed to sample (kernel.perf_event_paranoid <= 2).
# Workers spin while waiting (OMP_WAIT_POLICY=active, the program's own
# default), so their waits are samples in libgomp rather than sleep.
# FREQ sets the sampling rate (default 2000 per second).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
[ $# -gt 0 ] && shift
bin="$build/deepseek"
[ -x "$bin" ] || { echo "error: $bin not found; build the project first (or pass BUILD_DIR)" >&2; exit 1; }
command -v perf >/dev/null || { echo "error: perf not found (apt-get install linux-perf)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "error: python3 not found" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
args=("$@")
if [[ " ${args[*]} " != *" --model "* ]]; then
  "$bin" init --config "$root/configs/small.yml" --out "$tmp/small" --seed 1 >/dev/null
  args=(--model "$tmp/small" "${args[@]}")
fi
[ ${#args[@]} -gt 2 ] || args+=(--batch 1 --prompt-len 128 --new-tokens 1 --repeat 30)

echo "perf record: deepseek bench ${args[*]}" >&2
OMP_WAIT_POLICY=active perf record -q --call-graph dwarf,16384 -F "${FREQ:-2000}" -o "$tmp/perf.data" \
  "$bin" bench "${args[@]}" >"$tmp/bench.json" 2>/dev/null
perf script -i "$tmp/perf.data" -F tid,ip,sym,dso 2>/dev/null >"$tmp/script.txt"
tail -n 1 "$tmp/bench.json"

python3 - "$tmp/script.txt" <<'PY'
import collections, sys

samples, cur = [], None
for line in open(sys.argv[1], errors="replace"):
    line = line.rstrip("\n")
    if not line.strip():
        if cur: samples.append(cur)
        cur = None
    elif not line[0].isspace():
        cur = {"tid": int(line.split()[0]), "frames": []}
    elif cur is not None:
        parts = line.strip().split(None, 1)
        rest = parts[1] if len(parts) > 1 else ""
        sym, _, dso = rest.rpartition(" (")
        cur["frames"].append((sym or rest, dso.rstrip(")")))
if cur: samples.append(cur)
if not samples: sys.exit("error: perf recorded no samples")

main = min(s["tid"] for s in samples)
in_step = lambda fr: any("Engine::step" in f for f, _ in fr)
gomp = lambda fr: bool(fr) and "libgomp" in fr[0][1]
kinds, serial = collections.Counter(), collections.Counter()
workers = collections.defaultdict(collections.Counter)
for s in samples:
    fr = s["frames"]
    if s["tid"] != main:
        workers[s["tid"]]["waiting" if gomp(fr) else "working"] += 1
        continue
    if not in_step(fr): continue
    if gomp(fr): kinds["waiting"] += 1
    elif any("GOMP_parallel" in f for f, _ in fr): kinds["parallel"] += 1
    else:
        kinds["serial"] += 1
        serial[next((f for f, _ in fr if f.startswith("ds::")), fr[0][0])[:100]] += 1
total = sum(kinds.values())
if total == 0: sys.exit("error: no main-thread samples inside Engine::step")
print(f"main thread inside Engine::step: {total} samples")
for k in ("parallel", "waiting", "serial"):
    print(f"  {k:9s} {100.0 * kinds[k] / total:5.1f}%")
for tid, c in sorted(workers.items()):
    n = sum(c.values())
    print(f"worker {tid}: {n} samples, waiting {100.0 * c['waiting'] / n:.1f}% (whole run)")
print("serial samples by innermost ds:: function (share of the main thread's step):")
for f, n in serial.most_common(15):
    print(f"  {100.0 * n / total:5.1f}%  {f}")
PY
