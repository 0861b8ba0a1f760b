#!/usr/bin/env bash
# Every GPU check of the kernels in one go, for a machine with a CUDA GPU where torch, triton and
# pytest are installed (no venv, no network needed; run from the repository root):
#   1. the kernel and reference tests, compiled on the GPU, including the `slow` and `gpu` tiers
#      (bf16 natively, fp32 against the CPU reference, a cache past 2**31 elements);
#   2. the engine's tests on the GPU (Triton backend, tiny models: tokens and logits vs transformers,
#      preemption, sharing, beams), tensor parallelism (NCCL with two GPUs or more), and the demo;
#   3. the attention benchmark table (add --quick for fewer rows, --no-flex to skip FlexAttention),
#      the sliding-window decode timing (W = 4k vs none at 32k), and the engine benchmark on
#      GPT-2 small's shape (random weights, no download needed);
#   4. chapters 05, 06 and 09 run top to bottom on the GPU as IPython scripts (their `# %%` cells
#      are comments; `display` is IPython's; they need IPython, ipywidgets and matplotlib, else
#      they are skipped).
# Usage: bash benchmarks/gpu_check.sh [attention bench options]     Exit status: the tests'.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compile for the GPU; the interpreter would test nothing new
PY=${PYTHON:-python}
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU here'" || exit 1
$PY -c "import torch, triton; print(torch.cuda.get_device_name(0), torch.__version__, triton.__version__)"
$PY -m pytest -q -m "" -p no:cacheprovider -o addopts="" \
    tests/test_attention.py tests/test_kernels.py tests/test_kernel_inputs.py \
    tests/test_kernels_random.py tests/test_sliding_window_attention.py
status=$?
$PY -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/test_engine.py tests/test_engine_parts.py tests/test_engine_random.py || status=1
$PY -m pytest -q -m "" -p no:cacheprovider -o addopts="" tests/test_hybrid_engine.py || status=1
# Tensor parallelism: the CPU (gloo) tests, and NCCL + Triton where there are two GPUs or more.
$PY -m pytest -q -m "" -p no:cacheprovider -o addopts="" tests/test_tensor_parallel.py || status=1
$PY -m pagedlearn demo --model tiny-gpt2 | tail -12 || status=1
$PY benchmarks/bench_attention.py "$@"
$PY benchmarks/bench_sliding_window.py
$PY benchmarks/bench_engine.py --model gpt2-size-random
$PY benchmarks/bench_engine.py --model gpt2-size-random --num-prompts 128 --max-tokens 128
$PY benchmarks/bench_memory_bound.py --model gpt2-size-random --device cuda
$PY -c "from pagedlearn.sim.swap_recompute import measure, GPT2_SIZE_RANDOM as M, FIELDS
for r in measure(model=M, device='cuda'): print({k: r[k] for k in FIELDS})"
if $PY -c "import ipywidgets, matplotlib, IPython" 2>/dev/null; then
    for nb in 05_paged_attention_kernel 06_live_gpt2_opt 09_hybrid_models; do
        echo "== chapter $nb on the GPU"
        (cd notebooks && MPLBACKEND=Agg PAGEDLEARN_OFFLINE=1 HF_HUB_OFFLINE=1 \
            $PY -m IPython --no-banner "$nb.py" > /dev/null) && echo "   ran to the end" || status=1
    done
else
    echo "== chapters 05, 06, 09 skipped: ipywidgets, matplotlib or IPython is not installed here"
fi
exit $status
