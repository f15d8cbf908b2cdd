"""The docs say what the code does: every configuration key with its type and default, every
doc linked from the README, every file a doc names present, and the cheap shell commands the
docs show (``--help``, ``check-config``) run as written."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
import yaml

from lmcache_mooncake import config

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
CONFIG_DOC = DOCS / "configuration.md"
#: Docs of this repository that users read (each must be linked from the README).
USER_DOCS = sorted(p.name for p in DOCS.glob("*.md"))


def doc_tables(text: str) -> dict[str, dict[str, dict[str, str]]]:
    """``{section heading: {key: {column: cell}}}`` for every table whose first column is ``key``."""
    tables: dict[str, dict[str, dict[str, str]]] = {}
    heading, header = "", None
    for line in text.splitlines():
        if line.startswith("#"):
            heading, header = line.lstrip("#").strip(), None
            continue
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set(line) <= set("|-: ") or header[0] != "key":
            continue
        tables.setdefault(heading, {})[cells[0].strip("`")] = dict(zip(header, cells, strict=True))
    return tables


def expected_type(cls: type, name: str) -> str:
    """How the doc writes a field's type."""
    if name in config._SIZE_KEYS.get(cls.__name__, ()):
        return "size"
    t = config._type_name(config._allowed_types(cls, name))
    return t.replace("integer or number", "number")


def doc_default(cls: type, name: str, cell: str) -> object:
    raw = cell.strip("`")
    value = yaml.safe_load(raw) if raw != '""' else ""
    if name in config._SIZE_KEYS.get(cls.__name__, ()) and isinstance(value, str):
        return config.parse_size(value)
    return value


@pytest.mark.parametrize("cls, heading", [(config.CacheConfig, "Top-level keys"),
                                          (config.MooncakeConfig, "`mooncake:` keys")])
def test_configuration_doc_lists_every_key_with_its_type_and_default(cls, heading):
    table = doc_tables(CONFIG_DOC.read_text())[heading]
    names = [f.name for f in fields(cls)]
    assert set(table) - set(names) == set(), f"docs/configuration.md documents keys that do not exist: {heading}"
    assert set(names) - set(table) == set(), f"docs/configuration.md lacks keys of {cls.__name__}"
    for f in fields(cls):
        row = table[f.name]
        assert row["type"] == expected_type(cls, f.name), f"{f.name}: type"
        assert f.default is not MISSING
        assert doc_default(cls, f.name, row["default"]) == f.default, f"{f.name}: default {row['default']}"
        assert len(row["meaning"]) > 20, f"{f.name}: say what it means"


def test_the_doc_table_reader_sees_a_wrong_default():
    text = CONFIG_DOC.read_text().replace("| `chunk_size` | integer | `256` |", "| `chunk_size` | integer | `128` |")
    row = doc_tables(text)["Top-level keys"]["chunk_size"]
    assert doc_default(config.CacheConfig, "chunk_size", row["default"]) != 256


def test_every_doc_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    assert [d for d in USER_DOCS if f"docs/{d}" not in readme] == []


def test_files_the_docs_name_exist():
    pattern = re.compile(r"(?<![\w/.])((?:docs|examples|configs|scripts|benchmarks)/[\w./-]*\w)")
    missing = []
    for doc in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        for path in pattern.findall(doc.read_text()):
            if "<" in path or "*" in path or path.startswith("benchmarks/results"):  # placeholders, outputs
                continue
            if not (REPO / path).exists():
                missing.append(f"{doc.name}: {path}")
    assert missing == []


def cheap_commands() -> list[tuple[str, str]]:
    """(doc, command) for every ``lmcache-mooncake ... --help`` and ``check-config`` line in a
    bash block of the README and docs."""
    out = []
    for doc in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                cmd = line.split(" #")[0].strip()
                if "lmcache-mooncake" in cmd and ("--help" in cmd or " check-config " in cmd):
                    out.append((doc.name, cmd))
    return out


def test_docs_show_cheap_commands():
    assert len(cheap_commands()) >= 4


@pytest.mark.parametrize("doc, command", cheap_commands())
def test_cheap_doc_command_runs_as_written(doc, command):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    argv = shlex.split(command)
    if argv[0].endswith("lmcache-mooncake"):  # the console script of this checkout's code
        argv = [sys.executable, "-m", "lmcache_mooncake.cli", *argv[1:]]
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{doc}: {command}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"


