#!/usr/bin/env bash
# Compares raw sgemm throughput of OpenBLAS, BLIS, oneDNN and LIBXSMM on this
# machine (installs the libraries it needs from Debian). Usage:
#   bench/blas_compare.sh            # OMP_NUM_THREADS defaults to all cores
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pkgs=(libopenblas-dev libblis-dev libdnnl-dev libxsmm-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
inc=/usr/include/x86_64-linux-gnu
lib=/usr/lib/x86_64-linux-gnu
cxx=(g++ -O2 -std=c++20 -fopenmp "$here/blas_compare.cc")
"${cxx[@]}" -DUSE_OPENBLAS -I"$inc/openblas-pthread" -o "$out/openblas" "$lib/openblas-pthread/libopenblas.so"
"${cxx[@]}" -DUSE_BLIS -I"$inc/blis-openmp" -o "$out/blis" "$lib/blis-openmp/libblis.so"
"${cxx[@]}" -DUSE_DNNL -o "$out/dnnl" -ldnnl
# LIBXSMM falls back to a BLAS above its small-matrix threshold; give it OpenBLAS.
"${cxx[@]}" -DUSE_XSMM -o "$out/xsmm" /usr/lib/libxsmm.a "$lib/openblas-pthread/libopenblas.so" -lpthread -ldl -lrt
grep -m1 "model name" /proc/cpuinfo || true
for b in openblas blis dnnl xsmm; do "$out/$b"; done
