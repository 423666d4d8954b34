"""Write a report's graphs to a directory, for reading and diffing.

For every graph and every snapshot (its input, then after each pass):
    {graph}.{index}.{label}.py    the graph as readable Python (GraphModule.code)
    {graph}.{index}.{label}.dot   the graph for Graphviz
    {graph}.{index}.{label}.svg   its drawing, when Graphviz's `dot` is installed and the graph is small
and per graph {graph}.diff, a unified diff of the input against the final code.
Plus report.txt and report.json. Without `dot` nothing is drawn, and
`Dumped.notes` and report.txt say so, with how to install it. The directory is written whole or not at
all; a non-empty one is replaced only with `overwrite=True` (NOTE [output
directories] in `laplace_passes.infra.files`).

Drawing is best effort and never fails the dump: dot's layout time grows
much faster than the graph (the tiny model's unrolled forward at T = 2048,
1,514 lines of .dot, was still being laid out after 500 s), so graphs over
`MAX_SVG_NODES` nodes are not drawn, one drawing is stopped after
`SVG_TIMEOUT_S` seconds and all of them after `SVG_TOTAL_S`, and each graph
left undrawn is named, with the reason, in `Dumped.not_drawn` (the CLI
prints them). The .dot is always written: `dot -Tsvg FILE.dot -o FILE.svg`
draws it when you can wait.
"""

from __future__ import annotations

import difflib
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.fx

from laplace_passes.infra.files import staged_directory
from laplace_passes.infra.report import Report


NO_GRAPHVIZ = ("no .svg drawn: Graphviz's `dot` is not on PATH (install Graphviz: apt-get install graphviz, "
               "brew install graphviz or conda install -c conda-forge graphviz; then `dot -Tsvg FILE.dot -o FILE.svg`)")
MAX_SVG_NODES = 300
SVG_TIMEOUT_S = 20.0
SVG_TOTAL_S = 60.0


@dataclass
class Dumped:
    """What `dump_report` wrote, the graphs it did not draw as .svg (with the reason), and what the reader must
    know about the whole dump (no Graphviz)."""

    written: list[Path] = field(default_factory=list)
    not_drawn: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    drawing_deadline: float = field(default_factory=lambda: time.monotonic() + SVG_TOTAL_S, repr=False)


def dump_report(report: Report, out_dir: str | Path, overwrite: bool = False) -> Dumped:
    """Write everything into `out_dir`; return the paths written and the drawings skipped."""
    with staged_directory(out_dir, overwrite) as staging:
        dumped = _write_report(report, staging)
    dumped.written = [Path(out_dir) / path.relative_to(staging) for path in dumped.written]
    return dumped


def _write_report(report: Report, out: Path) -> Dumped:
    draw = shutil.which("dot") is not None
    notes = [] if draw else [NO_GRAPHVIZ]
    text = "\n".join([str(report), *(f"dump: {note}" for note in notes)]) + "\n"
    dumped = Dumped([_write(out / "report.txt", text), _write(out / "report.json", report.to_json(indent=2))],
                    notes=notes)
    for record in report.graphs:
        for index, (label, gm) in enumerate(record.snapshots):
            stem = f"{record.name}.{index}.{label}"
            dumped.written.append(_write(out / f"{stem}.py", gm.code))
            dot_path = _write(out / f"{stem}.dot", graph_to_dot(gm.graph, f"{record.name} {label}"))
            dumped.written.append(dot_path)
            if draw:
                _draw_svg(dot_path, len(gm.graph.nodes), dumped)
        diff = difflib.unified_diff(
            record.before.code.splitlines(keepends=True),
            record.after.code.splitlines(keepends=True),
            fromfile=f"{record.name} (input)",
            tofile=f"{record.name} (after {', '.join(l for l, _ in record.snapshots[1:]) or 'no pass'})",
        )
        dumped.written.append(_write(out / f"{record.name}.diff", "".join(diff)))
    return dumped


def graph_to_dot(graph: torch.fx.Graph, title: str) -> str:
    """Graphviz text: one box per node (name and op), one edge per use."""
    lines = [f"digraph {_quote(title)} {{", "  node [shape=box, fontname=monospace];"]
    for node in graph.nodes:
        lines.append(f"  {_quote(node.name)} [label={_quote(_node_label(node))}];")
    for node in graph.nodes:
        for user in node.users:
            lines.append(f"  {_quote(node.name)} -> {_quote(user.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _node_label(node: torch.fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return f"{node.name}\\n{node.op}"
    target = getattr(node.target, "__name__", str(node.target))
    return f"{node.name}\\n{target}"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\\\\n", "\\n") + '"'


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _draw_svg(dot_path: Path, nodes: int, dumped: Dumped) -> None:
    """Draw `dot_path` as .svg beside it when it is small enough and dot finishes in time; else say why not."""
    if nodes > MAX_SVG_NODES:
        dumped.not_drawn.append(f"{dot_path.name}: {nodes} nodes > {MAX_SVG_NODES}")
        return
    timeout = min(SVG_TIMEOUT_S, dumped.drawing_deadline - time.monotonic())
    if timeout <= 0:
        dumped.not_drawn.append(f"{dot_path.name}: the {SVG_TOTAL_S:g} s for drawing are used up")
        return
    svg_path = dot_path.with_suffix(".svg")
    try:
        subprocess.run(["dot", "-Tsvg", str(dot_path), "-o", str(svg_path)], check=True, timeout=timeout,
                       capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        dumped.not_drawn.append(f"{dot_path.name}: dot took more than {timeout:.0f} s")
    except (subprocess.CalledProcessError, OSError) as error:
        detail = getattr(error, "stderr", None) or str(error)
        dumped.not_drawn.append(f"{dot_path.name}: dot failed ({detail.strip()})")
    else:
        dumped.written.append(svg_path)
        return
    svg_path.unlink(missing_ok=True)  # a partial drawing is not a drawing
