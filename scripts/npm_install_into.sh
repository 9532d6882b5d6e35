# Sourced by the fetch scripts: `npm_install_into PREFIX WHO WHAT PACKAGE...`
# installs the packages from the npm registry into PREFIX (git-ignored),
# saying WHO did it and WHAT skips without them. Never fails: without npm or
# the network it says so and returns 0.
npm_install_into() {
  local prefix=$1 who=$2 what=$3
  shift 3
  if ! command -v npm >/dev/null 2>&1; then
    echo "$who: npm not found; $what" >&2
    return 0
  fi
  mkdir -p "$prefix"
  # A package.json of its own keeps npm from walking up into the repository.
  [ -f "$prefix/package.json" ] || echo '{"name": "deepseek-cpp-'"$who"'", "private": true}' >"$prefix/package.json"
  echo "$who: installing $* into $prefix"
  if ! (cd "$prefix" && timeout 300 npm install --no-audit --no-fund --ignore-scripts --no-package-lock \
          --fetch-retries=1 --fetch-retry-mintimeout=2000 --fetch-retry-maxtimeout=10000 --fetch-timeout=60000 \
          --loglevel=error "$@" >&2); then
    echo "$who: npm install failed; $what" >&2
  fi
  return 0
}
