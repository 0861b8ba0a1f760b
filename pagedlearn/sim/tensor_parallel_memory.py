"""Tensor parallelism's memory arithmetic: what sharding a model over N GPUs does to its token
slots, recomputed on the meta device for the paper's Table 1 (Kwon et al., SOSP 2023, sections
4.6 and 6.1: OPT-13B on one A100, OPT-66B on four, OPT-175B on eight A100-80GB).

**What is sharded** (Megatron-LM style, section 4.6). Each of the N workers holds 1/N of every
weight matrix: the attention heads are split between workers, and so are the MLP's columns. A
worker computes the K/V of *its* heads only, so it caches ``num_kv_heads / N`` heads of every
token in every layer: the same tokens as every other worker, a 1/N slice of each. With W the
weight bytes, B the KV bytes per token (``KVCacheSpec.bytes_per_token``) and M a GPU's memory::

    per worker: slots = (M - W/N) / (B/N)       # memory left on one GPU / its slice of a token
    in total:   slots = (N*M - W)  / B          # multiply top and bottom by N: the N cancels

So a token slot means the same on every worker (the block manager keeps one block table for all
of them), and what sets the number of slots is the memory left over in total, N*M - W: N GPUs
do not multiply the slots by N, they add N*M bytes and pay for the weights once (OPT-13B on 1,
2, 4 A100-40GB: 21.0K, 73.5K, 178.3K slots; :func:`format_scaling`). What N does not cancel
from is whether the model fits at all: W/N must stay below M, and N must divide the heads.
OPT-66B's 122 GiB of weights need 4 A100-40GB (on 3, each would hold 40.8 GiB); OPT-175B's
325 GiB need 12 of them (9 would hold it, but do not divide its 96 heads; on 8, each would
hold 40.65 GiB) or 6 A100-80GB: one reason Table 1 uses 80 GB GPUs for it (fewest_gpus).

W/N is the ideal split of *every* weight. Megatron-LM and vLLM come close: they split the token
embedding and the LM head by vocabulary rows (vLLM keeps OPT's position embedding, 0.01% of
175B, whole). pagedlearn's own tensor-parallel engine (``pagedlearn/parallel``) keeps the token
embedding (tied to the LM head in OPT), the position embedding and the final norm whole on every
worker: each worker then holds (1 - 1/N) of those bytes more (``replicated_extra_bytes``: 0.67
GiB for OPT-66B on 4, 1.05 GiB for OPT-175B on 8). That costs 12.5% of OPT-66B's slots (9,824
-> 8,598 at 90% utilization) and 3% of OPT-175B's (57,064 -> 55,157), and the N no longer
cancels exactly. (Each layer's norms and row-parallel biases are whole on every worker too, in
Megatron-LM as here: 6 x d_model per layer, 12 MiB per worker on OPT-175B x 8; left out.)

**Units.** KiB, MiB, GiB are powers of 2; kB, GB powers of 10 (chapter 01). Table 1 mixes them:

- "Total GPU memory" (40, 160, 640 GB) and "Memory for KV cache" (12, 21, 264 GB) are GiB: the
  slot counts come out of the KV column only in GiB (12 GiB / 800 KiB = 15,728 -> 15.7K; with
  12 GB, 14,648). 264 GiB / 4.5 MiB = 60,074 -> 60.1K (264 GB: 55,949). 21 GiB / 2.25 MiB =
  9,557 -> 9.6K, not the paper's 9.7K, which takes 21.3 GiB: that column is rounded.
- "Parameter size" (26, 132, 346 GB) is decimal GB of fp16 weights: our counts give 25.7, 131.4
  and 349.2 GB (in GiB 23.9, 122.4, 325.2, 6-9% off). 175B's 346 is 0.9% below ours; we could
  not tell why.
- So Table 1's own subtraction mixes units, and memory minus weights is *not* its KV column:
  40 GiB - 25.7 GB = 16.06 GiB, not 12. The rest is kept aside: vLLM profiles a forward pass
  and fills only ``gpu_memory_utilization`` of each GPU. Solving for the reserve from the
  paper's slots gives 4.07-4.08 GiB per A100-40GB for 13B and 66B (the GPU used to 0.898; the
  vLLM releases we found default to 0.90, v0.33 to 0.92) but 6.33 GiB per A100-80GB for 175B
  (0.921). :func:`table1` prints this implied reserve, and the slots at a named utilization
  (0.90 by default): 13B +0.7%, 66B +1.3%, 175B -5.1% against the paper.

Checked against the paper's text: Table 1's five rows, in two independent transcriptions (a
Korean and a Chinese review of arXiv 2309.06180; the English extraction we found has section
6.1's text, "A2 instances with NVIDIA A100 GPUs", but the table only as an image). Not checked:
how the paper measured its KV memory. OPT shapes: the OPT paper's Table 1 (Zhang et al. 2022,
arXiv 2205.01068) as metaseq's ``metaseq/launcher/opt_job_constants.py`` writes it (layers,
d_model, heads of 128, ffn 4 x d_model); vocab 50272 and 2048 positions are ``OPTConfig``'s
defaults (the released checkpoints' values; we did not re-read their config.json here).

>>> row = tensor_parallel_memory(opt_config("OPT-13B"), num_gpus=2, gpu_bytes=40 * GiB)
>>> row.kv_bytes_per_token, row.kv_bytes_per_token_per_worker  # 40 heads -> 20 per worker
(819200, 409600)
>>> row.slots == (2 * 40 * GiB - row.weight_bytes) // row.kv_bytes_per_token  # the N cancels
True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlearn.errors import PagedLearnError
from pagedlearn.models.reference_configs import meta_model
from pagedlearn.models.runner import kv_cache_spec

GiB, GB, KiB = 2**30, 10**9, 2**10

# (layers, attention heads, d_model) from the OPT paper's Table 1; head size 128 in all three.
OPT_SIZES = {"OPT-13B": (40, 40, 5120), "OPT-66B": (64, 72, 9216), "OPT-175B": (96, 96, 12288)}


@dataclass(frozen=True)
class PaperSetting:
    """One column of the paper's Table 1, as printed (its "GB"; see the module docstring)."""

    model: str
    gpus: str
    num_gpus: int
    gpu_gib: int  # one GPU's memory
    total_gb: int  # "Total GPU memory"
    param_gb: int  # "Parameter size"
    kv_gb: int  # "Memory for KV cache"
    slots: int  # "Max. # KV cache slots", 15.7K written 15_700


