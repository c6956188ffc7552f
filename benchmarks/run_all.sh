#!/usr/bin/env bash
# Every benchmark in benchmarks/, one after the other, each printing both libraries, the ratio and MFU;
# on the CPU also one decoding step split four ways (bench_decode_step.py) and whole training runs against a
# plain PyTorch loop (bench_run.py, one thread each).
#
#   benchmarks/run_all.sh                      # CPU sizes (docs/speed.md's CPU table), fp32, 2 threads
#   benchmarks/run_all.sh --device cuda        # GPU sizes, bf16 autocast, eager and compiled
#   benchmarks/run_all.sh --quick              # tiny sizes on CPU: seconds per script, for CI
#
# GPU sizes: the 198M dense llama at 8 x 1024 tokens (eager and torch.compile); the MoE benchmark's four
# parts (an MoE layer's step split phase by phase, MoE against dense at equal active parameters, MoE blocks
# against transformers' Mixtral, Qwen2-MoE and DeepSeek-V3 at 8/32/64 experts, and a Qwen2-MoE model's
# training step, the last also compiled); generation at batch 1 and 8 (bench_generate.py --size gpu), and
# the loss's peak memory at vocab 128k and 8 x 1024 tokens.
# Budget: under 8 minutes on one H100/H200-class GPU.
# Extra arguments after the flags are passed to every script (e.g. --threads 1).
set -euo pipefail

device=cpu
quick=()
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --quick) quick=(--quick); shift ;;
    *) extra+=("$1"); shift ;;
  esac
done

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
flags=(--device "$device" ${quick[@]+"${quick[@]}"})
if [[ "$device" == cpu && ${#extra[@]} -eq 0 ]]; then
  # docs/speed.md's CPU numbers use 2 threads; the quick run is a smoke test, where 1 thread is faster
  # on a busy machine
  if [[ ${#quick[@]} -gt 0 ]]; then extra=(--threads 1); else extra=(--threads 2); fi
fi
size=()
[[ "$device" == cuda && ${#quick[@]} -eq 0 ]] && size=(--size gpu)

run() {
  echo
  echo "=== $* ==="
  local start=$SECONDS
  "${PYTHON:-python}" "$here/$1" "${@:2}"  # PYTHON: the interpreter to run them with (tests pass their own)
  echo "--- $1: $((SECONDS - start)) s"
}

total=$SECONDS
run bench_train_step.py "${flags[@]}" ${size[@]+"${size[@]}"} ${extra[@]+"${extra[@]}"}
run bench_moe.py "${flags[@]}" ${size[@]+"${size[@]}"} ${extra[@]+"${extra[@]}"}
if [[ "$device" == cuda ]]; then
  run bench_train_step.py "${flags[@]}" ${size[@]+"${size[@]}"} --compile ${extra[@]+"${extra[@]}"}
  run bench_moe.py "${flags[@]}" ${size[@]+"${size[@]}"} --part model --compile ${extra[@]+"${extra[@]}"}
fi
run bench_loss_memory.py "${flags[@]}" ${extra[@]+"${extra[@]}"}
run bench_generate.py "${flags[@]}" ${size[@]+"${size[@]}"} ${extra[@]+"${extra[@]}"}
if [[ "$device" == cpu ]]; then
  # one eager decoding step split: transformers, lmlab, a straight-line step of the same weights, the matmuls alone
  run bench_decode_step.py "${flags[@]}" ${extra[@]+"${extra[@]}"}
  # nanoGPT's CPU recipe, whole runs against a plain loop, one thread each
  run bench_run.py ${quick[@]+"${quick[@]}"}
fi
echo
echo "all benchmarks: $((SECONDS - total)) s"
