#!/usr/bin/env bash
# Multi-node data-parallel training under SLURM: one torchrun agent per node (`srun torchrun`), which starts
# one process per GPU; the agents meet at a c10d rendezvous on the first node of the allocation.
#
#   sbatch scripts/multinode.sh [Hydra overrides...]
#   sbatch --nodes=4 --gpus-per-node=8 --cpus-per-task=64 scripts/multinode.sh model=resnet50 data=cifar10
#   sbatch --wait scripts/multinode.sh trainer.max_steps=20        # block until it ends (CI, scripts)
#
# Edit the #SBATCH lines below for your cluster (options given to sbatch on the command line win over them):
#   --nodes            machines; the job runs nodes x processes-per-node ranks
#   --ntasks-per-node  keep 1: one torchrun agent per node, it starts that node's processes
#   --gpus-per-node    GPUs per machine = processes per node (one rank per GPU, nccl); 0 = CPU only (gloo),
#                      then NPROC_PER_NODE processes per node (default 1)
#   --cpus-per-task    CPU cores per node for all its processes (OMP_NUM_THREADS = this / processes per node)
#   --time             wall-clock limit, HH:MM:SS; SLURM stops the job (SIGTERM, then SIGKILL) when it runs out
#   --output           the job's log, relative to the directory sbatch was called from (%x job name, %j job id)
#   --signal           B:USR1@<seconds>: SLURM signals this script that long before the time limit; the script
#                      forwards SIGUSR1 to every training process, which checkpoint at the next step boundary,
#                      requeue the job and exit. Give it more seconds than a step plus a checkpoint take.
#   --requeue          allow the job to be requeued (after the signal above, or a preemption); the requeued job
#                      keeps its job id, hence its job folder (outputs/slurm-<job id>), and resumes there
# Often also needed: --partition=<name>, --account=<name>, --mem=<size>.
#
# The job folder is outputs/slurm-<job id>/ in the directory sbatch was called from (created by rank 0), unless a
# hydra.run.dir=... override names another: a requeued job finds its checkpoints there (checkpoint.resume=auto).
# Environment knobs: NPROC_PER_NODE (processes per node; default = GPUs per node, or 1), RDZV_PORT (default: a
# free port on the head node), RDZV_JOIN_TIMEOUT (seconds the agents wait for each other; default 300),
# TORCHRUN_ARGS (extra torchrun flags, e.g. "--tee 3 --log-dir logs"). The virtualenv with runner installed
# must be active when calling sbatch (sbatch passes the environment on) or be activated below.
#
#SBATCH --job-name=runner
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=0
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
set -euo pipefail

nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:?run this script with sbatch}}
gpus=${SLURM_GPUS_PER_NODE:-0}
gpus=${gpus##*:}                              # "h100:8" -> 8
if [[ ${NPROC_PER_NODE:-} ]]; then
  nproc=$NPROC_PER_NODE
elif [[ $gpus -gt 0 ]]; then
  nproc=$gpus
else
  nproc=1
fi
cpus=${SLURM_CPUS_PER_TASK:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cpus / nproc > 0 ? cpus / nproc : 1 ))}

# The batch script runs on the first node of the allocation: it hosts the rendezvous, on a port free there.
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${RDZV_PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}

case " $* " in
  *" distributed="*) ;;
  *) set -- distributed=ddp "$@" ;;
esac
case " $* " in
  *" hydra.run.dir="*) ;;
  *) set -- "hydra.run.dir=outputs/slurm-$SLURM_JOB_ID" "$@" ;;
esac

# SIGUSR1 (from --signal, or `scancel --signal=USR1 --batch <job>`) reaches this script only ("B:"). Forward it
# to every process of the job step: the training processes checkpoint and stop (runner/checkpoint/preempt.py). torchrun's
# agents would die of SIGUSR1 (they do not handle it), so they are started with it ignored; the workers inherit
# that and install runner's own handler. `wait` returns when a trapped signal arrives, hence the loop. The agents are
# runner.launch.torchrun (torchrun whose status is 75 when the workers stopped for a preemption, not 1).
forward() {
  echo "multinode: SIGUSR1 received, forwarding it to the training processes of job $SLURM_JOB_ID"
  scancel --signal=USR1 "$SLURM_JOB_ID" || true
}
trap forward USR1

echo "multinode: $nodes node(s) x $nproc process(es), rendezvous $head:$port, job $SLURM_JOB_ID, OMP_NUM_THREADS=$OMP_NUM_THREADS"
# --kill-on-bad-exit: when one node's agent fails, SLURM stops the others at once instead of letting them wait.
# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of flags
srun --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1 --cpus-per-task="$cpus" --kill-on-bad-exit=1 \
  python -c 'import signal, sys; signal.signal(signal.SIGUSR1, signal.SIG_IGN); from runner.launch import torchrun; sys.argv[0] = "torchrun"; sys.exit(torchrun(sys.argv[1:]))' \
    --nnodes="$nodes" --nproc-per-node="$nproc" \
    --rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID" \
    --rdzv-conf="join_timeout=${RDZV_JOIN_TIMEOUT:-300}" --max-restarts=0 ${TORCHRUN_ARGS:-} \
    -m runner "$@" &
step=$!
status=0
while :; do
  wait "$step" && status=0 || status=$?
  kill -0 "$step" 2>/dev/null || break  # still running: wait returned for the trapped signal
done
exit "$status"
