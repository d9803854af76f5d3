#!/usr/bin/env bash
# What a session with a lent GPU runs (the `device` tool of this project's workplace, or any CUDA machine):
# the CUDA tests, then the measured GPU targets, each step under its own time limit so that one hang costs
# only its own minutes. Logs and every run's summary.json go to $OUT/logs.tgz (default /tmp/gpu_check_out);
# the last thing printed is one table of the figures.
#
#   bash scripts/gpu_check.sh              # all parts
#   bash scripts/gpu_check.sh tests gpt    # some of: smoke tests tune_gpt aa_gpt race tune_r18 gpt2 wide_gpt lm_tips
#                                          #          compression model_parallel gpt resnet50 resnet18 gpt_compile_modes
#                                          #          overhead suite
#   TESTS_K='resume' bash scripts/gpu_check.sh tests   # only the CUDA tests matching a -k expression
#   DRY=1 bash scripts/gpu_check.sh tune_gpt aa_gpt race   # the same steps on the CPU at toy sizes (CI runs this)
#   R18_MINUTES=2.5 FP8_MINUTES=1 bash scripts/gpu_check.sh tune_r18 gpt2   # budgets: the ResNet-18 tuner, the fp8 sweeps
#
# The agenda (issue "On the GPU"), in priority order: tune_gpt (python -m runner.tune speed on the GPT GPU recipe),
# aa_gpt (an interleaved sweep compile=default,reduce-overhead x trainer.seed=0,1 with its A/A copy), race
# (nanoGPT's own train.py, the recipe and the tuner's pick, each to validation loss 1.47; needs nanoGPT's
# train.py, model.py, configurator.py, config/ and its prepared data/shakespeare_char/ in $NANOGPT, default
# .gpu/nanogpt), tune_r18 (the tuner on ResNet-18 with the CIFAR stem), gpt2 (GPT-2 124M on synthetic tokens:
# tokens/s and MFU, bf16 against torchao's fp8, interleaved), wide_gpt (the same on a GPT of width 2048, where fp8's
# layer filter converts every projection), lm_tips (selective checkpointing, the chunked loss and the compiled
# optimizer step on GPT-2 124M, interleaved), compression (int8 training against bf16, 2:4 sparse against dense,
# interleaved), model_parallel (distributed=tp and pp on one GPU).
#
# Needs hydra-core, omegaconf and antlr4-python3-runtime importable, and torchao for fp8 (without it fp8 is recorded
# as skipped); where they are carried as wheels in .whl/ (a machine with no package index; torchao's built for the
# machine's torch and Python: pip download --no-deps --only-binary=:all: --python-version 3.12 torchao==<version>),
# they are installed into /tmp/site first. Tiny Shakespeare is read from
# $GPT_TEXT (default: the copy embedded in data/tinyshakespeare/input.txt).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_out}
WORK=/tmp/gpu_check/$(date +%Y%m%d-%H%M%S)-$$  # a fresh folder per invocation: a rerun never meets finished runs
LOGS=$WORK/logs
RUNS=$WORK/runs
mkdir -p "$OUT" "$LOGS" "$RUNS"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && { ! python3 -c "import hydra" 2>/dev/null \
    || { compgen -G ".whl/torchao-*.whl" >/dev/null && ! python3 -c "import torchao" 2>/dev/null; }; }; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
