#!/usr/bin/env bash
# One prepared GPU check (at most 15 minutes of timeouts on one H200; not run yet): the GPU tests (MoE HF
# checkpoint load/save, context-parallel attention, the Qwen3.5 hybrid and a GRPO run among them), then the
# checkpoint and training-step (dense, MoE and Qwen3.5 hybrid) benchmarks on CUDA; with 2 or more GPUs also the MoE step at expert parallel
# 1 and 2 and the context-parallel longest row (4.5 minutes more; one GPU skips them, saying why). Run from
# anywhere on a machine with a CUDA GPU and this repository:
#   bash benchmarks/gpu_check.sh
# Assumes torch with CUDA is already installed (CUDA wheels cannot be fetched offline); without
# torch it installs torch==2.13.0 from the configured index. Outputs go under $OUT when set
# (else ./gpu_check_out): pytest's log, the benchmark's tables and raw runs, and BENCHMARKS.md
# with the new "checkpoint-cuda", "train-cuda", "train-moe-cuda", "train-hybrid-qwen3_5-cuda" (and "train-moe-ep-cuda")
# sections.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python -c "import torch" 2>/dev/null || pip install torch==2.13.0
# No build isolation and no dependencies: nothing to fetch, and the CUDA torch stays. The
# repository is on PYTHONPATH anyway, so a failed editable install costs only the console script.
pip install -q --no-build-isolation --no-deps -e . >"$out/pip.log" 2>&1 || echo "editable install failed (see $out/pip.log)"
missing=$(python -c "import importlib.util as u; print(' '.join(m for m in ['numpy', 'torchao', 'safetensors', 'tokenizers', 'tqdm', 'yaml', 'pytest', 'pytest_timeout'] if u.find_spec(m) is None))")
if [ -n "$missing" ]; then
    pip install -q -e ".[test]" >>"$out/pip.log" 2>&1 || { echo "missing: $missing; pip could not install them (see $out/pip.log)"; exit 1; }
fi
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))" | tee "$out/device.txt"

status=0
start=$SECONDS
# tests/gpu includes the MoE checks: grouped-GEMM experts, the tiny MoE recipe, the MoE HF checkpoint
# load/save in both expert layouts, and QLoRA on experts (NF4 experts quantized on the GPU, first-step loss
# against transformers + peft over torchao NF4 on the CPU): seconds each on the one-rank pool the others use.
timeout 270 python -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$out/tests_gpu.log" || status=1
echo "tests/gpu: $((SECONDS - start)) s" | tee -a "$out/device.txt"

# 1b at world 1, one repeat: load, save and resume against DSD/DCP, each run in fresh processes.
start=$SECONDS
cp BENCHMARKS.md "$out/BENCHMARKS.md"
timeout 240 python -m benchmarks.checkpoint --device cuda --world 1 --size 1b --repeats 1 --load-rounds 1 \
    --bench-dir "$out/bench" --markdown "$out/BENCHMARKS.md" 2>&1 | tee "$out/benchmark_cuda.log" || status=1
echo "benchmark: $((SECONDS - start)) s" | tee -a "$out/device.txt"
rm -rf "$out/bench"/hf_* "$out/bench"/save_* "$out/bench"/resume_*  # GBs of fixtures; the runs JSON stays

# The training step on CUDA (world 1): full, LoRA, QLoRA at 1024 and 4096 tokens against transformers + FSDP2;
# the "train-cuda" section of $out/BENCHMARKS.md, its plots in $out/benchmarks/plots.
start=$SECONDS
timeout 150 python -m benchmarks.train --device cuda --world 1 --repeats 1 --steps 3 \
    --bench-dir "$out/bench_train" --markdown "$out/BENCHMARKS.md" 2>&1 | tee "$out/benchmark_train_cuda.log" || status=1
echo "train benchmark: $((SECONDS - start)) s" | tee -a "$out/device.txt"
rm -rf "$out/bench_train"/train_llama_*  # the HF fixture; the runs JSON stays

# The mixture-of-experts training step on CUDA (world 1, bf16): grouped-GEMM experts against transformers'
# grouped_mm + FSDP2; the "train-moe-cuda" section of $out/BENCHMARKS.md.
start=$SECONDS
timeout 90 python -m benchmarks.train_moe --device cuda --world 1 --dtype bf16 --repeats 1 --steps 3 \
    --bench-dir "$out/bench_train_moe" --markdown "$out/BENCHMARKS.md" 2>&1 | tee "$out/benchmark_train_moe_cuda.log" || status=1
echo "MoE train benchmark: $((SECONDS - start)) s" | tee -a "$out/device.txt"
rm -rf "$out/bench_train_moe"/train_moe_h*  # the HF fixture; the runs JSON stays

