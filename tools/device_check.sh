#!/usr/bin/env bash
# The GPU checks, run in one call (a GPU machine may be available only briefly):
#   1. `partita bench gpu`: our ZeRO engine against DDP/FSDP2 on the GPU, bf16, MFU;
#   2. `partita train` on the GPU (Llama 3.2 1B shape) next to `partita plan`'s
#      prediction of the same layout's memory and step time;
#   3. `partita bench zero` and `partita bench pp` with one free core per rank (the
#      machine has 16), against the 2-core CI box where 4 ranks share 2 cores;
#   4. tools/loss_check.py: partita's loss against torch's cross-entropy, time and
#      peak memory at 8,192 tokens x 128K vocabulary;
#   5. `partita bench gpu --compile`: each compile mode against eager at ZeRO 0 and 3
#      (Llama 3.2 1B, bf16) with MFU, and the top kernels of a compiled step;
#   6. tools/gqa_attention.py: which SDPA backends take grouped kv heads in place on
#      CUDA (bf16), and their time against repeating the heads first.
# Logs go to $OUT (the device tool's folder) or ./device-logs. Run from the repo root.
# Arguments pick parts (compile gpu train zero pp loss gqa); none runs them all, which takes
# longer than one device call allows: pick two or three per call.
set -u
PARTS=${*:-compile gpu train zero pp loss gqa}
want() { [[ " $PARTS " == *" $1 "* ]]; }
OUT=${OUT:-device-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { echo "install failed, see install.log"; tail -5 "$OUT/install.log"; }
if ! command -v partita >/dev/null; then  # no install: run from the source tree
    export PYTHONPATH=$PWD/src
    partita() { python3 -c 'import sys; from partita.cli import main; sys.exit(main())' "$@"; }
fi
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
nproc

want compile && echo "== [$SECONDS s] bench gpu --compile" &&
timeout 480 partita bench gpu --compile --rounds 6 --profile "partita stage 0 model" 2>&1 \
    | grep -v Warning | tee "$OUT/bench_gpu_compile.log"

want gpu && echo "== [$SECONDS s] bench gpu" &&
timeout 300 partita bench gpu 2>&1 | grep -v Warning | tee "$OUT/bench_gpu.log"

if want train; then
echo "== [$SECONDS s] train on the GPU, then the planner's figures for that layout"
timeout 180 partita train --model.name=llama3.2-1b --data.seq_len=2048 \
    --train.global_batch=4 --precision.param_dtype=bfloat16 --train.steps=40 \
    --train.lr=3e-4 --train.min_lr=3e-5 --train.warmup_steps=5 --train.log_every=5 \
    --train.eval_every=1000 --train.progress=false --metrics.tensorboard=false \
    --train.out_dir=/tmp/gpu-run 2>&1 | tee "$OUT/train_gpu.log"
cp /tmp/gpu-run/metrics.jsonl "$OUT/train_gpu_metrics.jsonl" 2>/dev/null
partita plan --model llama3.2-1b --gpus 1 --gpu-type H200 --seq-len 2048 \
    --global-batch 4 --layout "dp=1 zero=0 mb=4" 2>&1 | tee "$OUT/plan_gpu.log"
fi

want zero && echo "== [$SECONDS s] CPU: bench zero, one core per rank" &&
timeout 200 partita bench zero --no-deepspeed 2>&1 | tee "$OUT/bench_zero.log"
want pp && echo "== [$SECONDS s] CPU: bench pp, one core per rank" &&
timeout 240 partita bench pp 2>&1 | tee "$OUT/bench_pp.log"
want loss && echo "== [$SECONDS s] loss" &&
timeout 120 python3 tools/loss_check.py 2>&1 | tee "$OUT/loss.log"
want gqa && echo "== [$SECONDS s] grouped kv heads on CUDA" &&
timeout 120 python3 tools/gqa_attention.py --device cuda --dtype bfloat16 --steps 20 2>&1 \
    | tee "$OUT/gqa.log"
echo "== [$SECONDS s] done"
