#!/usr/bin/env bash
# The GPU part of the DAG on several GPUs of one host: one lane of snakemake targets per GPU.
#
#   bash workflow/scripts/gpu_lanes.sh "calibrate measure_published" "bench_kernels after:calibrate measure_long_context"
#
# Lane i runs its targets in order on GPU i (CUDA_VISIBLE_DEVICES=i), one `snakemake` call each.
# A token "after:T" makes the lane wait until another lane has finished target T (and stop if
# that lane failed on it): the experiments that read the calibrated policy wait for `calibrate`.
# The inputs every lane shares (traces, kernels) are built first, once. Lanes run without
# snakemake's lock (--nolock), so they must build disjoint outputs; the waits keep it so.
#
# Each GPU job still gets a whole GPU to itself; the lanes share the host's CPU cores, which the
# eager and published protocols (host time inside the window) can feel: the report's provenance
# lists the run ids, and the note of a lane run should say that lanes ran side by side.
#
# Environment: CORES (default nproc), LANE_TIMEOUT (seconds per lane, default none), FINAL (a
# target to build after the lanes with every core, e.g. "all"; default none). Where the project
# is not pip-installed (a copied tree), the `persistentkv` command runs from src/.
set -uo pipefail

cores=${CORES:-$(nproc)}
flags=logs/lanes
rm -rf "$flags" && mkdir -p "$flags"
if ! command -v persistentkv >/dev/null 2>&1; then
  mkdir -p build/bin
  printf '#!/bin/sh\nexec python3 -m persistentkv "$@"\n' > build/bin/persistentkv
  chmod +x build/bin/persistentkv
  export PATH="$PWD/build/bin:$PATH" PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
smk() { snakemake --scheduler greedy --rerun-triggers mtime "$@"; }

echo "[lanes] shared inputs: traces, kernels"
smk --cores "$cores" traces kernels || { echo "[lanes] traces/kernels failed" >&2; exit 1; }

lane() {  # lane INDEX TARGETS...
  local gpu=$1; shift
  local per=$(( cores / nlanes > 0 ? cores / nlanes : 1 ))
  for target in "$@"; do
    if [[ $target == after:* ]]; then
      local dep=${target#after:}
      echo "[lane $gpu] waiting for $dep"
      until [[ -e $flags/$dep.done || -e $flags/$dep.failed ]]; do sleep 2; done
      [[ -e $flags/$dep.done ]] || { echo "[lane $gpu] $dep failed elsewhere: stopping" >&2; return 1; }
      continue
    fi
    echo "[lane $gpu] $(date -u +%H:%M:%S) $target"
    if CUDA_VISIBLE_DEVICES=$gpu smk --nolock --cores "$per" "$target" > "$flags/$target.log" 2>&1; then
      touch "$flags/$target.done"
      echo "[lane $gpu] $(date -u +%H:%M:%S) $target done"
    else
      touch "$flags/$target.failed"
      echo "[lane $gpu] $target FAILED (log: $flags/$target.log)" >&2
      tail -n 20 "$flags/$target.log" >&2
      return 1
    fi
  done
}

nlanes=$#
pids=()
gpu=0
for spec in "$@"; do
  # shellcheck disable=SC2086  # a lane is a space-separated list of targets
  if [[ -n ${LANE_TIMEOUT:-} ]]; then
    ( export -f lane smk; export flags cores nlanes; timeout "$LANE_TIMEOUT" bash -c 'lane "$@"' _ $gpu $spec ) &
  else
    lane $gpu $spec &
  fi
  pids+=($!)
  gpu=$((gpu + 1))
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
echo "[lanes] lanes finished (status $status)"
if [[ -n ${FINAL:-} ]]; then
  echo "[lanes] $(date -u +%H:%M:%S) final: $FINAL"
  smk --cores "$cores" $FINAL || status=1
fi
exit $status
