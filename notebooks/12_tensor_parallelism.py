# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 12 · Tensor parallelism: one block table, N workers
#
# **Why this chapter.** Every chapter so far ran the whole model in one process. The largest
# models the paper serves do not fit one GPU: it runs OPT-66B (132 GB of fp16 weights, its
# Table 1 in section 6.1) on four 40 GB A100s and OPT-175B (346 GB) on eight 80 GB A100s.
# Section 4.6 of the paper, *Distributed Execution*, says how PagedAttention carries over: the
# model is split across the GPUs Megatron-LM style, but the **block manager is not**. One
# scheduler with one KV cache manager hands out block ids, and every GPU stores *its share* of
# each token's keys and values at those same block ids. pagedlearn does the same with
# `LLM(..., tensor_parallel_size=N)`: N worker processes on the CPU (or on N GPUs), one driver.
# This chapter opens it up and watches it run.
#
# **What you will learn**
#
# 1. **section 4.6 in one picture**: what the driver keeps, what each worker keeps, what
#    travels between them in a step, and where pagedlearn differs from the paper and vLLM;
# 2. **what is sharded**: the column-wise / row-wise plan of GPT-2 and OPT (vLLM's
#    `ColumnParallelLinear` / `RowParallelLinear`), what is replicated, and each worker's bytes
#    of weights and KV, read from the workers themselves;
# 3. **one engine, two workers**: the same greedy tokens as one process, and the workers' KV
#    slabs, put side by side along the head axis, equal to one process's slab;
# 4. **see it**: the live view with each worker's slab under the driver's pool, while two
#    sequences fork and one copies on write;
# 5. **why the block table needs no synchronisation** beyond the step's input: the step message
#    itself, field by field, and its size;
# 6. **what a step costs**: one worker against two on the same batch, with the message, the
#    workers' time and the all-reduces measured separately;
# 7. **the memory arithmetic**: what 1/N of the weights and 1/N of every token's KV do to the
#    token slots, for the paper's Table 1, recomputed on PyTorch's meta device;
# 8. and at the end, questions to check yourself, answered by the runs above.
#
# **What you need.** A CPU; no network. The engines run the offline `tiny-gpt2` (2 layers, 4
# heads of 16, random weights, a byte tokenizer: one token per character) on a pool of 64 blocks
# of 4 tokens; the OPT models of Table 1 appear only as shapes on the meta device. The workers
# are separate processes that talk through `torch.distributed` (gloo on CPUs; NCCL, one GPU per
# worker, where the machine has enough GPUs). Starting them takes a few seconds the first time.
# Block ids and bytes are the same on every machine, and the tokens almost always are (section 3
# says why not bit for bit); the cells that print times are
# tagged `timing`: read them for what to look for, not for their values.

# %%
from pagedlearn.cli.notebook import setup

env = setup()

# %%
import operator
import os
import pickle
import statistics
import time

import torch
from IPython.display import display

from pagedlearn import LLM, PagedLearnError, SamplingParams
from pagedlearn.errors import WorkerError
from pagedlearn.models import load
from pagedlearn.models.runner import prepare_inputs
from pagedlearn.parallel import check_tensor_parallel, tensor_parallel_plan
from pagedlearn.parallel.sharding import split_sizes
from pagedlearn.sim.tensor_parallel_memory import (
    OPT_SIZES,
    GiB,
    fewest_gpus,
    format_scaling,
    format_table1,
    opt_config,
    table1,
    tensor_parallel_memory,
)
from pagedlearn.viz import LiveBlockView, draw_worker_slabs

