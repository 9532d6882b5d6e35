# Sourced by the llama.cpp comparison scripts: builds llama.cpp from the
# source npm's node-llama-cpp package bundles (version $version, default
# 3.22.1) once, in $cache (LLAMACPP_DIR, default ~/.cache/deepseek-llamacpp;
# never inside this repository), and sets $src (its source) and $lbin (its
# programs: llama-completion, llama-perplexity, llama-bench, llama-quantize).
version="${version:-${LLAMACPP_VERSION:-3.22.1}}"
cache="${cache:-${LLAMACPP_DIR:-$HOME/.cache/deepseek-llamacpp}}"
src="$cache/llama.cpp-$version"
lbin="$src/build/bin"
if [ ! -x "$lbin/llama-perplexity" ] || [ ! -x "$lbin/llama-quantize" ]; then
  mkdir -p "$cache"
  (cd "$cache" && npm pack "node-llama-cpp@$version" >/dev/null)
  tar -xzf "$cache/node-llama-cpp-$version.tgz" -C "$cache" package/llama/gitRelease.bundle
  rm -rf "$src"
  git clone -q "$cache/package/llama/gitRelease.bundle" "$src"
  cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
  cmake --build "$src/build" -j "$(nproc)" --target llama-completion llama-perplexity llama-bench llama-quantize \
    >/dev/null
fi
