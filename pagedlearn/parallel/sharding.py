"""Splitting a model's layers across workers: Megatron-LM's tensor parallelism, PyTorch's API.

A transformer layer is two matrix multiplications in a row, twice (attention, then the MLP). The
paper (section 4.6) runs a model that does not fit one GPU as Megatron-LM does (Shoeybi et al.,
2019): the first matrix of each pair is split by its *output columns*, the second by its *input
rows*::

    x (T, hidden) ──> q/k/v or fc1: column-parallel ──> worker r holds heads r*H/N .. (r+1)*H/N - 1
        (every worker has all of x)      W[:, cols of r]     (T, hidden/N): its heads only
                                                              │  attention: per head, so local
                                                              v
    out (T, hidden) <── all-reduce (sum) <── out_proj or fc2: row-parallel, W[rows of r, :]
                                              each worker's partial sum (T, hidden)

Attention is computed per head, so a worker that holds heads ``r*H/N ..`` needs only *their*
keys and values: its KV cache holds ``num_kv_heads / N`` heads, at the same block ids as every
other worker's. Two all-reduces per layer (one after attention, one after the MLP) are the only
talk between workers; embeddings, layer norms and the LM head are replicated. vLLM splits the
vocabulary too; pagedlearn keeps it whole: 0.4-2% of the weights of OPT-13B to OPT-175B, but a
third of GPT-2 small's and of the tiny models'.

With grouped-query attention (Llama, Mistral, Qwen2: several query heads share one KV head)
worker ``r`` holds KV heads ``r*K/N ..`` and exactly the query heads that read them, because
transformers orders the query heads group by group; so N must divide the KV heads ``K`` (and then
the query heads too). SmolLM2-135M has 9 query heads over 3 KV heads: N = 3 works, N = 2 does not.

How: transformers' own tensor-parallel styles, the ones ``from_pretrained(..., tp_plan="auto")``
applies to Llama and friends. :func:`tensor_parallel_plan` names, per model type, which modules
are ``"colwise"`` and which ``"rowwise"`` (pattern -> style, as in a config's
``base_model_tp_plan``, but named from the top module; vLLM calls them
``ColumnParallelLinear`` / ``RowParallelLinear``). For Llama, Mistral and Qwen2 it is
transformers' own plan, read from the config (q, k, v, gate and up colwise; o and down rowwise);
transformers ships no plan for GPT-2 or OPT, so theirs live here. (Gemma 2, OLMo and Granite
ship the same plan as Llama but are not tested here; Gemma 3 and Qwen3 add a style for their
per-head q and k norms, Phi-3 fuses q, k and v.) :func:`shard_model` keeps each rank's slice of
those weights (as DTensors over a ``torch.distributed`` ``DeviceMesh``) and replaces each
module's ``forward`` with transformers' (``install_forward``), which, without gradients,
multiply by the local slice and ``all_reduce`` the row-parallel output (adding its bias once,
after the sum). PyTorch's ``parallelize_module`` does the same with its own
``ColwiseParallel`` / ``RowwiseParallel``, but runs every sharded matmul through DTensor
dispatch: measured on two CPU cores, a forward of the 12-layer gpt2-size-random took 734 ms
that way against 85 ms this way (tiny-gpt2: 92 ms against 6 ms), so it is not used. Two things
neither API does are done first (for GPT-2):

- GPT-2's projections are ``Conv1D`` modules (an ``nn.Linear`` with the weight transposed),
  which neither shards: they become ``nn.Linear``.
- GPT-2 computes q, k and v with one fused matrix whose output is ``[q | k | v]``. Cutting it into
  N contiguous pieces would give worker 0 all of q and half of k; its output columns are
  reordered to ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` first, so each piece is one worker's heads.

Last, each attention module is told how many heads it now has (OPT reshapes with
``self.num_heads``; GPT-2 splits its fused output with ``self.split_size``). Llama's needs
nothing: it reshapes its projections' outputs to ``(T, -1, head_dim)``, as many heads as its
slice holds, and its ratio of query to KV heads is the same on every worker as in the model.
"""

from __future__ import annotations