GPT_TEXT=${GPT_TEXT:-data/tinyshakespeare/input.txt}
GPT_TEXT=$(realpath "$GPT_TEXT")
parts=${*:-smoke tests tune_gpt aa_gpt race tune_r18 gpt2 wide_gpt lm_tips compression model_parallel gpt resnet50 resnet18 gpt_compile_modes overhead suite}
NANOGPT=${NANOGPT:-.gpu/nanogpt}
DRY=${DRY:-}
DEV=cuda
gpt_toy=(); r18_toy=(); gpt2_toy=(); wide_toy=(); tune_minutes=1.4
aa_stop=(interleave.max_minutes=0.8)  # the A/A sweep's measuring time
fp8_minutes=${FP8_MINUTES:-1.5}  # of measuring in each bf16-against-fp8 sweep, after its processes compiled
r18_minutes=${R18_MINUTES:-1.4}  # the ResNet-18 tuner's budget; its step's time limit grows with it
lm_compile=default; quick=(); lm_quick=(); tune_dry=(); scale=1
if [ -n "$DRY" ]; then  # the same commands on the CPU at toy sizes: the script cannot rot between GPU sessions
  # (the tuners' budgets leave no time for a round: their guard and verification run; slices of 4 steps; the
  # steps' time limits x3, for a CI machine busy with other tests)
  DEV=cpu; tune_minutes=0.3; r18_minutes=0.3; fp8_minutes=0.2; lm_compile=off; scale=3
  aa_stop=(interleave.max_passes=3)  # passes, not minutes: a busy CI machine still measures the A/A copy
  gpt_toy=(model.n_layer=1 model.n_head=2 model.n_embd=32 data.block_size=32 optimizer.base_batch_size=8)
  r18_toy=(model=mlp "data.shape=[3,8,8]")
  gpt2_toy=(model.n_layer=1 model.n_head=2 model.n_embd=64 data.block_size=32 data.vocab_size=512
            data.synthetic_tokens=20000 optimizer.base_batch_size=4)
  wide_toy=(model.n_layer=2 model.n_head=2 model.n_embd=64 data.block_size=32 data.vocab_size=512
            data.synthetic_tokens=20000 optimizer.base_batch_size=2)
  quick=(interleave.slice_steps=4 interleave.min_passes=2 tune.guard_steps=10 tune.target_ci=0.5)
  lm_quick=(interleave.slice_steps=4 interleave.min_passes=2 interleave.max_passes=2)  # passes, not seconds
  # the tuners' verification layers +experiment=fast under the command, which compiles: compile=off on the command
  # line keeps it off there too (a CPU compile of the GPT is ~20 s of CI's CPU)
  tune_dry=(compile=off)
fi

if [ -z "$DRY" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
  python3 -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], torch.cuda.get_device_name())"
fi

# step NAME SECONDS CMD...: run CMD under a time limit, log to $LOGS/NAME.log, print its status and tail
step() {
  local name=$1 limit=$(( $2 * scale )); shift 2
  local t0; t0=$(date +%s)
  timeout --signal=INT --kill-after=20 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 )) s"
  grep -E "error|Error|FAILED|passed|failed|skipped" "$LOGS/$name.log" | grep -v "^  " | tail -n 12
  # what has been measured so far comes back even if a later step runs past the call's limit
  tar czf "$OUT/logs.tgz" --exclude='*.safetensors' --exclude=checkpoints --exclude='*.pt' -C "$WORK" logs runs \
    2>/dev/null
}
run() {  # run NAME SECONDS OVERRIDES...: one python -m runner job on CUDA into $RUNS/NAME
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" python3 -m runner trainer.device=$DEV logger=none trainer.progress=lines \
    hydra.run.dir="$RUNS/$name" "$@"
}
has() { case " $parts " in *" $1 "*) return 0;; esac; return 1; }

if has smoke; then
  run smoke_amp_pinned 120 precision=amp dataloader=pinned trainer.max_steps=300  # the README's second command
fi
if has tests; then
  kargs=(); [ -n "${TESTS_K:-}" ] && kargs=(-k "$TESTS_K")
  step tests_gpu 300 python3 -m pytest -m gpu -n 0 -p no:cacheprovider --continue-on-collection-errors -q -rA \
    --timeout 240 tests "${kargs[@]}"
fi
gpt_gpu=(+experiment=shakespeare_char_gpu data.path="$GPT_TEXT" trainer.device=$DEV logger=none "${gpt_toy[@]}")
if has tune_gpt; then
  # (tune.budget_minutes=1.4: one round of about 30 s and the verification; below 1.34 no round fits)
  # the speed tuner on the GPT GPU recipe (compile off, bf16, the corpus on the device, fused syncs already):
  # compile's two modes and the fused optimizer (max-autotune left out: its autotuning alone takes minutes)
  # (DRY: the fused optimizer alone, so the CPU's guard compiles nothing: the command is what the dry run checks)
  only='[compile,compile_reduce_overhead,fused_optimizer]'; [ -n "$DRY" ] && only='[fused_optimizer]'
  step tune_gpt 220 python3 -m runner.tune speed --out "$RUNS/tune_gpt" "${gpt_gpu[@]}" "tune.only=$only" \
    tune.budget_minutes=$tune_minutes interleave.processes=1 "${quick[@]}" "${tune_dry[@]}"
  cat "$RUNS/tune_gpt/speed.md" >>"$LOGS/tune_gpt.log" 2>/dev/null
