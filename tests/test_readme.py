"""README.md and the docs pages checked by running them: their code blocks, the API table and the model-zoo table.

Every fenced python block and every indented block of `laplace-passes` lines
carries a marker saying how it is checked (tests/readme_blocks.py; the
convention is in tests/README.md). Every `laplace-passes` line, run or not,
is parsed by the CLI's own argument parser.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import model_zoo
from laplace_passes.tools.cli import _parser, available_benchmarks, main
from tests import processes
from tests.readme_blocks import PAGES, README, ROOT, all_blocks, dangling_markers

BLOCKS = all_blocks()


def test_every_block_is_marked():
    unmarked = [b.id for b in BLOCKS if b.marker is None]
    assert not unmarked, (
        f"code blocks without a readme-test marker: {unmarked}; put `<!-- readme-test: run -->` (or "
        "`<!-- readme-test: skip: reason -->`) on the line before each (tests/README.md)"
    )
    for page in PAGES:
        assert dangling_markers(page) == [], f"{page.name}: markers must sit on the line right before their block"
    assert any(b.kind == "python" for b in BLOCKS) and any(b.kind == "shell" for b in BLOCKS)


def _params(blocks, kind):
    """One pytest param per block of `kind`; skipped blocks show their marker's reason."""
    return [
        pytest.param(b, id=b.id, marks=[pytest.mark.skip(reason=b.marker.reason)] if b.marker.action == "skip" else [])
        for b in blocks
        if b.kind == kind and b.marker is not None
    ]


COMMANDS = [pytest.param(argv, id=f"{b.id}:{' '.join(argv[:2])}") for b in BLOCKS if b.kind == "shell"
            for argv in b.cli_commands()]


@pytest.mark.parametrize("argv", COMMANDS)
def test_every_cli_line_parses(argv):
    try:
        args = _parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"the CLI rejects the README's `laplace-passes {' '.join(argv)}`")
    if args.command == "bench":
        assert args.name in available_benchmarks()
    elif getattr(args, "passes", False):
        assert args.model is None
    elif ":" not in args.model:
        assert args.model in model_zoo.CONFIG_NAMES


def shrunk(argv: list[str], shrink: list[str]) -> list[str]:
    """`argv` with each option of `shrink` set to its value, where the subcommand has that option."""
    subcommands = next(a for a in _parser()._actions if a.dest == "command").choices
    accepted = subcommands[argv[0]]._option_string_actions
    argv = list(argv)
    for option, value in zip(shrink[::2], shrink[1::2]):
        if option not in accepted:
            continue
        if option in argv:
            argv[argv.index(option) + 1] = value
        else:
            argv += [option, value]
    return argv


