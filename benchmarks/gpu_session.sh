#!/usr/bin/env bash
# One prepared session on a lent CUDA machine whose python3 already holds torch (no install step):
#   1. the GPU check (benchmarks/gpu_check.py: bf16 autocast, SDPA flash, compile and its break-even, NCCL);
#   2. the elastic-depth study (configs/studies/elastic.yaml, 24 runs) with --jobs 12 on the one GPU, stopped
#      with SIGINT after STUDY_SECONDS if it has not finished (every running training saves its step);
#   3. the study's folder (results, eval.json/probe.json per run, logs; no checkpoints) packed for the trip back.
# Usage, from the repository root:  OUT=<folder> bash benchmarks/gpu_session.sh [STUDY_SECONDS]
set -u
out=${OUT:?set OUT to a folder for the results}
study_seconds=${1:-420}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 MESHLM_CACHE=${MESHLM_CACHE:-/tmp/meshlm-cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" >> "$out/gpu.txt" 2>&1

timeout 120 python3 benchmarks/gpu_check.py --steps 60 --out "$out" > "$out/gpu_check.log" 2>&1
echo "gpu_check exit $?" >> "$out/gpu_check.log"

python3 -c "from meshlm.data.prepare import prepare_default; print(prepare_default())" > "$out/study.log" 2>&1
start=$(date +%s)
timeout -s INT -k 60 "$study_seconds" python3 -m meshlm.cli reproduce studies/elastic.yaml --jobs 12 --keep-going \
    >> "$out/study.log" 2>&1
echo "reproduce exit $? after $(( $(date +%s) - start )) s" >> "$out/study.log"
tar czf "$out/elastic.tgz" --exclude='step-*' --exclude='latest' runs/studies/elastic
ls -la "$out"