import math

import torch

from pagedlearn.errors import PagedLearnError

# Llama's architecture: transformers' plan for each (the config's base_model_tp_plan) is the same.
LLAMA_LIKE = ("llama", "mistral", "qwen2")
SUPPORTED_MODEL_TYPES = ("gpt2", "opt", *LLAMA_LIKE)


def _layers(model):
    """The model's decoder layers and their plan-key prefix."""
    kind = model.config.model_type
    if kind == "gpt2":
        return model.transformer.h, "transformer.h.*."
    if kind == "opt":
        return model.model.decoder.layers, "model.decoder.layers.*."
    if kind in LLAMA_LIKE:  # LlamaForCausalLM.model: the LlamaModel the plan is written for
        base = model.base_model_prefix
        return getattr(model, base).layers, f"{base}.layers.*."
    raise PagedLearnError(
        f"tensor parallelism supports the model types {SUPPORTED_MODEL_TYPES}; "
        f"{model.config.model_type!r} has no sharding plan here (pagedlearn/parallel/sharding.py)"
    )


def split_sizes(model) -> dict[str, int]:
    """What must divide by the number of workers: attention (query) heads, KV heads, MLP width.

    >>> from pagedlearn.models import load
    >>> split_sizes(load("tiny-mistral").model)  # grouped-query: 2 query heads per KV head
    {'attention heads': 4, 'KV heads': 2, 'MLP width': 128}
    """
    c = model.config
    _layers(model)  # refuses a model type with no plan
    if c.model_type == "gpt2":
        heads, inner = c.n_head, c.n_inner or 4 * c.n_embd
        return {"attention heads": heads, "KV heads": heads, "MLP width": inner}
    heads = c.num_attention_heads
    if c.model_type == "opt":
        return {"attention heads": heads, "KV heads": heads, "MLP width": c.ffn_dim}
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return {"attention heads": heads, "KV heads": kv_heads, "MLP width": c.intermediate_size}


def check_tensor_parallel(model, size: int) -> None:
    """Refuse (:class:`PagedLearnError`) a worker count that does not split ``model`` evenly.
    The engine calls it before it sizes the KV cache or starts any worker."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise PagedLearnError(f"tensor_parallel_size must be a positive int, got {size!r}")
    sizes = split_sizes(model)
    # The smallest count first: with grouped-query attention, the KV heads (which N must divide
    # for the query heads to divide too); with one KV head per query head, the heads.
    for what in sorted(sizes, key=sizes.get):
        n = sizes[what]
        if n % size:
            common = math.gcd(*sizes.values())  # what divides all of them divides this
            fits = [d for d in range(1, common + 1) if common % d == 0][:8]
            heads, kv_heads = sizes["attention heads"], sizes["KV heads"]
            shared = (
                f"; its {heads} query heads share them, {heads // kv_heads} per KV head"
                if what == "KV heads" and heads != kv_heads
                else ""
            )
            raise PagedLearnError(
                f"tensor_parallel_size={size} must divide the model's {what} ({n}{shared}): "
                f"each worker holds an equal share; try one of {fits}"
            )


def tensor_parallel_plan(model) -> dict[str, str]:
    """Module name pattern (``*``: every layer) -> ``"colwise"`` or ``"rowwise"``, the format of
    transformers' ``base_model_tp_plan``. GPT-2's modules must be :func:`prepare` d first.
    Llama-like models: transformers' own plan, named from the top module."""
    _, p = _layers(model)
    if model.config.model_type in LLAMA_LIKE:
        base, plan = model.base_model_prefix, dict(model.config.base_model_tp_plan or {})
        if not plan or set(plan.values()) - {"colwise", "rowwise"}:  # another transformers?
            raise PagedLearnError(
                f"transformers' tensor-parallel plan for {model.config.model_type!r} is {plan}; "
                "pagedlearn applies plans of 'colwise' and 'rowwise' modules only"
            )
        return {f"{base}.{name}": style for name, style in plan.items()}
    if model.config.model_type == "gpt2":
        names = {"attn.c_attn": "col", "attn.c_proj": "row", "mlp.c_fc": "col", "mlp.c_proj": "row"}
    else:
        names = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
                 "self_attn.out_proj": "row", "fc1": "col", "fc2": "row"}  # fmt: skip
    return {p + n: f"{kind}wise" for n, kind in names.items()}


