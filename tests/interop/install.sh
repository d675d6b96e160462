#!/usr/bin/env bash
# Installs the npm packages of tests/interop (node-llama-cpp with only its prebuilt linux-x64 CPU binary) from
# package-lock.json. Idempotent: does nothing when node_modules already matches the lock file.
#   bash tests/interop/install.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
if ! command -v npm >/dev/null 2>&1; then
  echo "tests/interop/install.sh: npm not found; the llama.cpp interop test will be skipped" >&2
  exit 0
fi
stamp=node_modules/.merlin-lock.sha256
want=$(sha256sum package-lock.json | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" && -f node_modules/@node-llama-cpp/linux-x64/package.json ]]; then
  echo "tests/interop: node_modules up to date"
  exit 0
fi
# --omit=optional: node-llama-cpp lists every platform's binaries (CUDA, Vulkan: hundreds of MB) as optional; the
# CPU one is a direct dependency in package.json. Its postinstall (which could try to download or build llama.cpp)
# is not run: --ignore-scripts, and NODE_LLAMA_CPP_SKIP_DOWNLOAD for good measure.
# Not `npm ci`: its lock-file check wants entries for node-llama-cpp's macOS/Windows/riscv64 optional packages,
# which the registry does not serve at 3.22.1 (404), so no lock file can list them. `npm install --no-save`
# installs exactly the locked versions all the same and leaves package-lock.json untouched.
NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm install --no-save --omit=optional --ignore-scripts --no-audit --no-fund \
  --loglevel=error
echo "$want" > "$stamp"
echo "tests/interop: installed node-llama-cpp ($(du -sh node_modules | cut -f1))"