MODEL, BLOCK_SIZE, NUM_BLOCKS = "tiny-gpt2", 4, 64
# Tensor parallelism on CUDA puts one worker on each GPU: with fewer than two, both engines of
# this chapter run on the CPU (so that the one-worker engine is measured on the same device).
DEVICE = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
# One "device" each: the one-process engine gets the CPU threads one of two workers gets (the
# executor gives each worker pagedlearn's thread count // N: pagedlearn/cli/threads.py).
THREADS = torch.get_num_threads()  # what `import pagedlearn` chose for this machine
torch.set_num_threads(max(1, THREADS // 2))
print(f"engines on: {DEVICE}")

# %% [markdown]
# ## 1. Section 4.6 in one picture
#
# The paper runs models larger than a GPU "Megatron-LM style" (Shoeybi et al. 2019): every
# linear layer is split across the N GPUs, which all run the same program on the same input
# tokens (SPMD) and add up their partial results with an **all-reduce**. Attention is split by
# **head**: each GPU computes the heads it holds. Because every shard processes the same tokens,
# every shard needs KV for the same positions; so vLLM keeps **one KV cache manager**, inside
# the centralized scheduler (the paper's Figure 4), and every worker shares its logical-to-
# physical mapping. Each worker has the same physical block ids, and stores only *its* heads of
# each block. In every step the scheduler prepares a control message -- the input token ids and
# each request's block table -- and broadcasts it to the workers; they run the model, read the
# KV cache through those block tables, all-reduce among themselves without the scheduler, and
# send the sampled tokens back. So the workers never synchronise on memory management: all they
# need arrives with the step's input. In pagedlearn (`pagedlearn/parallel/executor.py`):
#
# ```
# driver process (LLM, LLMEngine)                   worker processes (parallel/worker.py)
# Scheduler + KVCacheManager: ONE block table
#   │ prepare_inputs(scheduled) -> StepInputs        rank 0: KV heads 0 .. H/N-1    ┐ all-reduce
#   ├──── the same pickled bytes to every worker ──> rank 1: KV heads H/N .. 2H/N-1 ┤ twice per
#   │     (token ids, positions, slots, tables)      ...                            ┘ layer
#   <──── logits (S, vocab) from rank 0 ──────────── every rank computes the same logits
#   sample, append, fork, free: on the driver only
# ```
#
# One difference from the paper: its workers send back *sampled tokens*; pagedlearn's rank 0
# sends back the *logits* (one float32 row of the vocabulary per sequence), and the driver
# samples, so that sampling is the same code with one worker or many. vLLM V1 samples on the
# workers, as the paper says, and its executor reads the answer of one rank only (TP rank 0 of
# the last pipeline stage: `_get_output_rank` in `vllm/v1/executor/multiproc_executor.py`).
#
# ## 2. What is sharded
#
# A transformer layer is two pairs of matrix multiplications (attention, then the MLP). Megatron
# splits the first of each pair by its *output columns* ("colwise": worker `r` gets heads
# `r*H/N ..` of q, k and v, or its slice of the MLP's inner width) and the second by its *input
# rows* ("rowwise": each worker multiplies its slice and produces a partial sum of the whole
# output, which the all-reduce adds up). `tensor_parallel_plan` writes it in the format of
# transformers' `base_model_tp_plan` (transformers ships no plan for GPT-2 or OPT, so these live in
# `pagedlearn/parallel/sharding.py`):

# %%
models = {name: load(name).model for name in ("tiny-gpt2", "tiny-opt")}
for name, model in models.items():
    print(f"{name}: must divide by N: {split_sizes(model)}")
    for module, style in tensor_parallel_plan(model).items():
        print(f"  {module:<42} {style}")

# %% [markdown]
# vLLM builds the same split into its model code instead of a plan: in
# `vllm/model_executor/models/opt.py`, `qkv_proj` is a `QKVParallelLinear` (a
# `ColumnParallelLinear` that keeps q, k and v of the same heads together), `out_proj` and `fc2`
# are `RowParallelLinear`, `fc1` is `ColumnParallelLinear`; GPT-2's `c_attn`, `c_proj` and
# `c_fc` in `gpt2.py` likewise. GPT-2 computes q, k and v with *one* fused matrix whose output
# is `[q | k | v]`; cut into two contiguous halves, worker 0 would get all of q and half of k,
# so pagedlearn reorders its output columns to `[q_0 k_0 v_0 | q_1 k_1 v_1]` first (`prepare` in
# `sharding.py`); vLLM's `QKVParallelLinear` does the same when it loads a fused weight (its
# `weight_loader` cuts it into q, k and v, then takes this rank's heads of each).
#
# Every worker holds whole heads, so N must divide the heads (and the MLP's width). A count that
# does not is refused before any process starts:

# %%
try:
    check_tensor_parallel(models["tiny-gpt2"], 3)
except PagedLearnError as e:
    print(f"{type(e).__name__}: {e}")

# %% [markdown]
# What is *not* in the plan stays whole on every worker: the token and position embeddings, the
# LM head (tied to the token embedding in both models), the final layer norm, each layer's norms
# and the biases of the row-wise layers (added once, after the sum). vLLM splits the embedding
# and LM head by vocabulary rows too (`VocabParallelEmbedding`, `ParallelLMHead`); pagedlearn
# keeps them whole: little for OPT at the paper's sizes (0.7% of OPT-66B's weights), but a third
# of tiny-gpt2's (section 3), and counted in section 7.
#
# ## 3. One engine, two workers
#
# Two engines with the same settings: `tp1`, the model in this process, and `tp2`, two worker
# processes. `verbose=False` keeps the constructor quiet (what it would print includes the
# workers' process ids, which change on every run; the pictures below show them, as labels);
# the same facts come from the workers themselves, through `llm.collective_rpc("describe")`
# (vLLM's name: run a method on every worker, answers by rank).

# %%
kw = dict(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, device=DEVICE, verbose=False)
tp1 = LLM(MODEL, **kw)
tp2 = LLM(MODEL, tensor_parallel_size=2, **kw)
workers = tp2.collective_rpc("describe")
print("worker processes:", len(workers), "| each its own pid, none this one's:",
      len({w["pid"] for w in workers} | {os.getpid()}) == 3)  # fmt: skip
for w in workers:
    print(f"rank {w['rank']} on {w['device']}: KV heads {w['kv_heads']}, "
          f"KV slab {w['kv_bytes']:,} B, weights {w['weight_bytes']:,} B")  # fmt: skip
(one,) = tp1.collective_rpc("describe")  # with one worker: this process, the whole model
print(f"tp=1 (this process): KV heads {one['kv_heads']}, KV slab {one['kv_bytes']:,} B, "
      f"weights {one['weight_bytes']:,} B")  # fmt: skip
cache = tp2.engine.kv_cache  # the driver's handle on the two slabs (ShardedKVCache)
print(f"KV bytes per token: {cache.spec.bytes_per_token:,} for the model, "
      f"{cache.worker_spec.bytes_per_token:,} in each worker")  # fmt: skip

# %% [markdown]
# Each worker's KV slab is half of one process's: the same 64 blocks of 4 tokens, 2 of the 4
# heads. Its weights are more than half, because of what stays whole. The bytes add up exactly,
# parameter by parameter of the one-process model:

# %%
named = dict(tp1.engine.model.named_parameters())
size = {n: p.numel() * p.element_size() for n, p in named.items()}
outside = sum(b for n, b in size.items() if ".h." not in n)  # embeddings (= LM head), final norm
in_layers = sum(b for n, b in size.items() if ".h." in n)
whole_in_layers = sum(b for n, b in size.items()  # each layer's norms, the row-wise biases
                      if ".h." in n and (".ln_" in n or n.endswith("c_proj.bias")))  # fmt: skip
per_worker = outside + whole_in_layers + (in_layers - whole_in_layers) // 2
print(f"whole model {sum(size.values()):,} B = outside the layers {outside:,} + layers "
      f"{in_layers:,}")  # fmt: skip
print(f"one worker: {outside:,} (whole) + {whole_in_layers:,} (norms, row-wise biases: whole) "
      f"+ half of the other {in_layers - whole_in_layers:,} = {per_worker:,} B")  # fmt: skip
assert per_worker == workers[0]["weight_bytes"] == workers[1]["weight_bytes"]

# %% [markdown]
# In this tiny model, with a vocabulary of 258 and 512 positions beside two layers 64 wide, the
# embeddings are a third of the weights; in OPT-66B they are 0.7%, in OPT-175B 0.4%.
#
# **The same tokens.** Greedy decoding on both engines, with the top logprob of every token:

# %%
PROMPTS = ["Hello world, this is", "The paged attention kernel", "abc"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, logprobs=1)
outs1 = tp1.generate(PROMPTS, GREEDY, use_tqdm=False)
outs2 = tp2.generate(PROMPTS, GREEDY, use_tqdm=False)
diff = 0.0
for a, b in zip(outs1, outs2, strict=True):
    x, y = a.outputs[0], b.outputs[0]
    print(f"{a.prompt!r:<29} tp=1 {list(x.token_ids)}\n{'':<29} tp=2 {list(y.token_ids)}")
    assert x.token_ids == y.token_ids
    for p, q in zip(x.logprobs, y.logprobs, strict=True):
        diff = max(diff, *(abs(p[t].logprob - q[t].logprob) for t in p))
assert diff < 1e-4
print("the same tokens; every logprob within 1e-4 of one process's")

# %% [markdown]
# The tokens are the same, and the logprobs agree within the 1e-4 the cell checks, though not
# always to the last bit: a row-wise layer computes two partial sums and adds them, which rounds
# differently from one matrix multiplication over the whole width (float addition is not
# associative; how the sums are split also depends on the CPU and its threads). With sampling,
# a near-tie could in principle flip. `tests/test_tensor_parallel.py` checks the tokens for forks,
# beam search, prefix hits, chunked prefill and both kinds of preemption, the logprobs of greedy
# decoding, and the slabs after all but the recompute run.
#
# ## 4. See it: one block table, two slabs
#
# `LiveBlockView(tp2)` is chapter 06's view; with more than one worker it draws a second picture
# under the pool: the driver's one block table over each worker's KV slab. A worker's cell is
# coloured when that worker has written its heads of that block (in layer 0). Three requests: a
# parallel-sampling request with `n=2` (two sequences sharing their prompt's blocks, as in
# chapter 03), a greedy one, and one whose prompt starts with section 3's first prompt, so that
# its first full blocks come from the prefix cache (chapter 04). The same three go to `tp1`,
# in the same order, so its block manager hands out the same block ids.

# %%
MIX = [
    ("fork", "Once upon a time,", SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=7)),
    ("greedy", "abc", SamplingParams(max_tokens=8, temperature=0)),
    ("cached", "Hello world, this is a", SamplingParams(max_tokens=8, temperature=0)),
]
view = LiveBlockView(tp2, delay=0.3)
display(view)
for llm in (tp1, tp2):
    for rid, prompt, params in MIX:
        llm.engine.add_request(rid, prompt, params)

# %% [markdown]
# "Once upon a time," is 17 tokens: four full blocks and one holding a single token, all shared
# by the two sequences after the prefill. In the first decode step each sequence writes its next
# token into that last block; it is shared, so the block manager first gives one sequence a
# copy (copy-on-write, chapter 03). The copy is a message of its own: the driver sends the
# `(src, dst)` pair to every worker, each copies *its* heads of the block, and only then does the
# step's forward go out (`ShardedKVCache.copy_blocks`). Two steps, on both engines:

# %%
view.run(max_steps=2)
for _ in range(2):
    tp1.engine.step()
for name, llm in (("tp=1", tp1), ("tp=2", tp2)):
    stats = llm.engine.stats()
    tables = {s: llm.engine.kv.block_table(s) for s in ("fork.0", "fork.1", "cached.0")}
    print(f"{name}: step {llm.engine.num_steps}, copy-on-write copies {stats.cow_copies}, "
          f"prefix hits {stats.prefix_hit_tokens} tokens; {tables}")  # fmt: skip
display(view)

# %% [markdown]
# The view now (in JupyterLab the slab picture sits under this pool picture and moves with it;
# here it is drawn on its own, with the block tables beside it, in the view's colours):

# %%
draw_worker_slabs(tp2, palette=view.palette, title="tiny-gpt2, 2 workers, after the first decode")

# %% [markdown]
# What to look for: every coloured column of the driver's row is coloured in *both* workers'
# bands, in all four head rows -- the same block ids, each worker with its own two heads. The two
# `fork` sequences share their first four blocks and differ in the fifth: `fork.1` kept the
# original (block 24), `fork.0` got the copy (block 27). The `cached` request's first five
# blocks are section 3's first prompt's, written by that earlier request and read again now, in
# both workers, without either worker knowing it: only the driver's prefix cache knew. Light
# grey: free blocks still in the prefix cache (their K/V written, findable by hash). White: never
# written, or a finished request's partial block that nothing points at any more.
#
# Are the two halves really one cache? Read every worker's slab -- any picklable callable that
# the workers can import works with `collective_rpc`: a `Worker` method's name, a function of
# the package, or, here, the standard library's `operator.attrgetter` -- and put them side by
# side along the head axis:

# %%
# On GPUs each slab comes back on its worker's device: gather them on the CPU.
parts = [slab.cpu() for slab in tp2.collective_rpc(operator.attrgetter("kv_cache.slab"))]
whole = tp1.engine.kv_cache.slab.cpu()  # (K and V, layers, blocks, block_size, heads, head_dim)
print("worker slabs:", [tuple(p.shape) for p in parts], "-> one process's:", tuple(whole.shape))
torch.testing.assert_close(torch.cat(parts, dim=4), whole, atol=1e-5, rtol=1e-5)
print("side by side along the heads, they are one process's slab (within 1e-5), block for block")

# %% [markdown]
# The rest of the run, on both engines; the view goes on redrawing, and its last picture is the
# pool when every request has finished (their full blocks stay cached, light grey). Then the view
# is closed: it redraws at every step, one rpc to every worker and a render each time, which
# would be part of every step measured in section 6.

# %%
finished = view.run()
while tp1.engine.has_unfinished_requests():
    tp1.engine.step()
print("finished:", sorted(o.request_id for o in finished))
display(view)
view.close()  # it drew every step, with an rpc to the workers: not part of what we measure

# %% [markdown]
# ## 5. Why the block table needs no synchronisation
#
# Nothing in a worker decides anything. Here is everything a worker object has (the public
# names of `pagedlearn.parallel.worker.Worker`, read in the worker processes with `dir`):

# %%
print([name for name in tp2.collective_rpc(dir)[0] if not name.startswith("_")])

# %% [markdown]
# A model shard, a KV cache (the slab and, for swaps, its CPU pool), a runner and its rank: no
# scheduler, no `KVCacheManager`, no allocator, no prefix cache. Only the driver allocates, frees,
# forks and hashes blocks. A worker writes each new token's K/V at the slot it is told and reads
# the blocks the table it is told lists; it never learns which request a block belongs to. So
# there is nothing for the workers to agree on: no lock, no second copy of the table to keep in
# step. All the memory management a worker needs arrives with the step's input.
#
# That input is a `StepInputs` (`pagedlearn/models/runner.py`): the scheduled sequences packed
# into plain ints by `prepare_inputs`, which the executor pickles once and writes to every
# worker's pipe. To see it, we wrap the runner's `execute` for a short run so that it keeps a
# copy of what it is given (`del` removes the wrapper: the class's method shows again):

# %%
seen = []
runner = tp2.engine.runner  # the TensorParallelExecutor
execute = runner.execute
runner.execute = lambda seqs: seen.append(prepare_inputs(seqs, runner.num_groups)) or execute(seqs)
try:
    tp2.generate(["Paged attention", "splits the heads"], SamplingParams(max_tokens=3,
                 temperature=0), use_tqdm=False)  # fmt: skip
finally:
    del runner.execute
for step, x in enumerate(seen):
    print(f"step {step}: {x}")

# %% [markdown]
# The first step is the prefill of both prompts, packed into one row of 31 tokens: `input_ids`
# and `positions` per token, `cu_seqlens_q` where each sequence's tokens start, `slot_mappings`
# where each token's K/V go (`block_id * 4 + offset`, chapter 02), `context_lens`, and the block
# tables flattened to `S x width` with `-1` padding. In the decode steps there is one token per
# sequence; the block tables are whole every step, as the paper describes the control message
# ("the block table for each request"). vLLM V1 sends less: its `SchedulerOutput` carries a new
# request's block ids once (`NewRequestData.block_ids`) and afterwards only the blocks added
# since (`CachedRequestData.new_block_ids`, `vllm/v1/core/sched/output.py`; the whole table
# again for a request resumed after preemption); its workers keep the tables.
#
# What that costs in bytes, against what the step writes into the KV cache of each worker (which
# never travels: each worker computes its own heads' K/V from the token ids):

# %%
per_token = tp2.engine.kv_cache.worker_spec.bytes_per_token
for step, x in enumerate(seen):
    message = len(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL))
    tokens, seqs = len(x.input_ids), x.num_seqs
    print(f"step {step}: {tokens:>2} tokens of {seqs} sequences, tables {seqs} x {x.widths[0]}: "
          f"message {message:,} B to each worker; K/V written there {tokens * per_token:,} B; "
          f"logits back from rank 0: {seqs} x {tp2.engine.model.config.vocab_size} x 4 = "
          f"{seqs * tp2.engine.model.config.vocab_size * 4:,} B")  # fmt: skip