fi
if has aa_gpt; then
  # interleaved: compile=default against reduce-overhead, each under two seeds, with the reference's copy (A/A)
  # (DRY: compile off, as on a CPU the two modes are one and compiling them costs CI a minute of both cores)
  modes=default,reduce-overhead; [ -n "$DRY" ] && modes=off
  step aa_gpt 150 python3 -m runner -m hydra/launcher=interleaved "${gpt_gpu[@]}" compile=$modes trainer.seed=0,1 \
    trainer.max_steps=1000000 trainer.eval_every=1000000 trainer.eval_max_batches=1 interleave.processes=1 \
    interleave.slice_seconds=1 "${aa_stop[@]}" "${quick[@]}" \
    hydra.sweep.dir="$RUNS/aa_gpt"
  cat "$RUNS/aa_gpt/report.md" >>"$LOGS/aa_gpt.log" 2>/dev/null
fi
if has race; then
  # nanoGPT's own train.py, runner's recipe (compile=default, as nanoGPT compiles) and the tuner's pick, each from a
  # cold start with empty compile caches to its first validation loss <= 1.47, alternated (scripts/bench_nanogpt.py)
  dry=(); target=1.47; [ -n "$DRY" ] && { dry=(--dry-run); target=3.9; }
  # (its table goes straight to $OUT: it comes back even if the call's own limit stops the script)
  step race 210 python3 scripts/bench_nanogpt.py --nanogpt "$NANOGPT" --device cuda "${dry[@]}" --target $target \
    --repeats 1 --limit-s 120 --data "$GPT_TEXT" --tuned "$RUNS/tune_gpt" --out "$OUT/race.md"
fi
if has tune_r18; then
  # the speed tuner on ResNet-18 with the CIFAR stem, 32 x 32 synthetic images, batch 512, fp32 as it comes
  r18=(model=resnet18 model.cifar_stem=true); [ -n "$DRY" ] && r18=("${r18_toy[@]}")
  r18+=(data=synthetic data.train_size=50000 data.eval_size=512 trainer.eval_max_batches=1 dataloader.batch_size=512
        trainer.device=$DEV logger=none)
  only='[compile,bf16,channels_last,on_device_data,fused_optimizer,cudnn_benchmark]'
  [ -n "$DRY" ] && only='[compile,on_device_data,fused_optimizer]'
  # (the limit: the budget, which counts measuring only, and 200 s for what it leaves out; on an H200 the guard's
  # six 50-step runs took 72 s and the processes' start-ups 50 s a round and 41 s for the verification)
  step tune_r18 "$(awk "BEGIN { print int($r18_minutes * 60 + 200) }")" python3 -m runner.tune speed \
    --out "$RUNS/tune_r18" "${r18[@]}" "tune.only=$only" tune.budget_minutes=$r18_minutes interleave.processes=1 \
    "${quick[@]}" "${tune_dry[@]}"
  cat "$RUNS/tune_r18/speed.md" >>"$LOGS/tune_r18.log" 2>/dev/null
fi
# GPT-2 124M and the wide GPT: synthetic tokens on the device, bf16 against fp8 (torchao, tensorwise), interleaved with
# bf16's A/A copy; both compiled (fp8 would turn compile on anyway); the first 10 steps of each process are warm-up.
# On a CPU (DRY) fp8 is recorded as skipped (no GPU) and trains bf16, so the sweep still completes.
lm_sweep=(trainer.max_steps=1000000 trainer.eval_every=1000000 trainer.eval_max_batches=1 trainer.warmup_steps=10
          scheduler.warmup_steps=10 task.sample_tokens=0 memory.accumulate_steps=1 dataloader=device compile=$lm_compile
          trainer.device=$DEV logger=none interleave.processes=1 interleave.slice_seconds=2
          interleave.max_minutes=$fp8_minutes "${lm_quick[@]}")
lm_limit=$(awk "BEGIN { print int($fp8_minutes * 60 + 240) }")  # 1.5 minutes: 330 s, as it was
if has gpt2; then
  # conf/experiment/gpt2_124m.yaml (12 x 768, context 1024, micro-batch 12): llm.c reports ~468 K tokens/s per H100
  step gpt2 "$lm_limit" python3 -m runner -m hydra/launcher=interleaved +experiment=gpt2_124m precision=bf16,fp8 \
    "${lm_sweep[@]}" "${gpt2_toy[@]}" hydra.sweep.dir="$RUNS/gpt2"
  cat "$RUNS/gpt2/report.md" >>"$LOGS/gpt2.log" 2>/dev/null
