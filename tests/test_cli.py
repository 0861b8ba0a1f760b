"""``python -m pagedlearn``: every bad option is refused before any work, by the command it was
given to; quick runs leave the committed figures alone.

These tests call ``main()`` in-process with the work itself (a model load, a simulation) replaced
by a function that fails the test if reached, so they run in well under a second each.
(``tests/test_packaging.py`` runs the real ``python -m pagedlearn`` for the demos and
``check-env``.)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

import pagedlearn
from pagedlearn.__main__ import build_parser, main, writable_dir
from pagedlearn.cli import demo

ROOT = Path(__file__).resolve().parents[1]


def refuse(argv, capsys) -> str:
    """Run ``main(argv)``, expect argparse's exit code 2, and return what it printed on stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2, exc.value.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.fixture
def no_work(monkeypatch):
    """Every command's work fails the test if reached: the checks must come first."""

    def boom(*args, **kwargs):
        raise AssertionError("the command started working before refusing a bad option")

    import pagedlearn.cli.blocks
    import pagedlearn.cli.figures
    import pagedlearn.labs.export
    import pagedlearn.sim.paper

    for module, name in (
        (pagedlearn.cli.figures, "make_figures"),
        (pagedlearn.sim.paper, "report"),
        (pagedlearn.labs.export, "export"),
        (pagedlearn.cli.blocks, "run_demo"),
        (pagedlearn.cli.demo, "run_demo"),
    ):
        monkeypatch.setattr(module, name, boom)


@pytest.fixture
def unwritable(tmp_path) -> Path:
    """A directory that cannot be created, whoever runs the tests (root too): its parent is a
    file."""
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "figures"


@pytest.mark.parametrize(
    "command", [["figures", "--out"], ["paper", "--figures"], ["paper", "--quick", "--figures"]]
)
def test_an_unwritable_output_directory_is_refused_before_any_computation(
    command, unwritable, no_work, capsys
):
    err = refuse([*command, str(unwritable)], capsys)
    last = err.strip().splitlines()[-1]
    assert f"error: argument {command[-1]}: cannot create directory {unwritable}" in last
    assert err.startswith(f"usage: python -m pagedlearn {command[0]}")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_the_issues_paths_under_proc_are_refused(no_work, capsys):
    assert "cannot create directory /proc/x" in refuse(["figures", "--out", "/proc/x"], capsys)
    err = refuse(["paper", "--figures", "/proc/nonexistent/dir"], capsys)
    assert "argument --figures: cannot create directory /proc/nonexistent/dir" in err


def test_an_output_path_that_is_a_file_and_other_writers_are_checked(tmp_path, no_work, capsys):
    (tmp_path / "f").write_text("")
    assert "exists and is not a directory" in refuse(
        ["figures", "--out", str(tmp_path / "f")], capsys
    )
    err = refuse(["labs", "export", str(tmp_path / "f" / "x")], capsys)
    assert "argument DIR: cannot create directory" in err and "labs export" in err
    err = refuse(["grade", "cow", "--reference", "--json", str(tmp_path)], capsys)
    assert "is a directory" in err
    err = refuse(["grade", "cow", "--reference", "--json", str(tmp_path / "f" / "r.json")], capsys)
    assert "argument --json: " + str(tmp_path / "f") + " exists and is not a directory" in err


def test_writable_dir_creates_what_is_missing_and_says_why_not(tmp_path):
    assert writable_dir(tmp_path / "new" / "deeper") is None
    assert (tmp_path / "new" / "deeper").is_dir()
    (tmp_path / "f").write_text("")
    assert "not a directory" in writable_dir(tmp_path / "f")


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """Replace the figures' and the paper's work by a recorder; run from an empty directory, with
    temporary directories made under ``tmp_path``."""
    import pagedlearn.cli.figures
    import pagedlearn.sim.paper

    calls = []
    monkeypatch.setattr(pagedlearn.sim.paper, "report", lambda **kw: calls.append(kw) or [])
    monkeypatch.setattr(
        pagedlearn.cli.figures, "make_figures", lambda d, **kw: calls.append({"dir": d, **kw}) or []
    )
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return calls


@pytest.mark.parametrize("command", ["paper", "figures"])
def test_a_quick_run_writes_to_a_temporary_directory_and_says_where(command, recorded, capsys):
    assert main([command, "--quick"]) == 0
    written = Path(recorded[0]["figures_dir" if command == "paper" else "dir"])
    assert written.is_dir() and written.name.startswith(f"pagedlearn-{command}-quick-")
    assert not Path("figures").exists()  # the committed figures/ was not touched
    assert str(written) in capsys.readouterr().out


