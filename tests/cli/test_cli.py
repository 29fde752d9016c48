"""`./vllm-t4`'s dispatch: a command line imports only the module that registers its command."""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import subprocess
import sys

import pytest

from tests.helpers.fixtures import ROOT
from tools import cli
from tools.cli import MODULES
from tools.core.commands import COMMAND_LINES


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    return list(parser._subparsers._group_actions[0].choices)


def test_every_command_is_in_the_table_under_the_module_that_registers_it():
    assert sorted(_commands(cli.build_parser())) == sorted(MODULES)
    typed = {line.split()[1] for line, _ in COMMAND_LINES.values() if line.startswith("./vllm-t4 ")}
    assert typed == set(MODULES)
    # A string the import check cannot see names only the command line's own modules: no hidden layer break.
    assert all(m == "tools.cli" or m.startswith("tools.cli.") for m in MODULES.values())
    for module in set(MODULES.values()):
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(sub)
        assert sorted(sub.choices) == sorted(c for c, m in MODULES.items() if m == module), module


def test_a_command_line_builds_only_its_module_and_parses_as_with_every_command():
    for command, module in MODULES.items():
        one = cli.build_parser(command)
        assert command in _commands(one) and {MODULES[c] for c in _commands(one)} == {module}
    argv = ["status", "--instance", "a", "--json"]
    assert vars(cli.build_parser("status").parse_args(argv)).keys() == vars(cli.build_parser().parse_args(argv)).keys()


def test_status_imports_neither_the_measuring_nor_the_demo_modules():
    code = ("import sys; from tools.cli import main; rc = main(['status', '--instance=../x']); "
            "print(rc, sorted(m for m in ('tools.measure.evals.run', 'tools.measure.decode.run', 'tools.demo.demo', "
            "'tools.measure.fidelity.run', 'tools.serving.hub.fetch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[0] == "2 []", (out.stdout, out.stderr)


def test_demo_runs_the_demos_own_front_end_named_as_the_command_line(tmp_path):
    """`./vllm-t4 demo` becomes `python3 -m tools.demo`: its help, and a failure as `vllm-t4 demo: reason` with the
    status of bad input; the demo on its own keeps its own names."""
    env_file = tmp_path / "tpu.env"
    env_file.write_text((ROOT / "tpu.env").read_text() + "\nSOURCE_CHECKPOINT=\n")
    argv = ["--platform", "gpu", "--env-file", str(env_file), "--work", str(tmp_path / "w")]
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_CHECKPOINT"}
    run = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    helped = run([str(ROOT / "vllm-t4"), "demo", "--help"])
    assert helped.returncode == 0 and helped.stdout.startswith("usage: vllm-t4 demo [-h] [--work WORK]"), helped
    failed = run([str(ROOT / "vllm-t4"), "demo", *argv])
    assert failed.returncode == 2 and failed.stderr.startswith("vllm-t4 demo: "), failed.stderr
    assert "SOURCE_CHECKPOINT is not set" in failed.stderr and failed.stderr.count("\n") == 1, failed.stderr
    alone = run([sys.executable, "-m", "tools.demo", *argv])
    assert alone.returncode == 2 and alone.stderr.startswith("demo: "), alone.stderr


def test_an_unknown_command_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(f"'{c}'" in err for c in MODULES), err


@pytest.mark.parametrize("argv, command", [(["status", "--bogus"], "vllm-t4 status"),
                                           (["router", "status", "--bogus", "x"], "vllm-t4 router status")])
def test_an_unknown_flag_is_refused_by_the_command_it_was_given_to(capsys, argv, command):
    """The line names the command and its usage is the command's, not the program's list of every command."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"usage: {command} [-h]"), err
    assert err.splitlines()[-1] == f"{command}: error: unrecognized arguments: {' '.join(argv[len(command.split()) - 1:])}"


def test_an_unknown_flag_of_a_repack_step_names_the_step(capsys):
    from tools.cli.repack_cli import main as repack_main

    with pytest.raises(SystemExit) as e:
        repack_main(["build", "src", "out", "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.splitlines()[-1] == "python3 -m repack build: error: unrecognized arguments: --bogus"


def test_main_in_process_leaves_the_sigterm_handler_as_it_was(capsys):
    """main() handles SIGTERM while its command runs; called in-process (tests, an embedding program) it gives the
    caller's handler back on return, and a later call handles SIGTERM again."""
    import signal

    def caller_handler(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, caller_handler)
    try:
        assert cli.main(["status", "--instance=../x"]) == 2
        assert signal.getsignal(signal.SIGTERM) is caller_handler
    finally:
        signal.signal(signal.SIGTERM, before)
    capsys.readouterr()


@pytest.mark.parametrize("first", [["--env-file", "{env}"], ["--env-file={env}"]])
def test_the_env_file_given_before_the_command_is_the_commands(capsys, tmp_path, first):
    """`./vllm-t4 --env-file FILE status` read FILE as the command ("invalid choice"): it is status's
    --env-file, as after the command (here a file whose empty MODEL_NAME status refuses, naming the file)."""
    env = tmp_path / "my.env"
    env.write_text("MODEL_NAME=\n")
    rc = cli.main([a.format(env=env) for a in first] + ["status"])
    err = capsys.readouterr().err
    assert rc == 2 and "invalid choice" not in err and f"MODEL_NAME is empty (set in {env})" in err, err