fi
if has wide_gpt; then
  # width 2048 (16 heads of 128), 8 layers, context 1024, micro-batch 8: ~0.5 B parameters, every projection large
  # enough for torchao's tensorwise filter; compiled block by block (compile.regional) to keep the first compile short
  wide=(model.n_layer=8 model.n_head=16 model.n_embd=2048 optimizer.base_batch_size=8)
  [ -n "$DRY" ] && wide=("${wide_toy[@]}")
  step wide_gpt "$lm_limit" python3 -m runner -m hydra/launcher=interleaved +experiment=gpt2_124m precision=bf16,fp8 \
    "${lm_sweep[@]}" "${wide[@]}" compile.regional=true hydra.sweep.dir="$RUNS/wide_gpt"
  cat "$RUNS/wide_gpt/report.md" >>"$LOGS/wide_gpt.log" 2>/dev/null
fi
if has lm_tips; then
  # the language model's own tips on GPT-2 124M: peak memory and tokens/s of selective checkpointing against none and
  # full checkpointing; the chunked loss and the compiled optimizer step against the plain ones; all interleaved
  lm_toy=("${gpt2_toy[@]}"); memories=none,selective,checkpointing; optimizer_step=false,true
  # on a CPU (DRY): two blocks (checkpointing wraps repeated blocks), and fewer configurations; the optimizer step
  # not compiled (three compiles of it cost CI a minute; tests/test_techniques.py compiles it)
  [ -n "$DRY" ] && { lm_toy+=(model.n_layer=2); memories=selective,checkpointing; optimizer_step=false; }
  step lm_memory "$lm_limit" python3 -m runner -m hydra/launcher=interleaved +experiment=gpt2_124m precision=bf16 \
    memory=$memories "${lm_sweep[@]}" "${lm_toy[@]}" hydra.sweep.dir="$RUNS/lm_memory"
  cat "$RUNS/lm_memory/report.md" >>"$LOGS/lm_memory.log" 2>/dev/null
  step lm_loss "$lm_limit" python3 -m runner -m hydra/launcher=interleaved +experiment=gpt2_124m precision=bf16 \
    task.loss=full,chunked compile.optimizer=$optimizer_step "${lm_sweep[@]}" "${lm_toy[@]}" \
    hydra.sweep.dir="$RUNS/lm_loss"
  cat "$RUNS/lm_loss/report.md" >>"$LOGS/lm_loss.log" 2>/dev/null
fi
if has compression; then
  # issue 59's compression on the GPU, interleaved: torchao's int8 mixed-precision training against bf16 on GPT-2 124M,
  # and 2:4 sparse training (cuSPARSELt) against dense on the wide GPT, whose every projection is >= 1024 wide. On a
  # CPU (DRY) sparse24 is recorded as skipped with its reason and int8 trains its toy model.
  wide=(model.n_layer=8 model.n_head=16 model.n_embd=2048 optimizer.base_batch_size=8)
  [ -n "$DRY" ] && wide=("${wide_toy[@]}")
  step int8 "$lm_limit" python3 -m runner -m hydra/launcher=interleaved +experiment=gpt2_124m precision=bf16,int8 \
    "${lm_sweep[@]}" "${gpt2_toy[@]}" hydra.sweep.dir="$RUNS/int8"
  cat "$RUNS/int8/report.md" >>"$LOGS/int8.log" 2>/dev/null
  step sparse24 "$lm_limit" python3 -m runner -m hydra/launcher=interleaved +experiment=gpt2_124m precision=bf16 \
    compress=none,sparse24 compress.min_features=$([ -n "$DRY" ] && echo 64 || echo 1024) "${lm_sweep[@]}" \
    "${wide[@]}" hydra.sweep.dir="$RUNS/sparse24"
  cat "$RUNS/sparse24/report.md" >>"$LOGS/sparse24.log" 2>/dev/null
