"""The serving engine: requests, sampling, continuous-batching scheduler, preemption, ``LLM``.

Read in this order: ``sampling_params`` (what a request asks for), ``request`` (requests,
sequences, outputs), ``scheduler_output`` (a step's plan), ``scheduler`` (who runs each step;
preemption), ``chunked_prefill`` (how much of a request fits the step's budget),
``reservation`` (the max-length reservation baseline), ``sampler`` and ``beam_search`` (next
tokens), ``admission`` (checking a request in), ``llm_engine`` (one step end to end),
``cache_keys`` (the model's version in the block hashes; resetting the prefix cache),
``outputs`` (what a step hands out), ``recovery`` (rolling back a step that raised), ``llm``
(the front door) and ``engine_args`` (how it builds the engine). The operator's view:
``stats`` (each step), ``metrics`` over ``distribution`` (over the engine's life),
``prometheus``, and ``queue_changes`` (a recording read back as the scheduler's decisions).
"""

from pagedlearn.engine.llm import LLM
from pagedlearn.engine.llm_engine import LLMEngine, RequestRejectedError
from pagedlearn.engine.request import CompletionOutput, RequestOutput
from pagedlearn.engine.sampling_params import BeamSearchParams, SamplingParams
from pagedlearn.engine.stats import StepStats

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "LLMEngine",
    "RequestOutput",
    "RequestRejectedError",
    "SamplingParams",
    "StepStats",
]
