# Sourced by the bench/run_*.sh scripts that time tally against PyTorch; $root is the
# repository.

# prepare_peers BINARY...: builds tally if a BINARY (under build/) is missing and installs
# Debian's PyTorch if /usr/bin/python3 has none. Debian's OpenBLAS does not recognize every
# CPU (on a Sapphire Rapids VM it picks its generic "Prescott" kernels, ~25 GFLOP/s), so
# PyTorch gets the kernels of the widest vectors the CPU has by name (AVX-512's, or on a CPU
# without it AVX2's: AVX-512 kernels there die of an illegal instruction) unless the caller
# set a core type.
prepare_peers() {
  local binary
  for binary in "$@"; do
    [ -x "$root/build/$binary" ] || { bash "$root/scripts/build.sh"; break; }
  done
  /usr/bin/python3 -c "import torch" 2>/dev/null || bash "$root/scripts/setup.sh" --torch
  local widest=Haswell
  grep -qw avx512f /proc/cpuinfo && widest=SkylakeX
  export OPENBLAS_CORETYPE="${OPENBLAS_CORETYPE:-$widest}"
}

# record OUT TAGS COMMAND...: runs COMMAND, adds the fields of the JSON object TAGS to the
# last line it prints (a JSON object), appends that to OUT and echoes it. A command that
# ends without printing one stops the script, naming the command.
record() {
  local out="$1" tags="$2"; shift 2
  local line
  line="$("$@" 2>/dev/null | tail -1)" || true
  if ! TAGS="$tags" /usr/bin/python3 -c \
      "import json, os, sys; r = json.loads(sys.stdin.read()); r.update(json.loads(os.environ['TAGS'])); print(json.dumps(r))" \
      <<< "$line" >> "$out" 2>/dev/null; then
    echo "$(basename "$0"): no JSON line from: $*" >&2
    exit 1
  fi
  tail -1 "$out"
}