# %% [markdown]
# The message grows with the tokens and with the tables (a sequence of `L` tokens has about
# `L / 4` block ids here, `L / 16` with vLLM's default block size), not with the model: the same
# step would send OPT-175B's workers about the same few hundred bytes. The logits coming back
# grow with the vocabulary: OPT's is 50,272, so 201 kB per sequence per step in float32; vLLM's
# workers sample and send back token ids instead.
#
# ## 6. What a step costs
#
# A tensor-parallel step does what a one-process step does, plus:
#
# ```
# step(N) = driver: schedule, prepare_inputs                       (as with one process)
#         + arrival: pickle once, write N pipes (`send`), each worker reads its copy
#         + the slowest worker's busy time:   1/N of the layers' matrix multiplications
#                                           + what is whole on every worker (embeddings, norms,
#                                             LM head), computed in full by each
#                                           + 2 x layers all-reduces of a (T, hidden) activation
#         + rank 0's logits through its pipe, then sampling on the driver  (as with one process)
# ```
#
# The executor measures the middle part for each message (`runner.last_timings`): `send`,
# `received` per rank (from the start of `send`, before pickling, to the worker's receive: one
# clock on one machine; it *contains* `send`) and `busy` per rank (from receive to answer).
# `Worker.time_all_reduce(T)` times one all-reduce of `T` tokens' activations among the workers
# (the median of 20 back to back; the cell keeps the lowest of three such medians, the one least
# disturbed by other work). The same batch on both engines: 4 sequences of 32 random token ids, a
# prefill step of 128 tokens, then 16 decode steps of 4 tokens; five rounds, taking turns, each
# with new prompts (no prefix hits):