fi
if has model_parallel; then
  # distributed=tp and pp on one GPU: their one-rank paths (DTensor layers, a one-stage schedule) under torchrun
  for layout in tp pp; do
    step "gpt_$layout" $((180 * scale)) python3 -m torch.distributed.run --standalone --nproc-per-node=1 -m runner \
      +experiment=shakespeare_char_gpu data.path="$GPT_TEXT" distributed=$layout trainer.max_steps=200 \
      trainer.eval_every=200 trainer.eval_max_batches=2 task.sample_tokens=0 trainer.device=$DEV logger=none \
      trainer.progress=lines "${gpt_toy[@]}" hydra.run.dir="$RUNS/gpt_$layout"
  done
fi
if has gpt; then
  # nanoGPT's GPU recipe (6 x 384, block 256, batch 64, 5000 steps): the validation loss target 1.47
  run gpt_compile 420 +experiment=shakespeare_char_gpu data.path="$GPT_TEXT" compile=default
fi
if has resnet50; then
  # 224 x 224 synthetic images (random labels): compute alone, the tuned configuration against the baseline.
  # bf16, not fast's fp16: fp16 evaluation of a BatchNorm net on random labels overflows (eval loss ~4,500 in fp32)
  r50=(model=resnet50 data=synthetic "data.shape=[3,224,224]" data.train_size=4096 data.eval_size=256
       trainer.eval_max_batches=1)
  run r50_baseline 120 +experiment=baseline "${r50[@]}" trainer.max_steps=40 trainer.warmup_steps=10
  run r50_fast_bf16 200 +experiment=fast precision=bf16 "${r50[@]}" trainer.max_steps=80 trainer.warmup_steps=15
  run r50_fast_bf16_nocompile 120 +experiment=fast precision=bf16 compile=off "${r50[@]}" trainer.max_steps=60 \
    trainer.warmup_steps=10
fi
if has resnet18; then
  r18=(model=resnet18 model.cifar_stem=true data=synthetic data.train_size=50000 data.eval_size=512
       trainer.eval_max_batches=1 +experiment=fast precision=bf16 dataloader.batch_size=512)
  run r18_fast_bf16 150 "${r18[@]}" trainer.max_steps=150 trainer.warmup_steps=20
  run r18_fast_bf16_nocompile 100 "${r18[@]}" compile=off trainer.max_steps=150 trainer.warmup_steps=20
fi
if has gpt_compile_modes; then
  # the GPU recipe's first 600 steps: compile's default mode against CUDA graphs (reduce-overhead)
  for mode in default reduce-overhead; do
    run "gpt600_$mode" 120 +experiment=shakespeare_char_gpu data.path="$GPT_TEXT" compile=$mode \
      trainer.max_steps=600 trainer.eval_every=600 trainer.warmup_steps=20
  done
fi
if has overhead; then
  # (300 steps a run: the CPU-sized default of 15-30 left a 2026-11-27 H200 reading inconclusive, ratios 0.79-1.35)
  step overhead 240 python3 scripts/bench_overhead.py --device cuda --cases resnet18 gpt --rounds 7 --steps 300 \
    --warmup 20 --out "$LOGS/overhead.md"
fi
if has suite; then
  # the whole suite with CUDA visible (what `trainer.device=auto` does in the tests)
  step suite 420 python3 -m pytest -n 8 -p no:cacheprovider --continue-on-collection-errors -q --timeout 300 tests
fi

# the figures, one row per run
python3 - "$RUNS" <<'PY' | tee "$LOGS/figures.txt"
import json, pathlib, sys
keys = ["samples_per_sec", "tokens_per_sec", "step_time_ms_median", "mfu", "achieved_tflops", "gpu_idle_fraction",
        "peak_memory_mb", "data_wait_fraction", "eval_loss", "eval_accuracy", "time_to_target_s", "steps", "train_time_s"]
root = pathlib.Path(sys.argv[1])
sweeps = [p for sweep in ("gpt2", "wide_gpt", "int8", "sparse24") for p in root.glob(f"{sweep}/*/summary.json")]  # one row per job
for p in [*sorted(root.glob("*/summary.json")), *sorted(sweeps)]:
    s = json.loads(p.read_text())
    row = {k: s.get(k) for k in keys if s.get(k) is not None}
    skipped = {k: v for k, v in (s.get("techniques") or {}).items() if str(v).startswith("skipped")}
    name = p.parent.name if p.parent.parent == root else f"{p.parent.parent.name}/{p.parent.name}"
    print(name, (s.get("config") or {}).get("precision", {}).get("name", ""), json.dumps(row))
    if skipped:
        print("   skipped:", json.dumps(skipped)[:400])
PY
