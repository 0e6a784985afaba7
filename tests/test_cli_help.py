"""`draftsmith --help` and every `draftsmith COMMAND ... --help`: each flag and positional says what it does, and
one with a default shows it; the top-level help lists every command once, under its pipeline stage."""

from __future__ import annotations

import argparse

import pytest

from draftsmith import cli

PLAIN_FLAGS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
               argparse._CountAction)  # their default is the flag left out: nothing to state


def parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("draftsmith",)):
    """(command words, parser) of the whole tree: every subcommand, its subcommands, and so on (an alias once)."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sub in action._name_parser_map.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    yield from parsers(sub, (*path, name))


def missing_help(parser: argparse.ArgumentParser) -> list[str]:
    """One line per argument of `parser` whose help is missing, or does not show the argument's default."""
    problems = []
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        if isinstance(action, argparse._SubParsersAction):
            problems += [f"{sub.dest}: no help" for sub in action._get_subactions() if not (sub.help or "").strip()]
            continue
        if action.help == argparse.SUPPRESS or not (action.help or "").strip():
            problems.append(f"{name}: no help")
            continue
        default = action.default
        if default is None or default == argparse.SUPPRESS or isinstance(action, PLAIN_FLAGS) or default == []:
            continue
        if f"default: {default}" not in formatter._expand_help(action):  # `%(default)s` writes it so
            problems.append(f"{name}: its default {default!r} is not in its help {action.help!r}")
    return problems


def test_every_argument_of_every_command_has_help_with_its_default():
    tree = list(parsers(cli.build_parser()))
    names = {" ".join(path[1:]) for path, _ in tree}
    # the walk reaches the nested commands too: a method's own command, `bench JOB`, `data X`, `route X`
    assert {"train", "evaluate", "bench engine", "bench headline", "data generate", "route build",
            "medusa2-drift"} <= names
    problems = [f"{' '.join(path)} {p}" for path, parser in tree for p in missing_help(parser)]
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_flag_without_help_or_default():
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", type=int)
    parser.add_argument("--b", type=int, default=3, help="steps")
    parser.add_argument("--c", type=int, default=3, help="steps (default: %(default)s)")
    parser.add_argument("--d", action="store_true", help="on")
    parser.add_argument("--e", default="x.yaml", help="a preset (default: %(default)s)")
    parser.add_argument("f", nargs="?", default="t", help="what it is, without its default")
    assert missing_help(parser) == ["--a: no help", "--b: its default 3 is not in its help 'steps'",
                                    "f: its default 't' is not in its help 'what it is, without its default'"]


def test_evaluate_flags_read_their_meaning_and_default_from_eval_config():
    """The help of a flag that sets an EvalConfig field is that field's comment and default, so they cannot
    drift apart."""
    from draftsmith.config import field_docs
    from draftsmith.evaluation.commands import FLAGS
    from draftsmith.evaluation.config import EvalConfig

    docs = field_docs(EvalConfig)
    evaluate = dict(parsers(cli.build_parser()))[("draftsmith", "evaluate")]
    helps = {a.option_strings[0]: a.help for a in evaluate._actions if a.option_strings}
    for flag, (name, _) in FLAGS.items():
        assert docs[name] and helps[flag].startswith(docs[name]), flag
        assert f"default: {getattr(EvalConfig(), name)}" in helps[flag] or getattr(EvalConfig(), name) is None, flag


def test_field_docs_reads_the_comments_above_and_beside_each_field():
    from dataclasses import dataclass, field

    from draftsmith.config import field_docs

    @dataclass
    class Example:
        a: int = 1  # steps to run
        # where the files go,
        # one folder per run
        b: str = "out"
        c: list[int] = field(
            default_factory=list)  # sizes, in bytes
        d: float = 0.5

    assert field_docs(Example) == {"a": "steps to run", "b": "where the files go, one folder per run",
                                   "c": "sizes, in bytes", "d": ""}


def test_top_level_help_groups_every_command_by_pipeline_stage(capsys):
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    headings = [f"{stage}:" for stage, _, _ in cli.STAGES]
    at = [text.find(h) for h in headings]
    assert -1 not in at and at == sorted(at), text  # every stage, in pipeline order
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    # a command's line is indented under its stage's heading (4 spaces); its help's lines wrap further in
    listed = [line.split()[0] for line in text[at[0]:].splitlines() if line[:4] == "    " and line[4] != " "]
    assert sorted(listed) == sorted(commands.choices), text  # each command once
    assert cli.unstaged(parser) == [] and "in no stage" not in text


def test_a_command_without_a_stage_is_caught():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands.add_parser("new-job", help="a job nobody placed in a stage")
    assert cli.unstaged(parser) == ["new-job"]
    assert "in no stage:\n    new-job" in parser.format_help()  # still listed, after every stage


def _loads_heavy(argv: list[str]) -> tuple[str, str]:
    """(what the command printed, the heavy packages its process had imported by then): `draftsmith ARGV` in
    a fresh interpreter, as a user's shell runs it."""
    import subprocess
    import sys

    code = (f"import sys\nfrom draftsmith.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('HEAVY=' + ','.join(m for m in ('torch', 'transformers', 'safetensors', 'accelerate') "
            "if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    heavy = run.stdout.rsplit("HEAVY=", 1)[-1].strip()
    return run.stdout + run.stderr, heavy


@pytest.mark.parametrize("argv", [["--help"], ["evaluate", "--help"], ["train", "eagle", "--help"],
                                  ["retrain", "--help"], ["alpha", "--no-such-flag"], ["export", "--to", "nowhere"]])
def test_help_and_argument_errors_load_no_torch(argv):
    """`draftsmith --help`, a command's --help and an argument error answer without importing torch or
    transformers (seconds of start-up a user waits for a help text): the packages import their names lazily
    (lazy.py) and the command modules import heavy code in their handlers."""
    out, heavy = _loads_heavy(argv)
    assert "usage:" in out, out[-2000:]
    assert heavy == "", f"draftsmith {' '.join(argv)} imported {heavy}"


def test_a_lazy_name_shared_with_its_submodule_stays_the_name():
    """`draftsmith.evaluation.evaluate` is the function even after its submodule evaluation/evaluate.py was
    imported first (the import system sets the package's attribute to the submodule; the eager `__init__`
    this replaced reset it to the function), and so is `draftsmith.targets.fingerprint`."""
    import subprocess
    import sys

    code = ("import draftsmith.evaluation.evaluate, draftsmith.targets.fingerprint\n"
            "from draftsmith.evaluation import evaluate\nfrom draftsmith.targets import fingerprint\n"
            "print(callable(evaluate) and evaluate.__name__, callable(fingerprint) and fingerprint.__name__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.stdout.split() == ["evaluate", "fingerprint"], run.stdout + run.stderr[-2000:]
