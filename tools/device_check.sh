#!/usr/bin/env bash
# The GPU checks, run in one call (a GPU machine may be available only briefly):
#   sweep   tools/gemm_sweep.py: bf16 GEMM and flash-attention rates by shape against
#           the planner's kernel model (docs/planner.md calibrates on it);
#   loss    tools/loss_check.py: partita's loss against torch's cross-entropy, time and
#           peak memory at 8,192 tokens x 128K vocabulary;
#   gqa     tools/gqa_attention.py: which SDPA backends take grouped kv heads in place;
#   compile `partita bench gpu --compile`: each compile mode against eager at ZeRO 0 and
#           3 (Llama 3.2 1B, bf16) with MFU, first steps (compilation), top kernels;
#   train   `partita train` on the GPU (Llama 3.2 1B shape), eager, next to `partita
#           plan`'s prediction of the same layout's memory and step time;
#   trainc  the same run with train.compile=blocks;
#   vocab   `partita train` of gpt2-124m (vocabulary 50,257) with its vocabulary padded to
#           50,304 (the catalog's `model.vocab_multiple=64`) and unpadded, eager and
#           compiled, each next to `partita plan`'s step time for it;
#   gpu     `partita bench gpu`: our ZeRO engine against DDP/FSDP2, bf16, MFU;
#   gpugpt  the same on gpt2-124m (16 x 1024 tokens per step);
#   eagerprof  partita's eager stage 0 on gpt2-124m (16 x 1024) profiled, next to `partita
#           plan` for it: where the 14-20% the planner misses there with the GPU's own
#           attention rate goes (`PARTITA_GPU_FLASH` in planner/assumptions.py);
#   zero, pp  `partita bench zero` / `bench pp` on the machine's CPU cores;
#   oom     `partita train` of llama3-8b at ZeRO-0 on one GPU, beyond its memory: the
#           note before launch and the out-of-memory message with the planner's advice
#           (checked on a CPU only with an injected torch.OutOfMemoryError).
# Logs go to $OUT (the device tool's folder) or ./device-logs. Run from the repo root.
# Arguments pick parts, run in the order given; BUDGET (seconds, default 540) bounds the
# whole call: each part gets at most its own limit and what is left, and a part that
# would get under 30 s is skipped (and said so).
set -u
PARTS=${*:-sweep loss gqa compile train trainc}
BUDGET=${BUDGET:-540}
OUT=${OUT:-device-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 \
    || { echo "install failed:"; tail -5 /tmp/install.log; }
if ! command -v partita >/dev/null; then  # no install: run from the source tree
    export PYTHONPATH=$PWD/src PATH=/tmp/partita-bin:$PATH
    mkdir -p /tmp/partita-bin  # a file, not a function: `timeout` runs it
    printf '#!/bin/sh\nexec python3 -c "import sys; from partita.cli import main; sys.exit(main())" "$@"\n' \
        >/tmp/partita-bin/partita && chmod +x /tmp/partita-bin/partita
fi
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
nproc

# part NAME LIMIT COMMAND...: run COMMAND under min(LIMIT, time left - 10 s), its output
# (warnings left out) on the screen and in $OUT/NAME.log.
part() {
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - SECONDS - 10))
    ((left < limit)) && limit=$left
    if ((limit < 30)); then echo "== skipped $name: ${left}s left"; return; fi
    echo "== [$SECONDS s] $name (at most ${limit}s)"
    timeout "$limit" "$@" 2>&1 | grep -v Warning | tee -a "$OUT/$name.log"
}
TRAIN=(--model.name=llama3.2-1b --data.seq_len=2048 --train.global_batch=4
       --precision.param_dtype=bfloat16 --train.steps=30 --train.lr=3e-4 --train.min_lr=3e-5
       --train.warmup_steps=5 --train.log_every=5 --train.eval_every=1000
       --train.progress=false --metrics.tensorboard=false --train.overwrite=true)
GPT=(--model.name=gpt2-124m --data.seq_len=1024 --train.global_batch=16
     --precision.param_dtype=bfloat16 --train.steps=40 --train.lr=6e-4 --train.min_lr=6e-5
     --train.warmup_steps=5 --train.log_every=10 --train.eval_every=1000
     --train.progress=false --metrics.tensorboard=false --train.overwrite=true)
GPT_PLAN=(--gpus 1 --gpu-type H200 --seq-len 1024 --global-batch 16
          --layout "dp=1 zero_stage=0 microbatch_size=16" --implementation partita)
PLAN=(--model llama3.2-1b --gpus 1 --gpu-type H200 --seq-len 2048 --global-batch 4
      --layout "dp=1 zero_stage=0 microbatch_size=4" --implementation partita)

for p in $PARTS; do case $p in
sweep) part sweep 90 python3 tools/gemm_sweep.py --device cuda --gpu-type H200 \
           --json "$OUT/sweep.json" ;;
loss) part loss 60 python3 tools/loss_check.py ;;
gqa) part gqa 60 python3 tools/gqa_attention.py --device cuda --dtype bfloat16 --steps 20 ;;
compile) part compile 330 partita bench gpu --compile --rounds 4 \
             --profile "partita stage 0 blocks" ;;
train) part train 100 partita train "${TRAIN[@]}" --train.out_dir=/tmp/gpu-run
       part train 30 partita plan "${PLAN[@]}" ;;
trainc) part trainc 150 partita train "${TRAIN[@]}" --train.compile=blocks \
            --train.out_dir=/tmp/gpu-run-c
        part trainc 30 partita plan "${PLAN[@]}" --compile blocks ;;
vocab) for m in 64 1; do
         part vocab 60 partita train "${GPT[@]}" --model.vocab_multiple=$m \
             --train.out_dir=/tmp/gpt-$m
         part vocab 30 partita plan "${GPT_PLAN[@]}" --model-shape \
             "layers=12,hidden=768,heads=12,vocab=50257,seq=1024,flavour=gpt2,tie=true,vocab_multiple=$m"
       done
       for m in 64 1; do
         part vocab 90 partita train "${GPT[@]}" --model.vocab_multiple=$m \
             --train.compile=blocks --train.out_dir=/tmp/gptc-$m
       done ;;
gpu) part gpu 300 partita bench gpu ;;
gpugpt) part gpugpt 240 partita bench gpu --model gpt2-124m --batch 16 --seq 1024 --rounds 4 ;;
eagerprof) part eagerprof 150 partita bench gpu --model gpt2-124m --batch 16 --seq 1024 \
               --rounds 2 --profile "partita stage 0"
           part eagerprof 30 partita plan "${GPT_PLAN[@]}" --model gpt2-124m \
               --set flash_fwd_fraction=0.7 --set flash_bwd_fraction=0.55 ;;
zero) part zero 200 partita bench zero --no-deepspeed ;;
pp) part pp 240 partita bench pp ;;
oom) part oom 150 partita train --model.name=llama3-8b --data.seq_len=4096 \
         --train.global_batch=4 --precision.param_dtype=bfloat16 --train.steps=2 \
         --train.progress=false --metrics.tensorboard=false --train.overwrite=true \
         --train.out_dir=/tmp/gpu-oom ;;
*) echo "unknown part $p (sweep loss gqa compile train trainc vocab gpu gpugpt eagerprof zero pp oom)" ;;
esac; done
echo "== [$SECONDS s] done"
