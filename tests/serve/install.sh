#!/usr/bin/env bash
# Installs the npm packages of tests/serve (the official `openai` SDK, pinned by package-lock.json) for the
# server's integration tests. Idempotent: does nothing when node_modules already matches the lock file.
#   bash tests/serve/install.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
if ! command -v npm >/dev/null 2>&1; then
  echo "tests/serve/install.sh: npm not found; the server's OpenAI SDK tests will be skipped" >&2
  exit 0
fi
stamp=node_modules/.merlin-lock.sha256
want=$(sha256sum package-lock.json | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" && -f node_modules/openai/package.json ]]; then
  echo "tests/serve: node_modules up to date"
  exit 0
fi
npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
echo "$want" > "$stamp"
echo "tests/serve: installed openai $(node -p 'require("./node_modules/openai/package.json").version')"