PAPER_TABLE1 = (
    PaperSetting("OPT-13B", "A100", 1, 40, 40, 26, 12, 15_700),
    PaperSetting("OPT-66B", "4xA100", 4, 40, 160, 132, 21, 9_700),
    PaperSetting("OPT-175B", "8xA100-80GB", 8, 80, 640, 346, 264, 60_100),
)


def opt_config(name: str):
    """transformers' ``OPTConfig`` of OPT-13B, -66B or -175B (fp16, as the paper serves them)."""
    from transformers import OPTConfig

    if name not in OPT_SIZES:
        raise PagedLearnError(f"unknown OPT size {name!r}; known: {', '.join(OPT_SIZES)}")
    layers, heads, d_model = OPT_SIZES[name]
    config = OPTConfig(  # vocab 50272, 2048 positions, word_embed_proj_dim = d_model: the defaults
        hidden_size=d_model,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        ffn_dim=4 * d_model,
    )
    config.name_or_path = name
    return config


@dataclass(frozen=True)
class TensorParallelMemory:
    """One model on N GPUs of ``gpu_bytes`` each; ``*_per_worker`` is what one GPU holds."""

    model: str
    num_gpus: int
    gpu_bytes: int
    reserve_bytes: int  # per GPU, kept aside (activations, the runtime): not for weights or KV
    params: int
    weight_bytes: int  # all of them, in ``dtype``
    replicated_extra_bytes: int  # per worker, if embeddings / LM head are kept whole (pagedlearn)
    kv_bytes_per_token: int
    kv_bytes_per_token_per_worker: int

    @property
    def weight_bytes_per_worker(self) -> int:
        return -(-self.weight_bytes // self.num_gpus)  # Megatron split; the biggest shard

    @property
    def kv_bytes_per_worker(self) -> int:
        return self.gpu_bytes - self.reserve_bytes - self.weight_bytes_per_worker

    @property
    def slots(self) -> int:
        return self.kv_bytes_per_worker // self.kv_bytes_per_token_per_worker

    @property
    def slots_replicated(self) -> int:
        """Slots when embeddings and LM head are whole on every worker (pagedlearn/parallel)."""
        left = self.kv_bytes_per_worker - self.replicated_extra_bytes
        return left // self.kv_bytes_per_token_per_worker

    def formula(self) -> str:
        reserve = f" - {self.reserve_bytes / GiB:.2f}" if self.reserve_bytes else ""
        return (
            f"({self.gpu_bytes / GiB:.0f}{reserve} - {self.weight_bytes_per_worker / GiB:.2f}"
            f" GiB) / {self.kv_bytes_per_token_per_worker / KiB:g} KiB = {self.slots:,} slots"
        )


_SHAPES: dict[str, tuple] = {}  # config JSON -> (params, replicated params, KV spec)


def _shapes(config, dtype: torch.dtype):
    key = f"{dtype}:{config.to_json_string()}"
    if key not in _SHAPES:
        model = meta_model(config, dtype=dtype)  # shapes only: 350 GB of OPT-175B never allocated
        params = sum(p.numel() for p in model.parameters())  # the tied LM head counted once
        # Outside the decoder layers: embeddings (= LM head), positions, final norm.
        whole = sum(p.numel() for n, p in model.named_parameters() if ".layers." not in n)
        _SHAPES[key] = (params, whole, kv_cache_spec(model))
    return _SHAPES[key]


def tensor_parallel_memory(
    config, num_gpus: int, gpu_bytes: int, dtype=torch.float16, reserve_bytes: int = 0
) -> TensorParallelMemory:
    """Weights, KV bytes per token and token slots per worker of ``config`` on ``num_gpus`` GPUs
    of ``gpu_bytes`` each, ``reserve_bytes`` of each kept aside. Raises :class:`PagedLearnError`
    if N does not split the heads or the weights leave no room for a single token."""
    name = getattr(config, "name_or_path", "") or config.model_type
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise PagedLearnError(f"num_gpus must be an integer >= 1, got {num_gpus!r}")
    if gpu_bytes <= 0 or not 0 <= reserve_bytes < gpu_bytes:
        raise PagedLearnError(
            f"need 0 <= reserve_bytes < gpu_bytes, got {reserve_bytes:,} and {gpu_bytes:,}"
        )
    params, whole, spec = _shapes(config, dtype)
    heads = config.num_attention_heads
    if heads % num_gpus or spec.num_kv_heads % num_gpus:
        raise PagedLearnError(
            f"{name}: {num_gpus} GPUs do not divide its {heads} attention heads "
            f"({spec.num_kv_heads} KV heads); tensor parallelism gives each GPU whole heads"
        )
    element = spec.element_size
    shard = spec.split_heads(num_gpus)
    row = TensorParallelMemory(
        name, num_gpus, gpu_bytes, reserve_bytes, params, params * element,
        whole * element * (num_gpus - 1) // num_gpus,
        spec.bytes_per_token, shard.bytes_per_token,
    )  # fmt: skip
    if row.slots < 1:
        raise PagedLearnError(
            f"{name}: {row.weight_bytes_per_worker / GiB:.1f} GiB of weights per GPU on "
            f"{num_gpus} GPU(s) leave no room for KV in {(gpu_bytes - reserve_bytes) / GiB:.1f} "
            f"GiB; use more GPUs (fewest_gpus) or bigger ones"
        )
    return row


def fewest_gpus(config, gpu_bytes: int, reserve_bytes: int = 0, dtype=torch.float16) -> int:
    """The smallest N that divides the heads and leaves room for at least one token per GPU."""
    for n in range(1, config.num_attention_heads + 1):
        if config.num_attention_heads % n == 0:
            try:
                return tensor_parallel_memory(config, n, gpu_bytes, dtype, reserve_bytes).num_gpus
            except PagedLearnError:
                continue
    raise PagedLearnError(f"{config.name_or_path}: does not fit even with one head per GPU")


def table1(gpu_memory_utilization: float = 0.90) -> list[dict]:
    """The paper's Table 1 beside ours: slots with no reserve, the reserve per GPU that the
    paper's slots imply, and slots when only ``gpu_memory_utilization`` of each GPU is used."""
    if not 0 < gpu_memory_utilization <= 1:
        raise PagedLearnError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
        )
    rows = []
    for p in PAPER_TABLE1:
        gpu = p.gpu_gib * GiB
        config = opt_config(p.model)
        bare = tensor_parallel_memory(config, p.num_gpus, gpu)
        reserve = round((1 - gpu_memory_utilization) * gpu)
        used = tensor_parallel_memory(config, p.num_gpus, gpu, reserve_bytes=reserve)
        paper_kv = p.slots * bare.kv_bytes_per_token  # in total, before rounding to 0.1K
        implied = (p.num_gpus * gpu - bare.weight_bytes - paper_kv) / p.num_gpus
        rows.append({
            "model": p.model, "gpus": p.gpus, "num_gpus": p.num_gpus, "params": bare.params,
            "weights_gb": bare.weight_bytes / GB, "paper_param_gb": p.param_gb,
            "weights_per_worker_gib": bare.weight_bytes_per_worker / GiB,
            "replicated_extra_gib": bare.replicated_extra_bytes / GiB,
            "kv_per_token_per_worker": bare.kv_bytes_per_token_per_worker,
            "slots_no_reserve": bare.slots, "paper_slots": p.slots,
            "paper_kv_gib": paper_kv / GiB, "paper_kv_column": p.kv_gb,
            "implied_reserve_per_gpu_gib": implied / GiB,
            "implied_utilization": 1 - implied / gpu,
            "utilization": gpu_memory_utilization, "slots": used.slots,
            "slots_vs_paper": used.slots / p.slots - 1, "formula": used.formula(),
            "slots_replicated": used.slots_replicated,
        })  # fmt: skip
    return rows