# %% tags=["timing"]
BATCH, PROMPT_LEN, DECODE_STEPS, ROUNDS = 4, 32, 16, 5
gen = torch.Generator().manual_seed(0)


def run_batch(llm, tag, prompts):
    """One prefill step and DECODE_STEPS decode steps; each step's wall time and timings."""
    engine = llm.engine
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0, dict(getattr(engine.runner, "last_timings", {}))))
    assert len(steps) == DECODE_STEPS + 1  # one prefill, then one token per sequence a step
    return steps


timed = {1: [], 2: []}
for r in range(ROUNDS):
    prompts = torch.randint(0, 256, (BATCH, PROMPT_LEN), generator=gen).tolist()
    for n, llm in ((1, tp1), (2, tp2)):
        timed[n] += [(i == 0, *s) for i, s in enumerate(run_batch(llm, f"round{r}", prompts))]


def med(values):
    return statistics.median(values) * 1e3


for phase, prefill in (("prefill (128 tokens)", True), ("decode (4 tokens)", False)):
    one = med([t for p, t, _ in timed[1] if p == prefill])
    rows = [(t, tm) for p, t, tm in timed[2] if p == prefill]
    two = med([t for t, _ in rows])
    window = med([max(tm["received"][k] + tm["busy"][k] for k in tm["busy"]) for _, tm in rows])
    print(f"{phase}: step, median over {len(rows)}: N=1 {one:.2f} ms, N=2 {two:.2f} ms "
          f"(x{two / one:.2f})")  # fmt: skip
    print(f"  N=2: send {med([tm['send'] for _, tm in rows]):.3f} ms; arrival "
          + ", ".join(f"rank {k} {med([tm['received'][k] for _, tm in rows]):.3f}" for k in (0, 1))
          + " ms; busy "
          + ", ".join(f"rank {k} {med([tm['busy'][k] for _, tm in rows]):.2f}" for k in (0, 1))
          + f" ms; send to the last worker's answer {window:.2f} ms; the rest (driver, "
          f"logits back) {two - window:.2f} ms")  # fmt: skip
    print("  N=2: of busy, inside the step's all-reduces: "
          + ", ".join(f"rank {k} {med([tm['all_reduce'][k] for _, tm in rows]):.2f}"
                      for k in (0, 1)) + " ms")  # fmt: skip
