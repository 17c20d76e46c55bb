#!/usr/bin/env bash
# The README's main-job command: installs what is missing, builds stepcore-demo
# with the default preset and runs it; arguments go to the demo (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target stepcore-demo
exec build/default/apps/stepcore-demo "$@"