def format_table1(rows: list[dict]) -> str:
    """One line per setting: ours beside the paper's, and the formula at the named utilization."""
    lines = [
        "columns: model, GPUs, parameters, fp16 weights (the paper's parameter size) | slots with "
        "no reserve, the paper's slots (the KV GiB they take; its KV column), the reserve per GPU "
        "they imply (the fraction of the GPU used) | at utilization U: the per-worker formula "
        "(vs the paper) | the same with embeddings whole on every worker (pagedlearn/parallel)"
    ]
    for r in rows:
        lines.append(
            f"{r['model']:8s} {r['gpus']:11s} {r['params'] / 1e9:6.2f}B {r['weights_gb']:5.1f} GB "
            f"({r['paper_param_gb']:3d}) | {r['slots_no_reserve'] / 1e3:5.1f}K "
            f"{r['paper_slots'] / 1e3:5.1f}K ({r['paper_kv_gib']:5.1f}; column "
            f"{r['paper_kv_column']:3d}) {r['implied_reserve_per_gpu_gib']:.2f} GiB "
            f"(util {r['implied_utilization']:.3f}) | {r['utilization']:.2f}: {r['formula']} "
            f"({r['slots_vs_paper']:+.1%}) | {r['slots_replicated']:,}"
        )
    return "\n".join(lines)


def format_scaling(model: str = "OPT-13B", gpu_gib: int = 40, gpus=(1, 2, 4)) -> str:
    """What N does to one model: per-worker KV shrinks, the weights are paid once."""
    config, lines = opt_config(model), []
    for n in gpus:
        r = tensor_parallel_memory(config, n, gpu_gib * GiB)
        total = (n * gpu_gib * GiB - r.weight_bytes) // r.kv_bytes_per_token  # the N cancels
        lines.append(
            f"{model} on {n} x {gpu_gib} GiB: per worker {r.formula()}; "
            f"in total ({n} x {gpu_gib} - {r.weight_bytes / GiB:.2f} GiB) / "
            f"{r.kv_bytes_per_token / KiB:g} KiB = {total:,}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_table1(table1()))
    print(format_scaling())