layers = tp2.engine.model.config.n_layer
for tokens in (BATCH, BATCH * PROMPT_LEN):
    # The slower worker's median of 20; the lowest of three such: the least disturbed.
    one_reduce = min(max(tp2.collective_rpc("time_all_reduce", (tokens,))) for _ in range(3))
    print(f"all-reduce of ({tokens}, {tp2.engine.model.config.n_embd}) float32: "
          f"{one_reduce * 1e3:.3f} ms; x 2 x {layers} layers = "
          f"{2 * layers * one_reduce * 1e3:.3f} ms per step")  # fmt: skip
print(f"threads: {torch.get_num_threads()} for N=1 (this process), {max(1, THREADS // 2)} for "
      f"each N=2 worker, of the {THREADS} pagedlearn chose; load average "
      f"{os.getloadavg()[0]:.2f}")  # fmt: skip

# %% [markdown]
# What to look for. Start with N=1's whole step: a 2-layer, 64-wide model's forward, the
# scheduler and sampling. Then put beside it each part of N=2's step that one process does not
# have: the later of the two arrivals (it contains `send`: count it once), and the four
# all-reduces of the last lines. Halving tiny-gpt2's
# compute can save at most half of N=1's forward, so wherever those parts are larger than that,
# N=2 is slower than N=1, whatever the machine.
#
# Then look inside each worker's `busy`: it holds the worker's input preparation, its share of
# the compute, what is whole on every worker, and its four all-reduces, which the worker times
# as it makes them (`all_reduce` in `last_timings`: the clock around each `dist.all_reduce` the
# forward calls, `AllReduceClock` in `parallel/worker.py`). Compare that with the same
# all-reduce timed alone (the last lines, times four). Timed alone, both workers enter each
# all-reduce together; in a step, each all-reduce ends only when the later worker has joined it
# (compare the two arrivals: the first to arrive waits), and on a machine with as few cores as
# workers plus one driver they also take turns on the cores.
#
# Every number is a median, but a burst of other work on a shared machine can still move one (the
# last line prints the load average): run the cell again and see which numbers hold still.
#
# The balance moves with the model: per step, the message and the pipes cost about the same
# whatever the model; the compute grows with `hidden^2 x layers` and is divided by N; the
# all-reduces move `T x hidden` values twice per layer. A model is split across GPUs because it
# does not fit one, not to make a small one faster; exercise 2 measures a larger model.
#
# Above, `send` is the pickling and writing of the step message, and `arrival` the time from the
# start of `send` until each worker has read it. vLLM V1 broadcasts its `SchedulerOutput` through
# a shared-memory message queue (`MessageQueue`, `vllm/distributed/device_communicators/
# shm_broadcast.py`, used by `multiproc_executor.py`) instead of one pipe per worker; on GPUs its
# all-reduces go through NCCL (or custom all-reduce kernels), not gloo.
#
# ## 7. The memory arithmetic: the paper's Table 1
#
# With N workers, each holds 1/N of the weights `W` (the ideal Megatron split) and `B/N` bytes
# of every token's KV (its heads). On GPUs of `M` bytes:
#
# ```
# per worker: slots = (M - W/N) / (B/N)
# in total:   slots = (N*M - W) / B        (multiply top and bottom by N: the N cancels)
# ```
#
# A token slot means the same thing on every worker (one block table), and the slots are set by
# the memory left over in total. `pagedlearn.sim.tensor_parallel_memory` builds the OPT configs
# of Table 1 (section 6.1) on PyTorch's **meta** device -- shapes, no weights -- and recomputes
# the table, beside the paper's numbers. The columns are explained in its first line; the units
# (GiB against GB) and the reserve a real server keeps aside are worked out in its docstring:

# %%
rows = table1()  # table1()'s default utilization: 0.90 (vLLM 0.33's default: 0.92)
print(format_table1(rows))

# %% [markdown]
# Reading it: with all of each GPU for weights and KV ("slots with no reserve"), the three
# settings would hold 21.0K, 17.1K and 71.6K token slots; the paper's 15.7K, 9.7K and 60.1K are
# fewer, because a server keeps memory aside (activations, the runtime): the reserve the
# paper's slots imply is about 4.1 GiB per A100-40GB and 6.3 GiB per A100-80GB. Modelling the
# whole reserve as 10% of each GPU (what `gpu_memory_utilization=0.90` leaves unused; vLLM also
# takes its profiled activations out of the rest), the per-worker formula comes within +0.7%,
# +1.3% and -5.1% of the paper. Its "Memory
# for KV cache" column reads as GiB (12, 21, 264: the paper's slot counts come out of it only in
# GiB); its "Parameter size" column is decimal GB (26, 132, 346 against our 25.7, 131.4, 349.2).
# The last number of each line is what pagedlearn's own split would leave, with the embeddings
# whole on every worker (section 2): 12.5% fewer slots for OPT-66B on four GPUs, 3% for OPT-175B
# on eight.
#
# N GPUs do not multiply the slots by N: they add N x M bytes and pay for the weights once.
# OPT-13B on one, two and four 40 GiB GPUs, per worker and in total:

