#!/usr/bin/env bash
# Hang detection on a CUDA GPU (one GPU: one rank, NCCL): `shardctl submit` of a tiny
# Llama with device cuda under the node watchdog, the rank stopped (SIGSTOP) after
# its first checkpoint, then: HUNG within the timeout with its stack, exit 124, and a
# resubmit that resumes and finishes. Prints what benchmarks/README.md records.
#
#   bash benchmarks/gpu_hang_check.sh [WHEELS_DIR]
#
# WHEELS_DIR: wheels of shardctl's pure dependencies (pydantic, jinja2, click, rich,
# pyyaml) for a machine without network; torch and transformers must be installed.
set -euo pipefail
wheels="${1:-}"
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --find-links "$wheels" pydantic jinja2 click rich pyyaml
fi
repo="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# shardctl from this checkout without installing it: the package is the repo root.
mkdir -p "$work/pkg" && ln -s "$repo" "$work/pkg/shardctl"
export PYTHONPATH="$work/pkg${PYTHONPATH:+:$PYTHONPATH}"
shardctl() { python3 -m shardctl.orchestrator.cli "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'

cat >"$work/job.yaml" <<EOF
name: gpu-hang
run_dir: $work/run
resources: {nodes: 1, procs_per_node: 1, device: cuda}
strategy: {backend: fsdp, sharding: full_shard, precision: bf16-mixed}
train:
  model: {llama: {vocab_size: 256, hidden_size: 256, intermediate_size: 688,
                  num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 4,
                  max_position_embeddings: 256}}
  data: {builtin: python-stdlib}
  steps: 100000
  micro_batch_size: 8
  seq_len: 256
  log_every: 10
checkpoint: {every_steps: 200, keep: 2}
watchdog: {hang_timeout_s: 20}
EOF
cd "$work"
shardctl submit job.yaml
until ls run/checkpoints/step-*[0-9] >/dev/null 2>&1; do sleep 0.5; done
rank="$(python3 - "$work/run" <<'PY'
import os, sys
for pid in os.listdir("/proc"):
    if not pid.isdigit():
        continue
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        continue
    if f"SHARDCTL_RUN_DIR={sys.argv[1]}".encode() in env and b"RANK=0" in env \
            and cmd.split(b"\0")[1:3] == [b"-u", b"-m"]:
        print(pid)
PY
)"
echo "rank 0: pid $rank; stopping it"
kill -STOP "$rank"
t0=$(date +%s.%N)
while shardctl status gpu-hang | grep -q RUNNING; do sleep 0.5; done
t1=$(date +%s.%N)
echo "ended $(python3 -c "print(round($t1 - $t0, 1))") s after SIGSTOP (hang_timeout_s 20)"
shardctl status gpu-hang || true
python3 -c "import json; m = json.load(open('run/HUNG')); print({k: m[k] for k in ('step', 'first', 'idle_s', 'timeout_s')})"
grep -c "Python stack, most recent call first" run/logs/hang-attempt0-node0.txt
grep -m3 -E "loop.py|fsdp.py" run/logs/hang-attempt0-node0.txt
kill -CONT "$rank" 2>/dev/null || true
newest=$(ls -d run/checkpoints/step-*[0-9] | sort | tail -1 | sed 's/.*step-0*//')
shardctl submit job.yaml --set "train.steps=$((newest + 20))" --wait
grep -m1 "resumed at step" run/logs/launcher.out
shardctl status gpu-hang
