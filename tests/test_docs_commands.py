"""Every command shown in README.md and docs/*.md parses and validates as a run would before any
process starts, and every relative link (and its #anchor) resolves.

Commands are the lines of ```bash blocks, the ``$ `` lines of other blocks, and inline code that
starts a program (``python -m``, ``.venv/bin/python -m``, ``bash infra/...``, ``torchrun``). Each
entry point is checked by its own ``check_args``: the real argument parser, then the composed and
validated config of every job (each point of a ``-m`` sweep). An entry point missing from
ENTRY_POINTS fails, so a new doc cannot escape the check. Programs run elsewhere (sbatch, kubectl,
prefect) are checked for the repository files they name.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import re
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from mega.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _check(module: str, function: str = "check_args") -> Callable[[list[str]], object]:
    return lambda argv: getattr(importlib.import_module(module), function)(argv)


# python -m MODULE -> its "parse and validate, run nothing" function
ENTRY_POINTS: dict[str, Callable[[list[str]], object]] = {
    "flows.pretrain": _check("flows.cli"),
    "flows.recover": _check("flows.recover"),
    "mega.bench": _check("mega.bench.__main__"),
    "mega.perf.calibrate": _check("mega.perf.calibrate"),
    "mega.plan": _check("mega.plan"),
    "mega.launch.slurm": _check("mega.launch.slurm"),
    "mega.launch.slurm_local": _check("mega.launch.slurm_local"),
    "mega.launch.kubernetes": _check("mega.launch.kubernetes"),
    "mega.trace": _check("mega.obs.trace"),
    "mega.goodput": _check("mega.goodput.__main__"),
    "mega.bench.tp_overlap": _check("mega.bench.tp_overlap", "parse_args"),
}
# Started by mega itself with a JSON spec (docs name it to say what runs): it must exist.
# mega.train: the rank program torchrun agents start with a resolved config; mega.launch.in_allocation:
# the driver a Slurm job of launcher.slurm.driver=allocation starts on its first node.
INTERNAL_MODULES = {"mega.data.loader", "mega.train", "mega.launch.in_allocation"}
# Other people's programs: the repository paths they are given must exist.
EXTERNAL_MODULES = {"pip", "pytest"}
# (shell builtins that docs show setting up a session count too)
EXTERNAL_PROGRAMS = {"sbatch", "sinfo", "squeue", "scontrol", "kubectl", "prefect", "export"}
# Scripts whose extra arguments go to an entry point.
SCRIPT_ARGS = {"infra/gpu-tp-overlap.sh": "mega.bench.tp_overlap"}
# <placeholders> docs use, and a value of the kind each stands for
PLACEHOLDERS = {
    "<uuid>": "00000000-0000-0000-0000-000000000000",
    "<machine>": "machine",
    "<benchmark>": "step",
}
PROGRAM = re.compile(r"^(sudo )?((\.venv/bin/)?python3? -m |bash infra/|(\.venv/bin/)?torchrun )")


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    text: str
    fails_with: str | None = None  # the shown output: "invalid config: KEY: ..."
    inline: bool = False


def _fenced(path: Path) -> tuple[list[Command], set[int]]:
    """Commands of the fenced blocks, and the lines the blocks cover (inline code is not read there)."""
    lines = path.read_text().splitlines()
    out, covered, lang, start = [], set(), None, 0
    for n, line in enumerate(lines, 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and lang is None:
            lang, start = fence.group(1), n
        elif fence:
            covered.update(range(start, n + 1))
            if lang in ("bash", "sh", "console", ""):
                out += _block_commands(path, start, lines[start : n - 1], lang == "bash")
            lang = None
    return out, covered


def _block_commands(path: Path, first: int, body: list[str], shell: bool) -> list[Command]:
    out: list[Command] = []
    pending, at = "", 0
    for n, line in enumerate(body, first + 1):
        prompt = line.startswith("$ ")
        command = line.strip() and not line.lstrip().startswith("#") if shell else PROGRAM.match(line.strip())
        if prompt or command or pending:
            text = line[2:] if prompt else line
            at = at if pending else n
            pending += text.rstrip("\\").strip() + " "
            if not text.rstrip().endswith("\\"):
                out.append(Command(f"{path.name}:{at}", pending.strip()))
                pending = ""
        elif out and line.strip() and not shell and out[-1].where == f"{path.name}:{n - 1}":
            shown = re.search(r"invalid config: ([\w.]+): (.*)", line)  # the output a transcript shows
            if shown:
                out[-1] = Command(out[-1].where, out[-1].text, shown.group(0))
    return out


def _inline(path: Path, covered: set[int]) -> list[Command]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if n in covered:
            continue
        for code in re.findall(r"(?<!`)`([^`]+)`(?!`)", line):
            if PROGRAM.match(code) or code.split(" ")[0] in EXTERNAL_PROGRAMS:
                out.append(Command(f"{path.name}:{n}", code, inline=True))
    return out


def all_commands() -> list[Command]:
    out = []
    for path in DOCS:
        fenced, covered = _fenced(path)
        out += fenced + _inline(path, covered)
    return out


def unique(commands: list[Command]) -> list[Command]:
    """Each distinct command once (README and docs repeat some), where it is first shown."""
    first: dict[tuple, Command] = {}
    for c in commands:
        first.setdefault((c.text, c.fails_with, c.inline), c)
    return list(first.values())


COMMANDS = unique(all_commands())


def _words(text: str) -> list[list[str]]:
    """The simple commands of a shell line (split at && ; | ||), each as its words."""
    words = shlex.split(text, comments=True)
    return [list(g) for sep, g in itertools.groupby(words, lambda w: w in ("&&", ";", "|", "||")) if not sep]


def _variants(args: list[str]) -> list[list[str]] | None:
    """A synopsis made concrete: ``[--opt v]`` included, a described slot (``[hydra overrides]``)
    and ``key=...`` left out, ``key=a|b`` tried each way, <placeholders> given a value. None when
    the arguments are elided (a bare ``...``)."""
    if "..." in args:
        return None
    words, group = [], []
    for word in args:
        if word.startswith("[") or group:
            group.append(word)
            if word.endswith("]"):
                if group[0].startswith("[-"):  # [--steps 6]: an option the synopsis offers
                    words += " ".join(group)[1:-1].split(" ")
                group = []
            continue
        for name, value in PLACEHOLDERS.items():
            word = word.replace(name, value)
        words.append(word)
    choices = []
    for word in words:
        if word.endswith("=..."):
            continue
        key, _, values = word.rpartition("=")
        choices.append([f"{key}={v}" for v in values.split("|")] if key and "|" in values else [word])
    return [list(combo) for combo in itertools.product(*choices)]


def _check_module(module: str, args: list[str], mention: bool = False) -> None:
    if module in EXTERNAL_MODULES:
        _check_paths(args)
        return
    if module in INTERNAL_MODULES:
        assert importlib.util.find_spec(module), f"no module {module}"
        return
    assert module in ENTRY_POINTS, (
        f"python -m {module}: not a known entry point (add its check to ENTRY_POINTS)"
    )
    variants = _variants(args)
    if variants is None or mention:  # `python -m mega.bench ...`, `python -m mega.trace`: the program's name
        return
    for argv in variants:
        try:
            ENTRY_POINTS[module](argv)
        except SystemExit as exit_:  # argparse: unknown flag, bad value, missing argument (0: --help)
            if exit_.code not in (0, None):
                pytest.fail(f"python -m {module} {' '.join(argv)}: the parser refused it (exit {exit_.code})")


def _check_paths(args: list[str]) -> None:
    for word in args:
        if re.match(r"^(infra|conf|docs|tests|mega|flows|tasks)/", word):
            assert (ROOT / word.split("::")[0]).exists(), f"{word} does not exist"


def check(command: Command) -> None:
    for words in _words(command.text):
        while words and (words[0] == "sudo" or re.fullmatch(r"[A-Z_]+=\S*", words[0])):
            words = words[1:]
        program, args = words[0], words[1:]
        if program.endswith("python") or program.endswith("python3") or program.endswith("torchrun"):
            assert "-m" in args, f"{command.text}: only `python -m MODULE` commands are shown"
            i = args.index("-m")
            _check_module(args[i + 1], args[i + 2 :], mention=command.inline and not args[i + 2 :])
        elif program == "bash":
            script = ROOT / args[0]
            assert script.is_file(), f"{args[0]} does not exist"
            syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
            assert syntax.returncode == 0, syntax.stderr
            if args[0] in SCRIPT_ARGS and len(args) > 1:
                _check_module(SCRIPT_ARGS[args[0]], args[1:])
        elif program in EXTERNAL_PROGRAMS:
            _check_paths(args)
        else:
            pytest.fail(f"{command.text}: unknown program {program!r} (an entry point or EXTERNAL_PROGRAMS)")


def test_the_docs_show_commands():
    found = {c.text.split(" -m ")[-1].split(" ")[0] for c in COMMANDS if " -m " in c.text}
    assert {"flows.pretrain", "mega.bench", "mega.plan"} <= found, found


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_command_parses_and_validates(command: Command):
    if command.fails_with is None:
        try:
            check(command)
        except ConfigError as err:
            pytest.fail(f"{command.where}: {command.text}: {err}")
        return
    key, message = re.match(r"invalid config: ([\w.]+): (.*)", command.fails_with).groups()
    with pytest.raises(ConfigError) as info:  # a transcript showing the error a user gets
        check(command)
    assert (info.value.key, str(info.value)) == (key, f"{key}: {message}")


# ---------------------------------------------------------------------------------------------
# Links


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if heading and not in_code:
            slug = _slug(heading.group(1))
            out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return out


def links(path: Path) -> list[tuple[int, str]]:
    out, in_code = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        prose = re.sub(r"`[^`]*`", "", line)
        out += [(n, target) for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose)]
    return out


LINKS = [(path, n, target) for path in DOCS for n, target in links(path) if not re.match(r"^[a-z]+:", target)]


def test_the_docs_link_to_each_other():
    assert len(LINKS) > 20


@pytest.mark.parametrize("path, line, target", LINKS, ids=[f"{p.name}:{n}" for p, n, _ in LINKS])
def test_relative_link_resolves(path: Path, line: int, target: str):
    file, _, anchor = target.partition("#")
    dest = (path.parent / file).resolve() if file else path
    assert dest.exists(), (
        f"{path.name}:{line}: {target}: no {dest.relative_to(ROOT) if ROOT in dest.parents else dest}"
    )
    if anchor and dest.suffix == ".md":
        assert anchor in anchors(dest), f"{path.name}:{line}: {target}: no heading #{anchor} in {dest.name}"


def test_a_wrong_command_or_link_is_caught():
    """The checks can fail: an unknown key, a removed flag, an invalid combination, an unknown
    entry point, a synopsis alternative, a missing file."""
    bad = [
        "python -m flows.pretrain train.nope=1",
        "python -m mega.bench step --no-such-flag",
        "python -m flows.pretrain -m parallelism=single,tp2 optimizer.warmup_steps=10 train.steps=10",
        "python -m mega.nothing",
        "python -m mega.bench step model.fused_ops=false|maybe",
        "prefect deploy --prefect-file infra/missing.yaml",
    ]
    for text in bad:
        with pytest.raises((ConfigError, AssertionError, pytest.fail.Exception)):
            check(Command("test", text))
    assert "no-such-heading" not in anchors(ROOT / "README.md")