@pytest.mark.parametrize("block", _params(BLOCKS, "shell"))
def test_shell_block_runs(block, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # graphs/, hlo/ ... land here
    for env, argv in block.cli_runs():
        argv = shrunk(argv, block.marker.shrink)
        if env:
            run_with_environment(env, argv, tmp_path)
        else:
            assert main(argv) == 0, f"laplace-passes {' '.join(argv)}: {capsys.readouterr().err[-2000:]}"


def run_with_environment(env: dict[str, str], argv: list[str], cwd) -> None:
    """A command with variables torch reads at import (TORCH_LOGS, TORCH_TRACE): a fresh process, as typed.

    What each variable promises is checked: TORCH_LOGS="laplace" logs the passes,
    TORCH_TRACE writes a trace into its directory.
    """
    cli = "import sys; from laplace_passes.tools.cli import main; sys.exit(main(sys.argv[1:]))"
    environment = {**os.environ, **env, "PYTHONPATH": str(README.parent)}
    done = processes.run([sys.executable, "-c", cli, *argv], timeout=600, cwd=cwd, env=environment)
    command = f"{' '.join(f'{k}={v}' for k, v in env.items())} laplace-passes {' '.join(argv)}"
    assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
    if "laplace" in env.get("TORCH_LOGS", ""):
        assert "retile_gla on " in done.stderr, f"{command} logged no pass: {done.stderr[-2000:]}"
    if "TORCH_TRACE" in env:
        assert any(Path(cwd, env["TORCH_TRACE"]).iterdir()), f"{command} wrote no trace"


@pytest.mark.parametrize("block", _params(BLOCKS, "python"))
def test_python_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = block.marker.setup + "\n" + block.python_source()
    try:
        exec(compile(source, block.id, "exec"), {"__name__": "readme_block"})  # noqa: S102
    finally:
        # A block's compiles count towards Dynamo's recompile limit on shared code (fla's layers): a later
        # test of the same code would run it uncompiled.
        torch._dynamo.reset()


# -- the tables ----------------------------------------------------------------------------------


def _table_rows(section: str, page: str) -> list[list[str]]:
    """The cells of the first table under the `## section` heading of `page`."""
    text = (ROOT / page).read_text()
    body = text[text.index(f"## {section}\n"):]
    body = body[: body.index("\n## ", 1)] if "\n## " in body[1:] else body
    rows = [line for line in body.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[2:]]


def _resolve(dotted: str):
    """The object a dotted name names: attributes first (a package's function over its same-named module)."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, name in enumerate(parts[1:], start=2):
        obj = getattr(obj, name) if hasattr(obj, name) else importlib.import_module(".".join(parts[:i]))
    return obj


SIGNATURE_CELL = re.compile(r"^`(?P<name>(laplace_passes|model_zoo)\.[\w.]+)\((?P<params>.*)\)( -> \w+)?`$")
DOCUMENTED_CALLS = [m for row in _table_rows("Public API", "docs/api.md") if (m := SIGNATURE_CELL.match(row[0]))]


@pytest.mark.parametrize("row", DOCUMENTED_CALLS, ids=[m["name"] for m in DOCUMENTED_CALLS])
def test_api_table_signatures_match_the_code(row):
    """Names, order, kinds and defaults; a documented default of `...` only says there is one."""
    documented = ast.parse(f"def f({row['params']}): pass").body[0].args
    actual = inspect.signature(_resolve(row["name"]))
    kinds = inspect.Parameter
    expected = [(a.arg, kinds.POSITIONAL_OR_KEYWORD) for a in documented.args]
    expected += [(documented.vararg.arg, kinds.VAR_POSITIONAL)] if documented.vararg else []
    expected += [(a.arg, kinds.KEYWORD_ONLY) for a in documented.kwonlyargs]
    expected += [(documented.kwarg.arg, kinds.VAR_KEYWORD)] if documented.kwarg else []
    assert [(p.name, p.kind) for p in actual.parameters.values()] == expected
    positional_defaults = [None] * (len(documented.args) - len(documented.defaults)) + documented.defaults
    defaults = dict(zip([a.arg for a in documented.args], positional_defaults))
    defaults |= dict(zip([a.arg for a in documented.kwonlyargs], documented.kw_defaults))
    for name, node in defaults.items():
        has_default = actual.parameters[name].default is not inspect.Parameter.empty
        assert has_default == (node is not None), f"{name}: default documented {node is not None}, in code {has_default}"
        if node is not None and not (isinstance(node, ast.Constant) and node.value is Ellipsis):
            assert actual.parameters[name].default == ast.literal_eval(node), name


def _cache_bytes(name: str) -> int:
    """Bytes of everything fla's cache keeps for one sequence after a short forward through the laplace backend
    (the recurrent states, and RWKV6's token-shift and LightNet's normaliser states beside them)."""
    import laplace_passes

    laplace_passes.fla.install(import_fla=True)
    torch.manual_seed(0)
    model = model_zoo.build(name).eval()
    with torch.no_grad():
        out = torch.compile(model, backend="laplace", options={"target": "cpu"})(
            input_ids=torch.zeros(1, 2, dtype=torch.long), use_cache=True)
    total = 0
    for layer in out.past_key_values.layers:
        for value in layer.state.values():
            for t in value if isinstance(value, (list, tuple)) else [value]:
                total += t.numel() * t.element_size() if torch.is_tensor(t) else 0
    return total


def _state_bytes(model) -> int:
    """fp32 recurrent state per sequence, from the config: layers x heads x K x V x 4."""
    c = model.config
    layers = getattr(c, "num_layers", None) or c.num_hidden_layers
    key_dim, value_dim = int(c.hidden_size * c.expand_k), int(c.hidden_size * c.expand_v)
    return layers * c.num_heads * (key_dim // c.num_heads) * (value_dim // c.num_heads) * 4


def _as_written(value: int, written: str) -> str:
    """`value` in the unit and precision of `written` ("142,784", "5.5 M", "2.94 B", "8 KiB", "29.5 MB")."""
    number, _, unit = written.partition(" ")
    scale = {"": 1, "M": 1e6, "B": 1e9, "KiB": 1024, "MB": 1e6}[unit]
    decimals = len(number.partition(".")[2])
    text = f"{value / scale:,.{decimals}f}" if unit else f"{value:,}"
    return f"{text} {unit}".strip()


@pytest.mark.parametrize("row", _table_rows("Model zoo", "docs/model_zoo.md"), ids=lambda row: row[0].split("`")[1])
def test_model_zoo_table_matches_the_models(row):
    name = row[0].split("`")[1]
    if name.startswith("fla-"):
        pytest.importorskip("fla")
    model = model_zoo.build(name, device="meta")
    parameters = sum(p.numel() for p in model.parameters())  # tied weights once
    state = _state_bytes(model) if name in GLA_STATE else _cache_bytes(name)
    assert (_as_written(parameters, row[1]), _as_written(state, row[2])) == (row[1], row[2])


# The models whose state is GLA's [layers, heads, K, V] in fp32, read off the config (some on the meta device).
GLA_STATE = {"tiny", "plain-tiny", "small", "laplace-3b", "fla-gla-tiny", "fla-gla-1.3b"}


def test_ci_runs_the_readme_test_command():
    """`.ci/run` runs the README's test command, word for word (CI checks what a user would run)."""
    readme_commands = [line.strip() for line in README.read_text().splitlines() if 'pip install -e ".[test]"' in line]
    ci_lines = (README.parent / ".ci" / "run").read_text().splitlines()
    assert len(readme_commands) == 1, readme_commands
    assert readme_commands[0] in [line.strip() for line in ci_lines]
