#!/usr/bin/env bash
# Configures and builds tally (Release) into build/. Extra CMake flags pass through:
#   bash scripts/build.sh -DTALLY_CUDA=OFF
#   TARGET=tally_cli bash scripts/build.sh      only the `tally` program (what quickstart needs)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${TALLY_BUILD_DIR:-$root/build}"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" "$@" >/dev/null
cmake --build "$build" -j"${JOBS:-2}" ${TARGET:+--target "$TARGET"}
