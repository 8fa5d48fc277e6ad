# Sourced by the bench/run_*.sh scripts; $root is the repository.

# prepare_peers BINARY...: builds tally (incrementally: a binary older than the sources must
# not be timed) and checks that each BINARY (under build/) is there, and installs Debian's
# PyTorch if /usr/bin/python3 has none. Debian's OpenBLAS does not recognize every
# CPU (on a Sapphire Rapids VM it picks its generic "Prescott" kernels, ~25 GFLOP/s), so
# PyTorch gets the kernels of the widest vectors the CPU has by name (AVX-512's, or on a CPU
# without it AVX2's: AVX-512 kernels there die of an illegal instruction) unless the caller
# set a core type.
prepare_peers() {
  local binary
  bash "$root/scripts/build.sh"
  for binary in "$@"; do
    [ -x "$root/build/$binary" ] || { echo "$(basename "$0"): the build made no build/$binary" >&2; exit 1; }
  done
  /usr/bin/python3 -c "import torch" 2>/dev/null || bash "$root/scripts/setup.sh" --torch
  local widest=Haswell
  grep -qw avx512f /proc/cpuinfo && widest=SkylakeX
  export OPENBLAS_CORETYPE="${OPENBLAS_CORETYPE:-$widest}"
}

# tally_runs_here: what the scripts that run tally's own CLI (under mpirun too) need: $tally
# (TALLY=path, or build/tally, built if missing), mpirun allowed to run as root, and $work, a
# temporary directory with a random training shard ($work/train.bin, 2M GPT-2-range tokens:
# step time does not depend on which tokens) that is removed when the script exits.
tally_runs_here() {
  tally="${TALLY:-$root/build/tally}"
  [ -x "$tally" ] || bash "$root/scripts/build.sh"
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  python3 "$root/bench/random_shard.py" "$work/train.bin" 2000000
}

# record OUT TAGS COMMAND...: runs COMMAND, adds the fields of the JSON object TAGS to the
# last line it prints (a JSON object), appends that to OUT and echoes it. A command that
# fails or ends without printing one stops the script, naming the command, its exit status
# and the end of what it wrote to stderr.
record() {
  local out="$1" tags="$2"; shift 2
  local line status=0 errors
  errors="$(mktemp)"
  line="$("$@" 2>"$errors" | tail -1; exit "${PIPESTATUS[0]}")" || status=$?
  if [ "$status" != 0 ] || ! TAGS="$tags" /usr/bin/python3 -c \
      "import json, os, sys; r = json.loads(sys.stdin.read()); r.update(json.loads(os.environ['TAGS'])); print(json.dumps(r))" \
      <<< "$line" >> "$out" 2>/dev/null; then
    echo "$(basename "$0"): no JSON line (exit status $status) from: $*" >&2
    tail -5 "$errors" | sed 's/^/  | /' >&2
    rm -f "$errors"
    exit 1
  fi
  rm -f "$errors"
  tail -1 "$out"
}

# begin_runs FINAL: where this script's raw runs go while it runs: FINAL.partial, emptied.
# The runs replace FINAL (the data behind the table in RESULTS.md) only at the end
# (finish_runs), so a run that fails leaves the committed runs and table as they were.
begin_runs() {
  : > "$1.partial"
  echo "$1.partial"
}
finish_runs() {  # finish_runs FINAL
  mv "$1.partial" "$1"
}

# alternate_with_torch PRESET PEER STEPS THREADS ROUNDS: builds tally, then times bench_w1 on
# PRESET and the PyTorch script bench/PEER in turn, ROUNDS times, printing their JSON lines.
alternate_with_torch() {
  local preset="$1" peer="$2" steps="$3" threads="$4" rounds="$5" round
  prepare_peers bench/bench_w1
  for round in $(seq "$rounds"); do
    OMP_NUM_THREADS="$threads" "$root/build/bench/bench_w1" "$steps" "$threads" "$preset"
    OMP_NUM_THREADS="$threads" /usr/bin/python3 "$root/bench/$peer" "$steps" "$threads"
  done
}