def test_where_the_figures_go_otherwise(recorded, tmp_path):
    main(["paper", "--quick", "--figures", "mine"])  # asked for: written where asked
    main(["paper"])  # a full run: figures/, as the README's tables describe
    main(["paper", "--figures", ""])  # none
    main(["figures", "--quick", "--out", "theirs"])
    main(["figures"])
    dirs = [c.get("figures_dir", c.get("dir")) for c in recorded]
    assert dirs == ["mine", "figures", None, "theirs", "figures"]
    assert Path("mine").is_dir() and Path("theirs").is_dir()  # created up front


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["demo", "--num-blocks", "-5"],
            "argument --num-blocks: must be a positive integer, got -5",
        ),
        (["demo", "--num-blocks", "0"], "argument --num-blocks: must be a positive integer, got 0"),
        (["demo", "--block-size", "0"], "argument --block-size: must be a positive integer, got 0"),
        (["demo", "--block-size", "100000"], "argument --block-size: must be at most 4096"),
        (["demo", "--block-size", "4k"], "argument --block-size: must be an integer, got '4k'"),
        (["blocks", "--num-blocks", "-1"], "argument --num-blocks: must be a positive integer"),
        (["blocks", "--num-blocks", "100000"], "argument --num-blocks: must be at most 1024"),
        (["blocks", "--block-size", "65"], "argument --block-size: must be at most 64"),
    ],
)
def test_bad_numbers_are_refused_before_anything_loads(argv, message, no_work, capsys):
    err = refuse(argv, capsys)
    assert message in err and err.startswith(f"usage: python -m pagedlearn {argv[0]}")


def test_an_unknown_option_is_reported_by_its_own_command(capsys):
    err = refuse(["check-env", "--bogus"], capsys)
    assert err.startswith("usage: python -m pagedlearn check-env [-h] [--no-dev]")
    assert "unrecognized arguments: --bogus" in err
    assert refuse(["labs", "list", "--x"], capsys).startswith(
        "usage: python -m pagedlearn labs list"
    )
    assert refuse(["--bogus", "blocks"], capsys).startswith("usage: python -m pagedlearn [-h]")


def test_help_is_plain_text_every_option_explained_defaults_shown(capsys):
    parser, parsers = build_parser()
    assert "``" not in parser.format_help()
    for name, p in parsers.items():
        for action in p._actions:  # argparse keeps no public list of them
            if action.dest not in ("command", "labs_command"):  # the subcommands: help of their own
                assert action.help, f"{name} {action.option_strings or action.dest}: no help"
    text = parsers["demo"].format_help()
    assert "(default: 16)" in text and "(default: recompute)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "CPU pool" in text  # --preemption-mode says what each mode does


def test_the_demo_checks_the_models_context_and_the_pool_before_allocating(monkeypatch):
    from pagedlearn.models import load

    loaded = load("tiny-gpt2")  # a context of 512 tokens, 1,024 B per token
    with pytest.raises(demo.OptionError, match="more than tiny-gpt2's context of 512") as e:
        demo.check_for_model(loaded, 513, 4, swap=False)
    assert e.value.option == "block_size"
    demo.check_for_model(loaded, 512, 4, swap=False)  # a block as long as the context is fine
    with pytest.raises(demo.OptionError, match=r"GiB of KV cache") as e:
        demo.check_for_model(loaded, 16, 2**16 + 1, swap=False)  # 1 GiB and 16 KiB
    assert e.value.option == "num_blocks"
    demo.check_for_model(loaded, 16, 2**16, swap=False)  # exactly 1 GiB
    with pytest.raises(demo.OptionError, match=r"x 2 \(the swap pool\)"):
        demo.check_for_model(loaded, 16, 2**16, swap=True)

    # Through the command line: refused as a bad option (exit 2), the pool never built.
    def no_pool(*args, **kwargs):
        raise AssertionError("the pool was allocated")

    monkeypatch.setattr(pagedlearn, "LLM", no_pool)
    monkeypatch.setattr("pagedlearn.models.load", lambda name: loaded)
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--model", "tiny-gpt2", "--block-size", "1000"])
    assert exc.value.code == 2


def test_the_demo_api_refuses_bad_options_before_loading():
    for kwargs in ({"num_blocks": -5}, {"block_size": 0}, {"block_size": 100000}):
        with pytest.raises(demo.OptionError):
            demo.run_demo("no-such-model-would-be-loaded", **kwargs)
