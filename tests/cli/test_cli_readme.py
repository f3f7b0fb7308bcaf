"""The README's command-line examples run as written (on a fresh embedded database)."""
from __future__ import annotations

import pathlib
import re
import shlex

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def readme_commands() -> list:
    """The ``fdq ...`` lines of the README's first ``sh`` block after "The `fdq` command
    line", each as (argv, stdin): ``seq N | fdq ...`` feeds N lines."""
    text = README.read_text()
    section = text[text.index("The `fdq` command line"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S)[1]
    commands = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        stdin = None
        if words[:1] == ["seq"]:
            stdin = "".join(f"{i}\n" for i in range(1, int(words[1]) + 1))
            words = words[3:]                      # drop "seq N |"
        if words[:1] == ["fdq"] and words[1:2] != ["broker"]:     # the broker: tests/cli/test_cli_broker.py
            commands.append((words[1:], stdin))
    return commands


def test_the_readme_examples_run(run):
    commands = readme_commands()
    assert len(commands) >= 5, commands
    outputs = {}
    for argv, stdin in commands:
        outputs[" ".join(argv)] = run(*argv, input=stdin).stdout
    assert len(outputs["push orders - --key cust-42"].split()) == 1000          # prints the ids
    tailed = outputs["tail orders --count 10 --json"].splitlines()
    assert [line.count('"body"') for line in tailed] == [1] * 10                # prints (and acks) 10
    assert '"backlog": 990' in outputs["stats orders --json"]


def test_the_readme_names_every_command_that_finishes_when_run_again():
    """The README's list of chunked commands that finish when run again after Ctrl-C
    names every command that says so when interrupted (``resumable``)."""
    import inspect

    import click

    from fdq.cli import cli
    text = README.read_text()
    start = text.index("a chunked operation")
    segment = text[start:text.index("finishes when run again", start)]
    items = [re.split(r"[ |]+", item) for item in segment.split("`")[1::2]]

    def commands(group, path):
        for name, cmd in group.commands.items():
            if isinstance(cmd, click.Group):
                yield from commands(cmd, path + [name])
            else:
                yield path + [name], cmd
    resumable = [p for p, cmd in commands(cli, []) if "resumable(" in inspect.getsource(cmd.callback)]
    assert len(resumable) >= 7, resumable
    missing = [p for p in resumable
               if not any(words[:len(p) - 1] == p[:-1] and p[-1] in words[len(p) - 1:] for words in items)]
    assert not missing, f"not in the README's list: {missing}"