# %%
print(format_scaling("OPT-13B", gpu_gib=40, gpus=(1, 2, 4)))
for name in OPT_SIZES:
    config = opt_config(name)
    fewest = [fewest_gpus(config, gib * GiB) for gib in (40, 80)]
    print(f"{name}: the fewest GPUs that hold it (and one token): "
          f"{fewest[0]} x 40 GiB, {fewest[1]} x 80 GiB")  # fmt: skip

# %% [markdown]
# Two GPUs give OPT-13B 3.5 times the slots of one, four give 8.5 times: every GPU added brings
# 40 GiB, and the 23.9 GiB of weights are paid only once. What N does not cancel from is whether
# the model fits at all: on N GPUs each holds `W/N`, and N must divide the heads, so OPT-66B
# needs four 40 GiB GPUs (its Table 1 setting) and OPT-175B twelve (not nine: nine do not divide
# its 96 heads) -- or six of 80 GiB. On eight 40 GiB GPUs (the paper's count, though its GPUs
# have 80 GB) each would have to hold 40.65 GiB of weights.
#
# ## 8. Shutting the workers down
#
# Worker processes hold their weights and KV slabs (on GPUs, in each one's device memory) until
# they exit. `llm.shutdown()`
# stops them: each leaves the process group and exits, and the engine refuses more work with a
# `WorkerError` (garbage collection and interpreter exit do the same, but later). A `tp1` has no
# workers to stop.

