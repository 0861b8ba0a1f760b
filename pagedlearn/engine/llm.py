"""``LLM``: vLLM's front door, small. Load a model, size the paged KV cache, generate.

::

    from pagedlearn import LLM, SamplingParams
    llm = LLM("gpt2", num_blocks=256)            # or "facebook/opt-125m", "tiny-gpt2", a path, ...
    outs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=20))
    print(outs[0].outputs[0].text)

Everything runs through :class:`~pagedlearn.engine.llm_engine.LLMEngine` (``llm.engine``), whose
step-level API the notebooks use to watch the blocks move. The constructor's checks and the
building of the engine are in :mod:`pagedlearn.engine.engine_args` (vLLM's ``EngineArgs``).

How big is the cache? Either ``num_blocks`` blocks of ``block_size`` tokens, or as many as fit in
``kv_cache_memory`` bytes (the paper's view: memory is the budget, blocks are the unit). Neither
given: on a GPU, 40% of its free memory; on a CPU, 256 MiB -- in both cases no more than
``max_num_seqs`` full-length sequences need. The constructor prints the bytes per token and the
resulting capacity.

Prompts come as vLLM takes them -- text, token ids, or dicts ``{"prompt": text}`` /
``{"prompt_token_ids": ids}`` with an optional ``"cache_salt"`` --, and so does the LoRA adapter
(``lora_request``, one for all prompts or a list, one per prompt). Salt, adapter and
``model_version`` go into every block hash: a prompt hits a cached block only when all three
match (pagedlearn applies no adapter; it only keeps their KV apart)::

    outs = llm.generate([{"prompt": "Hi", "cache_salt": "alice"},   # these two share no
                         {"prompt": "Hi", "cache_salt": "bob"}])    # cached block
    llm.engine.model_version = "step-100"   # new weights: nothing cached before is hit
    llm.reset_prefix_cache()                # or drop every cached block now

``kv_reservation="max"`` turns the same engine into the baseline the paper compares against: each
request reserves the blocks of ``prompt + max_tokens`` (per sequence) when it is admitted, as
Orca (Max) does, instead of taking blocks as its tokens arrive (see
:mod:`pagedlearn.engine.scheduler`). ``benchmarks/bench_memory_bound.py`` runs both on one budget.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from pagedlearn.engine.engine_args import EngineArgs
from pagedlearn.engine.llm_engine import RequestRejectedError
from pagedlearn.engine.outputs import request_output
from pagedlearn.engine.request import RequestOutput, RequestStatus
from pagedlearn.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedlearn.errors import PagedLearnError


class LLM:
    """Serve a Hugging Face causal LM (SmolLM2, GPT-2, OPT, ...) from a paged KV cache.

    ``model``: anything :func:`pagedlearn.models.load` takes ("smollm2" -- a real instruct
    model, offline --, "gpt2", "facebook/opt-125m", "tiny-gpt2", "tiny-opt", "tiny-mistral",
    "tiny-gemma3", "auto", a local path, a ``PreTrainedModel``), or what it returned.
    ``attention_backend``: "torch" (PyTorch's SDPA over the paged cache, planned once per step:
    :mod:`pagedlearn.attention.sdpa`, checked against the references in
    :mod:`pagedlearn.attention`), "triton" (the kernels; on a CPU only with ``TRITON_INTERPRET=1``
    set before triton is imported), "reference" (the references themselves, slower: the one
    to step through in a debugger), or "auto" (Triton on a GPU, "torch" on a CPU).
    ``swap_blocks``: size of the CPU swap pool in blocks (default: as many as the device pool
    when ``preemption_mode="swap"``, else none). ``max_num_batched_tokens``: the tokens one step
    may compute; with ``enable_chunked_prefill`` a longer prompt is prefilled over several steps
    (see :mod:`pagedlearn.engine.scheduler`).

    ``kv_reservation``: "paged" (vLLM: a block is taken when a token needs it) or "max" (Orca
    (Max)-style baseline: a request is admitted only when the pool can set aside, for each of its
    ``n`` sequences or beams, the blocks of ``prompt + max_tokens`` tokens, capped at the
    model's length; they stay reserved until it finishes, so it never needs preemption). "max"
    reserves *blocks*, not one contiguous run, so it has no external fragmentation: an optimistic
    upper bound for a reservation system. A request whose reservation exceeds the whole pool is
    rejected, like a prompt larger than the pool (``generate`` returns it with ``error`` set).

    ``tensor_parallel_size``: N > 1 starts N worker processes (vLLM's name; paper section
    4.6): each holds 1/N of every layer's heads and MLP columns and 1/N of every block's KV
    heads, while this process keeps the one scheduler and block manager
    (:mod:`pagedlearn.parallel`). GPT-2, OPT, Llama, Mistral, Qwen2; N must divide the KV
    heads (SmolLM2: 3). On CPUs the workers use gloo; with ``device="cuda"`` worker ``r`` runs
    on ``cuda:r`` (N GPUs needed).
    ``kv_cache_memory`` and the default budget are then per worker: each worker's slab holds
    1/N of every block, so the same budget holds N times the blocks. ``shutdown()`` stops the
    workers (garbage collection and interpreter exit do too); ``collective_rpc`` runs a
    function on each. In a script, build the ``LLM`` under ``if __name__ == "__main__":``:
    the workers import the main module.

    ``model_version``: the weights' version, part of every block hash (``llm.engine.model_version``
    changes it later; see :attr:`LLMEngine.model_version`).

    ``kv_cache_manager``: the class that does the block bookkeeping (default
    :class:`~pagedlearn.KVCacheManager`); the labs pass one built from a student's own allocator,
    copy-on-write and prefix cache (:func:`pagedlearn.labs.plug.your_kv_cache_manager`), so the
    model runs -- and the live view draws -- *their* blocks.

    The model's attention implementation is switched to ``"pagedlearn"`` (see
    :mod:`pagedlearn.models.paged_attention`); switch it back with
    ``model.set_attn_implementation("sdpa")`` to use it without the engine.
    """

    def __init__(
        self,
        model="auto",
        *,
        tokenizer=None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        swap_blocks: int | None = None,
        attention_backend: str = "auto",
        device: str = "auto",
        dtype=None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        kv_reservation: str = "paged",
        kv_cache_manager=None,
        verbose: bool = True,
        model_version=None,
        tensor_parallel_size: int = 1,
    ) -> None:
        args = EngineArgs(
            model=model,
            tokenizer=tokenizer,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching,
            preemption_mode=preemption_mode,
            swap_blocks=swap_blocks,
            attention_backend=attention_backend,
            device=device,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            kv_reservation=kv_reservation,
            kv_cache_manager=kv_cache_manager,
            verbose=verbose,
            model_version=model_version,
            tensor_parallel_size=tensor_parallel_size,
        )  # checks every argument that needs no model: a bad one fails before anything loads
        self.engine, loaded, self.device, self.attention_backend = args.create_engine()
        self.model_name, self.offline_stand_in = loaded.name, loaded.offline_stand_in
        self.tensor_parallel_size = tensor_parallel_size
        self._num_generated = 0  # request ids of generate(): "gen-0", "gen-1", ...

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    # --- generation -----------------------------------------------------------------------------
    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, a dict ``{"prompt": text}``
        or ``{"prompt_token_ids": ids}`` with an optional ``"cache_salt"``, or a list of these),
        all batched together; returns one :class:`RequestOutput` per prompt, in order.
        ``lora_request``: the LoRA adapter of every prompt, or a list with one per prompt (see
        ``LLMEngine.add_request``: pagedlearn only keeps each adapter's cached KV apart).

        A prompt that can never be served (too long for the model or the pool) does not stop the
        others: its output has ``error`` set, no tokens, and finish reason "error".

        Interrupted (Ctrl-C, "interrupt kernel", or an error raised by a step), it aborts the
        requests it added -- their blocks go back to the pool, their outputs are dropped -- and
        re-raises: the engine stays usable, and the next ``generate`` starts clean. Requests
        added to ``llm.engine`` by other code stay queued. One of its requests that other code
        aborts (``llm.engine.abort_request``, from a stats subscriber or another thread) still
        gets its output, with what it had generated and finish reason "abort"."""
        from tqdm.auto import tqdm

        prompts = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        if isinstance(params, (SamplingParams, BeamSearchParams)):
            params = [params] * len(prompts)
        elif len(params) != len(prompts):
            raise PagedLearnError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if not isinstance(lora_request, list):  # one adapter (or none) for every prompt
            lora_request = [lora_request] * len(prompts)
        elif len(lora_request) != len(prompts):
            raise PagedLearnError(f"{len(prompts)} prompts but {len(lora_request)} lora_requests")
        engine = self.engine
        ids, results, pending = [], {}, {}  # pending: request id -> its Request
        try:
            for prompt, p, lora in zip(prompts, params, lora_request, strict=True):
                rid = f"gen-{self._num_generated}"
                self._num_generated += 1
                ids.append(rid)
                try:
                    # final_only: the loop below reads finished outputs only, so the engine
                    # builds no output for a request before it ends (vLLM's LLM does the same)
                    engine.add_request(rid, prompt, p, lora_request=lora, final_only=True)
                except RequestRejectedError as e:
                    results[rid] = _rejected(rid, prompt, str(e))
                    print(f"pagedlearn: {e}")
                else:
                    pending[rid] = engine.requests[rid]
            with tqdm(total=len(ids), desc="requests", disable=not use_tqdm, leave=False) as bar:
                bar.update(len(ids) - len(pending))
                while pending:
                    # Aborted by other code (a stats subscriber, another thread): the aborter
                    # got its final output, and no step will hand it out; build ours from
                    # the request (finish reason "abort"), or the others' outputs are lost.
                    gone = [r for r, req in pending.items() if req.status is RequestStatus.FINISHED]
                    for rid in gone:
                        results[rid] = request_output(engine, pending.pop(rid))
                        bar.update(1)
                    if not pending or not engine.has_unfinished_requests():
                        break
                    for out in engine.step():
                        if out.finished and out.request_id in pending:
                            results[out.request_id] = out
                            del pending[out.request_id]
                            bar.update(1)
        except BaseException:  # Ctrl-C or a step's error: leave no request of ours behind
            for rid in pending:
                with contextlib.suppress(Exception):  # a broken engine: the first error matters
                    engine.abort_request(rid)
            raise
        return [results[rid] for rid in ids]

    def beam_search(
        self, prompts, params: BeamSearchParams, use_tqdm: bool = True, lora_request=None
    ) -> list[RequestOutput]:
        """Beam search for every prompt (as ``generate`` takes them, ``lora_request`` too);
        each output holds at most ``beam_width`` beams, best first, however the search ends
        (a search that fails says why in ``error``, and keeps the best beams it found)."""
        if not isinstance(params, BeamSearchParams):
            raise PagedLearnError(
                f"beam_search needs BeamSearchParams, got {type(params).__name__}"
            )
        return self.generate(prompts, params, use_tqdm, lora_request)

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """Run ``method`` on every worker and return the results, by rank (vLLM's name).
        ``method``: a :class:`~pagedlearn.parallel.Worker` method's name ("describe",
        "block_usage"), or a function called as ``method(worker, *args, **kwargs)`` (with
        ``tensor_parallel_size > 1`` it must be importable by name: a module-level function,
        since it is pickled to the worker processes). With one worker it runs here, on the
        whole model and cache."""
        from pagedlearn.parallel import collective_rpc

        return collective_rpc(self.engine, method, args, kwargs)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (idempotent; garbage collection and interpreter
        exit do it too). With one worker there is nothing to stop. Afterwards the engine
        refuses to step."""
        if self.tensor_parallel_size > 1:
            self.engine.runner.shutdown()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's name; see ``LLMEngine.reset_prefix_cache``):
        returns how many cached blocks were dropped, where vLLM returns a bool. Refused while a
        request holds blocks (``generate`` leaves none behind)."""
        return self.engine.reset_prefix_cache()


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):  # one prompt: text, or vLLM's TextPrompt/TokensPrompt
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):  # one prompt of token ids
        return [prompts]
    return prompts


def _rejected(rid: str, prompt, error: str) -> RequestOutput:
    from pagedlearn.engine.request import CompletionOutput, RequestMetrics

    if isinstance(prompt, dict):  # vLLM's prompt dicts; it may be malformed (why it was rejected)
        prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
    text = prompt if isinstance(prompt, str) else None
    ids = [] if isinstance(prompt, str) else list(prompt) if hasattr(prompt, "__iter__") else []
    metrics = RequestMetrics(0.0)
    out = CompletionOutput(0, [], 0.0, "error")
    return RequestOutput(rid, text, ids, [out], True, metrics, 0, error)
