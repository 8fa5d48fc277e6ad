#!/usr/bin/env bash
# Sets everything up and runs the whole test suite: the Release build, then the same
# suite under AddressSanitizer + UndefinedBehaviorSanitizer.
#   SKIP_ASAN=1 bash scripts/test.sh     Release only (quicker local loop)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

# The corpus step fetches the GPT-2 BPE files the tokenizer tests compare against; the
# browser is Debian's chromium, which renders the loss plots in a test.
bash scripts/setup.sh --corpus --browser

echo "== Release build and tests"
TALLY_BUILD_DIR="$root/build" bash scripts/build.sh -DTALLY_WERROR=ON
(cd build && ctest --output-on-failure -j1 --timeout 1200)

if [ "${SKIP_ASAN:-0}" != 1 ]; then
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer build and tests"
  # CUDA code is compiled by the Release build; the sanitizer build checks host code.
  BUILD_TYPE=RelWithDebInfo TALLY_BUILD_DIR="$root/build-asan" bash scripts/build.sh -DTALLY_SANITIZE=ON -DTALLY_CUDA=OFF -DTALLY_WERROR=ON
  # The flatness test runs 200 steps x 64 microbatches in Release; under ASan a shorter
  # run checks the same invariants.
  (cd build-asan && TALLY_FLAT_STEPS=20 TALLY_FLAT_MICROBATCHES=8 TALLY_DIST_FLAT_STEPS=10 TALLY_DIST_FLAT_MICROBATCHES=4 \
     ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
     ctest --output-on-failure -j1 --timeout 1800)
fi