# -- the figures of docs/performance.md (and the README's headline) come from benchmarks/report.py --


def _bench_report():
    """``benchmarks/report.py`` as a module (benchmarks/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_report", REPO / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_performance_tables_are_what_the_report_renders_from_the_committed_summary():
    import json

    report = _bench_report()
    summary = json.loads(report.SUMMARY.read_text())
    for doc in report.docs():
        text = doc.read_text()
        assert report.render_doc(text, summary, doc) == text, (
            f"{doc.name}: its tables differ from docs/performance.json; run .venv/bin/python benchmarks/report.py "
            "--render (or make bench), never edit a figure between the table markers")


def test_a_changed_figure_is_caught_in_the_summary_and_in_the_page():
    import json

    report = _bench_report()
    summary = json.loads(report.SUMMARY.read_text())
    text = report.PAGE.read_text()
    changed = json.loads(json.dumps(summary))
    changed["ttft"]["rows"]["shm"]["8193"][0] += 1
    assert report.render_doc(text, changed, report.PAGE) != text
    figure = f"| {report.num(report._ms(summary['ttft'], 'shm', 8193))} ("
    assert figure in text
    edited = text.replace(figure, "| 1 (", 1)
    assert report.render_doc(edited, summary, report.PAGE) != edited


def test_performance_page_is_at_most_250_lines():
    assert len((DOCS / "performance.md").read_text().splitlines()) <= 250


# -- every YAML key and command-line flag the docs show exists --------------------------------

#: What users read: the README, docs/ and the examples' pages.
READ_DOCS = [REPO / "README.md", *sorted(DOCS.glob("*.md")), *sorted((REPO / "examples").glob("*.md"))]
_SHELL_BLOCK = ("bash", "sh", "shell", "console")


def doc_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block."""
    return re.findall(r"^```([\w-]*)\n(.*?)^```", text, re.S | re.M)


def yaml_blocks() -> list[tuple[str, str]]:
    return [(doc.name, body) for doc in READ_DOCS for lang, body in doc_blocks(doc.read_text()) if lang == "yaml"]


def test_docs_show_yaml_configurations():
    assert len(yaml_blocks()) >= 2


@pytest.mark.parametrize("doc, body", yaml_blocks())
def test_yaml_block_is_a_configuration_that_loads(doc, body, tmp_path):
    # Every key of the block exists, with a value of its type: the block is what a user copies.
    path = tmp_path / "block.yaml"
    path.write_text(body)
    config.load_config(path, environ={})


def test_every_config_table_names_real_keys_with_their_defaults():
    """Tables whose first column is ``key`` (docs/configuration.md, docs/mooncake.md, ...): a
    section heading that names ``mooncake`` lists :class:`config.MooncakeConfig`'s keys."""
    seen = 0
    for doc in READ_DOCS:
        for heading, table in doc_tables(doc.read_text()).items():
            cls = config.MooncakeConfig if "mooncake" in heading.lower() else config.CacheConfig
            known = {f.name: f for f in fields(cls)}
            assert set(table) <= set(known), f"{doc.name}, {heading!r}: no such keys {sorted(set(table) - set(known))}"
            for name, row in table.items():
                seen += 1
                if "default" in row:
                    assert doc_default(cls, name, row["default"]) == known[name].default, (
                        f"{doc.name}, {heading!r}: {name} defaults to {known[name].default!r}, not {row['default']}")
    assert seen >= len(fields(config.CacheConfig)) + len(fields(config.MooncakeConfig))


def test_every_config_key_is_documented():
    text = CONFIG_DOC.read_text()
    for cls in (config.CacheConfig, config.MooncakeConfig):
        missing = [f.name for f in fields(cls) if f"| `{f.name}` |" not in text]
        assert not missing, f"docs/configuration.md lacks {cls.__name__} keys {missing}"


_COMMAND = re.compile(r"(?:^|[\s;&|(`'\"])(?:[\w./~$-]*/)?lmcache-mooncake((?:\s+[^\s|;&#`)'\"]+)*)")


