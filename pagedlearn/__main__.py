"""Command line: ``python -m pagedlearn {demo, blocks, check-env, paper, figures, labs, grade}``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedlearn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="a model serving a mixed batch from a small paged KV cache (the main job)"
    )
    demo.add_argument(
        "--model",
        default="auto",
        help="gpt2, facebook/opt-125m, tiny-gpt2, tiny-opt, a path, or auto "
        "(gpt2 if cached, else tiny-gpt2)",
    )
    demo.add_argument("--block-size", type=int, default=16, help="tokens per block")
    demo.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="blocks in the pool (default: about half of what the batch needs)",
    )
    demo.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    demo.add_argument(
        "--backend",
        choices=("auto", "torch", "triton"),
        default="auto",
        help="attention: auto = Triton on a GPU, the PyTorch reference on a CPU",
    )
    demo.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    blocks = sub.add_parser("blocks", help="the memory manager alone, with made-up tokens")
    blocks.add_argument("--num-blocks", type=int, default=16, help="physical blocks in the pool")
    blocks.add_argument("--block-size", type=int, default=4, help="tokens per block")
    blocks.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    env = sub.add_parser("check-env", help="print [OK]/[FAIL] per dependency, GPU and Triton")
    env.add_argument("--no-dev", action="store_true", help="skip the dev tools")
    paper = sub.add_parser("paper", help="recompute the paper's memory figures beside its numbers")
    paper.add_argument("--quick", action="store_true", help="fewer requests and sweep points")
    paper.add_argument("--figures", default="figures", help="where to write PNGs ('' for none)")
    figures = sub.add_parser("figures", help="regenerate every PNG in figures/ (seeded, offline)")
    figures.add_argument("--out", default="figures", help="where to write the PNGs")
    figures.add_argument("--no-paper", action="store_true", help="skip the paper's figures")
    figures.add_argument("--quick", action="store_true", help="smaller simulations")
    labs = sub.add_parser("labs", help="the graded labs: list them, or export the student handout")
    labs_sub = labs.add_subparsers(dest="labs_command", required=True)
    labs_sub.add_parser("list", help="one line per lab: <id>  <reference file>  <title>")
    export = labs_sub.add_parser("export", help="write the student handout (no solutions) to DIR")
    export.add_argument("dir", metavar="DIR")
    grade = sub.add_parser("grade", help="grade a lab submission (exit 0: all pass, 1: some fail)")
    grade.add_argument("lab", metavar="LAB", help="allocator, cow, prefix, attention, kernel, ...")
    grade.add_argument(
        "submission", metavar="SUBMISSION", nargs="*", help="the lab notebook, or its .py files"
    )
    grade.add_argument(
        "--reference", action="store_true", help="grade the package's own code (full marks)"
    )
    grade.add_argument("--json", metavar="PATH", help="write Gradescope's results.json there")
    args = parser.parse_args(argv)

    if args.command in ("labs", "grade"):
        return _labs(args)

    if args.command == "figures":
        from pagedlearn.figures import make_figures

        make_figures(args.out, paper=not args.no_paper, quick=args.quick)
        return 0
    if args.command == "paper":
        from pagedlearn.sim.paper import report

        report(quick=args.quick, figures_dir=args.figures or None)
        return 0

    if args.command in ("demo", "blocks"):
        from pagedlearn.errors import PagedLearnError

        try:
            if args.command == "blocks":
                from pagedlearn.block_demo import run_demo

                run_demo(args.num_blocks, args.block_size, not args.no_prefix_caching)
            else:
                from pagedlearn.demo import run_demo

                run_demo(
                    args.model,
                    args.block_size,
                    args.num_blocks,
                    args.preemption_mode,
                    args.backend,
                    not args.no_prefix_caching,
                )
        except PagedLearnError as e:
            print(f"{args.command} stopped: {e}", file=sys.stderr)
            return 1
        return 0
    from pagedlearn.check_env import check_env

    return check_env(include_dev=not args.no_dev)


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


if __name__ == "__main__":
    sys.exit(main())
