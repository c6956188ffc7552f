#!/usr/bin/env bash
# Every check that needs a GPU, in one run sized for a lent GPU's 15 minutes (about 9 minutes of commands):
# run it first whenever a GPU is lent. Each stage writes OUT/<stage>.log and appends "stage rc seconds" to
# OUT/summary.tsv as it ends, so a run cut short still returns what it finished. Most precious first:
#
#   env         the device, torch, CUDA and bf16 support
#   tests       the tests marked for a CUDA device (CUDA-graph and compiled decoding equal the static
#               step; MoE refused by the graph decoder), skipped elsewhere
#   train       lmlab train on the device (bf16 autocast), interrupted by SIGTERM and resumed; generate
#               greedily with every decoder: the eager, static, compiled and CUDA-graph texts must agree
#   distributed DDP and FSDP under torchrun with NCCL: needs 2 GPUs, so it says it was skipped on one
#   throughput  each experiment's and ladder's GPU profile: tokens/s, MFU and memory of its models, and how
#               long the profile would take (benchmarks/profile_throughput.py)
#   benchmarks  benchmarks/run_all.sh --device cuda: lmlab against transformers and the rest at GPU sizes,
#               under whatever time is left (GPU_CHECKS_BUDGET seconds in all, default 540)
#
#   bash benchmarks/gpu_checks.sh OUT                          # on the GPU machine
#   bash benchmarks/gpu_checks.sh OUT --device cpu --quick     # the script itself, on a CPU at tiny sizes
#   STAGES="env train" bash benchmarks/gpu_checks.sh OUT       # some stages only
#
# The interpreter is $PYTHON, else python (tests pass their own). Exit status: 0 when every stage that ran
# passed, 1 otherwise; summary.tsv says which.
set -uo pipefail

out=${1:?usage: gpu_checks.sh OUT [--device cuda|cpu] [--quick]}
shift
device=cuda
quick=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --quick) quick=1; shift ;;
    *) echo "gpu_checks.sh: unknown argument $1; use --device cuda|cpu or --quick" >&2; exit 2 ;;
  esac
done
if [[ -e "$out" && -n "$(ls -A "$out" 2>/dev/null)" ]]; then
  echo "gpu_checks.sh: $out is not empty; give a new directory (nothing is overwritten)" >&2
  exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
py=${PYTHON:-python}
budget=${GPU_CHECKS_BUDGET:-540}
stages=${STAGES:-env tests train distributed throughput benchmarks}
start=$SECONDS
failed=0
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"

stage() {  # stage NAME TIMEOUT COMMAND...: run it with its log, record rc and seconds
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  [[ " $stages " == *" $name "* ]] || return 0
  echo "=== $name (at most ${limit} s)"
  timeout --signal=TERM --kill-after=10 "$limit" bash -c "$*" > "$out/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$out/summary.tsv"
  tail -n 25 "$out/$name.log"
  echo "--- $name: exit $rc, $((SECONDS - t0)) s"
  [[ $rc -eq 0 ]] || failed=1
}

env_info() {
  [[ "$device" == cuda ]] && nvidia-smi
  "$py" - "$device" <<'EOF'
import sys, torch
d = sys.argv[1]
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if d == "cuda":
    if not torch.cuda.is_available():
        sys.exit("gpu_checks: --device cuda, but torch sees no CUDA device")
    p = torch.cuda.get_device_properties(0)
    print(torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.1f} GiB", "bf16", torch.cuda.is_bf16_supported(),
          "devices", torch.cuda.device_count())
EOF
}

cuda_tests() {
  "$py" -m pytest -q -rs -p no:cacheprovider tests/test_decode.py tests/test_generate.py -k "cuda"
}

train_and_decode() {  # a short run on the device, stopped by SIGTERM midway and resumed, then every decoder
  local run="$out/train-run" steps=300 size=(--model.d_model 128 --model.n_layers 4 --model.n_heads 4)
  (( quick )) && steps=40 && size=(--model.d_model 32 --model.n_layers 2 --model.n_heads 2)
  "$py" -m lmlab.cli train --run-dir "$run" --train.device "$device" --train.steps "$steps" "${size[@]}" \
    --checkpoint.every 20 --log.every 10 --quiet &
  local pid=$!
  for _ in $(seq 600); do [[ -d "$run/checkpoints" && -n "$(ls "$run/checkpoints" 2>/dev/null)" ]] && break; sleep 0.1; done
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"
  echo "stopped: exit $? (143 after SIGTERM with a checkpoint, 0 when it finished first)"
  "$py" -m lmlab.cli train --run-dir "$run" --resume --quiet || return 1
  local texts=() d
  local decoders=(eager static)
  [[ "$device" == cuda ]] && decoders+=(compiled graph)  # on a CPU, compiling the step takes minutes
  for d in "${decoders[@]}"; do
    texts+=("$("$py" -m lmlab.cli generate "$run" --device "$device" --prompt "def " --max-new-tokens 48 \
      --temperature 0 --decoder "$d")") || return 1
    echo "[$d] ${texts[-1]}"
  done
  for t in "${texts[@]}"; do
    [[ "$t" == "${texts[0]}" ]] || { echo "greedy texts differ between decoders"; return 1; }
  done
  echo "greedy texts agree across: ${decoders[*]}"
}

distributed() {
  local gpus
  gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
  if [[ "$device" == cuda && $gpus -lt 2 ]]; then
    echo "skipped: NCCL refuses two processes on one GPU, and this machine has $gpus; DDP and FSDP are tested"
    echo "on CPU processes with gloo (tests/test_distributed.py)"
    return 0
  fi
  local n=2 steps=40
  [[ "$device" == cuda ]] && n=$gpus
  local common=(--train.device "$device" --train.steps "$steps" --train.grad_accum "$n" --model.d_model 64
                --model.n_layers 2 --model.n_heads 2 --checkpoint.every 20 --quiet)
  "$py" -m torch.distributed.run --standalone --nproc-per-node "$n" -m lmlab.cli train \
    --run-dir "$out/ddp" --parallel.strategy ddp "${common[@]}" || return 1
  "$py" -m torch.distributed.run --standalone --nproc-per-node "$n" -m lmlab.cli train \
    --run-dir "$out/fsdp" --parallel.strategy fsdp "${common[@]}" || return 1
  echo "ddp and fsdp on $n processes: done"
}

throughput() {
  if (( quick )); then
    "$py" benchmarks/profile_throughput.py --device "$device" --profile quick --steps 1
  else
    "$py" benchmarks/profile_throughput.py --device "$device" --profile gpu --steps 5
  fi
}

benchmarks() {
  local args=(--device "$device")
  (( quick )) && args+=(--quick)
  PYTHON="$py" bash benchmarks/run_all.sh "${args[@]}"
}

export out device quick py
export -f env_info cuda_tests train_and_decode distributed throughput benchmarks

left() { local l=$((budget - (SECONDS - start))); (( l < 30 )) && l=30; echo "$l"; }

stage env 60 env_info
stage tests 150 cuda_tests
stage train 150 train_and_decode
stage distributed 120 distributed
stage throughput "$(left)" throughput
stage benchmarks "$(left)" benchmarks
echo "all stages: $((SECONDS - start)) s; summary in $out/summary.tsv"
cat "$out/summary.tsv"
exit $failed