def _linear(conv, rows: torch.Tensor | None = None) -> torch.nn.Linear:
    """A transformers ``Conv1D`` (weight ``(in, out)``) as an ``nn.Linear`` (weight ``(out, in)``),
    its output features reordered by ``rows`` if given."""
    weight, bias = conv.weight.detach().t(), conv.bias.detach()  # (out, in), (out,)
    if rows is not None:
        weight, bias = weight[rows], bias[rows]
    out = torch.nn.Linear(*weight.shape[::-1], device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        out.bias.copy_(bias)
    return out.requires_grad_(False)


def prepare(model, size: int) -> None:
    """Make ``model``'s layers shardable by the plan's styles for ``size`` workers, in place
    (GPT-2: ``Conv1D`` -> ``nn.Linear``, fused q/k/v reordered per worker; the others: nothing)."""
    layers, _ = _layers(model)
    if model.config.model_type != "gpt2":
        return
    hidden = model.config.n_embd
    per = hidden // size  # one worker's share of q (and of k, and of v)
    # Output rows of c_attn are [q | k | v], each `hidden` wide; worker r's piece must be
    # [q_r | k_r | v_r], so list, for r = 0..size-1 and part = q, k, v, its rows in order.
    rows = torch.cat(
        [
            torch.arange(part * hidden + r * per, part * hidden + (r + 1) * per)
            for r in range(size)
            for part in range(3)
        ]
    )
    for block in layers:
        block.attn.c_attn = _linear(block.attn.c_attn, rows)
        block.attn.c_proj = _linear(block.attn.c_proj)
        block.mlp.c_fc = _linear(block.mlp.c_fc)
        block.mlp.c_proj = _linear(block.mlp.c_proj)


def _styles():
    try:
        from transformers.distributed.tensor_parallel import (
            ALL_PARALLEL_STYLES,
            apply_tensor_parallelism,
        )
    except ImportError as e:  # older transformers: the module had another name and API
        import transformers

        raise PagedLearnError(
            "tensor parallelism uses transformers' tensor-parallel styles "
            f"(transformers.distributed.tensor_parallel), which transformers "
            f"{transformers.__version__} does not have: upgrade it (tested: 5.24)"
        ) from e
    return ALL_PARALLEL_STYLES, apply_tensor_parallelism


def shard_model(model, mesh) -> None:
    """Keep this worker's share of every layer of ``model``, in place: :func:`prepare`, keep
    this rank's slice of every planned weight, install transformers' hooks (the all-reduce),
    then tell each attention module its local head count. ``mesh``: a 1-D ``DeviceMesh`` of the
    workers; every rank must hold the same full weights when it starts (each cuts its own
    slice, with no communication: ``src_data_rank=None`` inside transformers' ``shard_param``)."""
    styles, apply = _styles()
    size = mesh.size()
    check_tensor_parallel(model, size)
    prepare(model, size)
    layers, _ = _layers(model)
    plan = {  # the plan's "*" spelled out: transformers' apply wants every module's own name
        name.replace("*", str(i)): style
        for name, style in tensor_parallel_plan(model).items()
        for i in range(len(layers))
    }
    modules = dict(model.named_modules())
    for name, style in plan.items():
        for param in ("weight", "bias"):
            styles[style].shard_param(modules[name], param, mesh)  # Shard(0) / Shard(-1) + bias
    apply(model, mesh, plan)
    if model.config.model_type in LLAMA_LIKE:
        return  # Llama's attention reshapes to (T, -1, head_dim): as many heads as it holds
    for block in layers:
        attn = block.attn if model.config.model_type == "gpt2" else block.self_attn
        attn.num_heads //= size  # OPT reshapes q, k, v with it
        if model.config.model_type == "gpt2":
            attn.split_size //= size  # GPT-2 splits its [q_r | k_r | v_r] output with it