def command_uses() -> list[tuple[str, list[str]]]:
    """``(doc, argv after lmcache-mooncake)`` for each command the docs show: in shell blocks,
    unlabelled blocks and inline code (for those two only when the word after it is a command,
    so a quoted log line is not taken for one)."""
    from lmcache_mooncake.cli import COMMANDS

    out = []
    for doc in READ_DOCS:
        text = doc.read_text()
        places = [(lang in _SHELL_BLOCK, body) for lang, body in doc_blocks(text) if lang in (*_SHELL_BLOCK, "")]
        places += [(False, span) for span in re.findall(r"`([^`\n]*lmcache-mooncake [^`\n]*)`", text)]
        for shell, body in places:
            for line in body.replace("\\\n", " ").splitlines():
                for m in _COMMAND.finditer(line.split(" #")[0]):
                    argv = m.group(1).split()
                    if argv and (shell or argv[0] in COMMANDS):
                        out.append((doc.name, argv))
    return out


def shown_flags(argv: list[str]) -> list[str]:
    """The ``--flags`` of an argv as the docs write it (``[--json]``, ``--set=K=V``); the value
    after ``--vllm-arg`` is vLLM's, not ours."""
    flags, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        m = re.match(r"[\[(]*(--[a-z][a-z0-9-]*)", token)
        if m:
            flags.append(m.group(1))
            skip = m.group(1) == "--vllm-arg" and "=" not in token
    return flags


def _options(parser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def _subparsers(parser) -> dict:
    import argparse

    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


_VLLM_FLAGS: set[str] = set()


def vllm_flags() -> set[str]:
    """The flags of vLLM's OpenAI server, where ``serve`` passes what it does not know."""
    if not _VLLM_FLAGS:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        _VLLM_FLAGS.update(_options(make_arg_parser(FlexibleArgumentParser())))
    return _VLLM_FLAGS


def test_docs_show_commands_with_flags():
    uses = command_uses()
    assert len(uses) >= 40 and sum(len(shown_flags(a)) for _, a in uses) >= 60


def test_every_flag_the_docs_show_exists():
    """Each ``lmcache-mooncake COMMAND [ACTION] --flag`` in the docs: the command (and the
    ``store`` action) exists, and so does each flag in that command's parser (built, not run);
    ``serve``'s other flags in vLLM's server."""
    from lmcache_mooncake.cli import COMMANDS, build_parser

    wrong = []
    parsers: dict[str, object] = {}
    for doc, argv in command_uses():
        if argv[0].startswith("-"):
            wrong += [f"{doc}: lmcache-mooncake {f}" for f in shown_flags(argv) if f not in ("--help", "--version")]
            continue
        if argv[0] not in COMMANDS:
            wrong.append(f"{doc}: no command {argv[0]!r} (lmcache-mooncake {' '.join(argv)})")
            continue
        if argv[0] not in parsers:
            parsers[argv[0]] = build_parser(argv[0])[1]
        parser, rest = parsers[argv[0]], argv[1:]
        actions = _subparsers(parser)
        if actions and rest and not rest[0].startswith("-"):
            if rest[0] not in actions:
                wrong.append(f"{doc}: no action {rest[0]!r} of {argv[0]}")
                continue
            parser = actions[rest[0]]
        known = _options(parser)
        for flag in shown_flags(rest):
            if flag in known or (argv[0] == "serve" and flag in vllm_flags()):
                continue
            wrong.append(f"{doc}: lmcache-mooncake {argv[0]} has no {flag} ({' '.join(argv)})")
    assert wrong == []


def test_the_flag_check_sees_a_flag_that_does_not_exist():
    from lmcache_mooncake.cli import build_parser

    argv = "proxy --prefill URL --decode URL --port 9000 [--hots 0.0.0.0]".split()
    assert shown_flags(argv) == ["--prefill", "--decode", "--port", "--hots"]
    assert "--hots" not in _options(build_parser("proxy")[1])
    assert shown_flags(["up", "--vllm-arg", "--dtype", "--port", "1"]) == ["--vllm-arg", "--port"]


def test_every_environment_variable_of_ours_is_documented():
    """Each ``LMCACHE_MOONCAKE_*`` name the package reads is in docs/configuration.md (the
    per-key overrides as the ``LMCACHE_MOONCAKE_<KEY>`` pattern)."""
    pkg = REPO / "lmcache_mooncake"
    names = {m for p in pkg.rglob("*.py") for m in re.findall(r"LMCACHE_MOONCAKE_[A-Z][A-Z_]*[A-Z]", p.read_text())}
    keys = {config.ENV_PREFIX + f.name.upper() for f in fields(config.CacheConfig)}
    text = CONFIG_DOC.read_text()
    assert "LMCACHE_MOONCAKE_<KEY>" in text
    assert len(names) >= 8 and sorted(n for n in names - keys if n not in text) == []