# The Qwen3.5 hybrid's training step on CUDA (world 1, bf16): shardtune (flash-linear-attention's kernel when
# installed, else its PyTorch rule) against transformers + FSDP2; the "train-hybrid-qwen3_5-cuda" section.
start=$SECONDS
timeout 60 python -m benchmarks.train_hybrid --device cuda --world 1 --dtype bf16 --repeats 1 --steps 3 \
    --bench-dir "$out/bench_train_hybrid" --markdown "$out/BENCHMARKS.md" 2>&1 | tee "$out/benchmark_train_hybrid_cuda.log" || status=1
echo "hybrid train benchmark: $((SECONDS - start)) s" | tee -a "$out/device.txt"
rm -rf "$out/bench_train_hybrid"/train_hybrid_*/  # the HF fixture; the runs JSON stays

# DeepSeek-V3's multi-head latent attention (dense layers) on CUDA, world 1, bf16, against transformers + FSDP2;
# the "train-hybrid-deepseek_v3-cuda" section.
start=$SECONDS
timeout 40 python -m benchmarks.train_hybrid --family deepseek_v3 --device cuda --world 1 --dtype bf16 --repeats 1 \
    --steps 3 --bench-dir "$out/bench_train_mla" --markdown "$out/BENCHMARKS.md" 2>&1 | tee "$out/benchmark_train_mla_cuda.log" || status=1
echo "latent attention train benchmark: $((SECONDS - start)) s" | tee -a "$out/device.txt"
rm -rf "$out/bench_train_mla"/train_hybrid_*/

# Expert parallel on CUDA (bf16): shardtune's MoE step at expert_parallel 1 and 2 on the same ranks (4, or 2 with
# 2-3 GPUs), transformers the loss reference, all-to-all bytes counted; the "train-moe-ep-cuda" section. NCCL
# takes one GPU per rank, so expert_parallel=2 needs at least 2 GPUs.
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    ep_world=$(( gpus >= 4 ? 4 : 2 ))
    start=$SECONDS
    timeout 120 python -m benchmarks.train_moe --device cuda --world "$ep_world" --expert-parallel 1,2 --dtype bf16 \
        --repeats 1 --steps 3 --bench-dir "$out/bench_train_moe_ep" --markdown "$out/BENCHMARKS.md" 2>&1 \
        | tee "$out/benchmark_train_moe_ep_cuda.log" || status=1
    echo "MoE expert-parallel benchmark (world $ep_world): $((SECONDS - start)) s" | tee -a "$out/device.txt"
    rm -rf "$out/bench_train_moe_ep"/train_moe_h*
else
    echo "MoE expert-parallel benchmark skipped: expert_parallel=2 needs one GPU per rank, at least 2; this machine has $gpus" \
        | tee -a "$out/device.txt"
fi

# Context parallel on CUDA (bf16 SDPA kernels): the longest row a step fits in a per-rank budget at cp 1 and 2 on 2
# GPUs (both modes; full checkpointing, and with activation offloading), against transformers + FSDP2; the
# "context-parallel-cuda" section. Then tokens/s at one 16k row, every stack training the same global batch, two
# rounds in turn ("context-parallel-speed-cuda"). Needs one GPU per rank, at least 2.
if [ "$gpus" -ge 2 ]; then
    start=$SECONDS
    shape=(--hidden 1024 --layers 8 --heads 16 --kv-heads 8 --vocab 32000)
    timeout 240 python -m benchmarks.context_parallel --device cuda --world 2 --budget-mib 16000 "${shape[@]}" \
        --start-seq 8192 --max-seq 262144 --steps 2 --refine 2 --multiple 1024 --checkpointing full,offload \
        --bench-dir "$out/bench_cp" --markdown "$out/BENCHMARKS.md" 2>&1 | tee "$out/benchmark_cp_cuda.log" || status=1
    timeout 120 python -m benchmarks.context_parallel --device cuda --world 2 --budget-mib 100000 "${shape[@]}" \
        --start-seq 16384 --max-seq 16384 --steps 3 --rounds 2 --same-batch --section context-parallel-speed \
        --bench-dir "$out/bench_cp" --markdown "$out/BENCHMARKS.md" 2>&1 | tee -a "$out/benchmark_cp_cuda.log" || status=1
    echo "context-parallel benchmark: $((SECONDS - start)) s" | tee -a "$out/device.txt"
else
    echo "context-parallel benchmark skipped: context_parallel=2 needs one GPU per rank, at least 2; this machine has $gpus" \
        | tee -a "$out/device.txt"
fi
exit $status
