#!/usr/bin/env bash
# One node, N processes: the same job as `python -m runner ...`, data-parallel under torchrun.
#
#   scripts/torchrun.sh [N] [Hydra overrides...]
#   scripts/torchrun.sh 8 model=resnet50 data=cifar10 precision=bf16   # 8 GPUs, DDP
#   scripts/torchrun.sh 2 distributed=fsdp trainer.device=cpu          # 2 CPU processes, FSDP2 over gloo
#
# N: processes on this node; default = the number of visible GPUs (required on a machine without one).
# distributed=ddp is added unless an override picks the distributed group (ddp or fsdp).
# Each process gets OMP_NUM_THREADS = cores / N unless OMP_NUM_THREADS is set (torchrun's own default is 1).
# Extra torchrun flags: TORCHRUN_ARGS, e.g. TORCHRUN_ARGS="--tee 3 --log-dir logs" keeps every rank's output.
# --standalone: a private rendezvous on a free local port, so several jobs can share a machine.
# Exit status: 0, 75 when the workers stopped for a preemption (a signal or Ctrl-C: checkpoint written; the same
# command resumes), else torchrun's own (1 for a failed worker). python -m runner.torchrun is torchrun with that 75.
set -euo pipefail

if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
  nproc=$1
  shift
else
  nproc=$(python -c 'import torch; print(torch.cuda.device_count())')
  if [[ $nproc -lt 1 ]]; then
    echo "scripts/torchrun.sh: no GPU visible; pass the number of processes first, e.g. scripts/torchrun.sh 2 $*" >&2
    exit 2
  fi
fi
if [[ $nproc -lt 1 ]]; then
  echo "scripts/torchrun.sh: the number of processes must be >= 1 (got $nproc)" >&2
  exit 2
fi

case " $* " in
  *" distributed="*) ;;
  *) set -- distributed=ddp "$@" ;;
esac

cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / nproc > 0 ? cores / nproc : 1 ))}

# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of flags
exec python -m runner.torchrun --standalone --nproc-per-node="$nproc" ${TORCHRUN_ARGS:-} -m runner "$@"