# %%
tp2.shutdown()
print("workers alive after shutdown:", [proc.is_alive() for proc in runner.procs])
try:
    tp2.generate(["one more"], SamplingParams(max_tokens=2), use_tqdm=False)
except WorkerError as e:
    print(f"{type(e).__name__}: {e}")

# %% [markdown]
# ## Check yourself
#
# Answer each question before you run the cell below: write your answers into `my_answers`
# (`None` skips one). The cell checks them against the runs above, and checks the rule behind
# each answer too.
#
# 1. tiny-gpt2 stores, per token, K and V for 2 layers x 4 heads x 16 values of 4 bytes. How
#    many bytes of each token's KV does one of two workers hold?
# 2. How many all-reduces does each worker take part in during one step of tiny-gpt2 -- and does
#    the number change between a prefill of 128 tokens and a decode of 4?
# 3. OPT-13B's fp16 weights are 23.94 GiB and its KV is 800 KiB per token. With nothing kept
#    aside, how many token slots do two 40 GiB GPUs hold (round down)?

# %%
my_answers = [None, None, None]  # your answers to questions 1-3, then run the cell

spec = cache.spec
plan = tensor_parallel_plan(models["tiny-gpt2"])
rules = [  # what the rules predict
    2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * spec.element_size // 2,
    2 * layers,  # one after attention's output projection, one after the MLP's second matrix
    (2 * 40 * GiB - 23.94 * GiB) // (800 * 1024),  # 23.94: the weights rounded to 0.01 GiB
]
seen_values = [
    cache.worker_spec.bytes_per_token,  # what the sharded cache holds per token, per worker
    sum(style == "rowwise" for style in plan.values()) * layers,  # each row-wise layer: 1
    tensor_parallel_memory(opt_config("OPT-13B"), num_gpus=2, gpu_bytes=40 * GiB).slots,
]


def agrees(a, b):  # exact, or within 0.01% for question 3's rounded weights
    return a is not None and abs(a - b) <= 1e-4 * abs(b)


for q, (rule, got, mine) in enumerate(zip(rules, seen_values, my_answers, strict=True), start=1):
    assert agrees(rule, got), f"question {q}: the run gave {got}, the rule {rule}"
    verdict = "" if mine is None else ("  right" if agrees(mine, got) else f"  (you said {mine})")
    print(f"question {q}: {got:,}{verdict}")

# %% [markdown]
# ## Exercises
#
# 1. **Four workers, OPT.** Build `LLM("tiny-opt", tensor_parallel_size=4, ...)` (its 4 heads
#    split one per worker) and rerun section 4's mix. How many bands does the slab picture have,
#    how many head rows each, and what does `collective_rpc("describe")` say each worker's
#    weights are? Then try `tensor_parallel_size=8`: what stops it, and when?
# 2. **A bigger model.** Repeat section 6 with `"gpt2-size-random"` (GPT-2 small's shapes, 12
#    layers, hidden 768, random weights) and a larger pool. Which of the terms in the step
#    formula grew, which did not, and did the ratio N=2 / N=1 move toward or away from 1?
# 3. **Swap under tensor parallelism.** Build both engines with `preemption_mode="swap"`,
#    `swap_blocks=64` and `num_blocks=24`, and run section 4's mix to the end with
#    `max_tokens=24`. Wrap `tp2.engine.kv_cache.swap_out` as section 5 wrapped `execute`: which
#    `(block, CPU block)` pairs does the driver send, in which step, and to how many workers?
#    Check that the slabs still match `tp1`'s.
# 4. **Table 1 on H100s.** With `tensor_parallel_memory(opt_config("OPT-66B"), N, 80 * GiB,
#    reserve_bytes=8 * GiB)` for N = 2, 4, 8: how many slots does each give, and which N would
#    you pick to serve OPT-66B to many users at once?
