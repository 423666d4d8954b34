"""Write a report's graphs to a directory, for reading and diffing.

For every graph and every snapshot (its input, then after each pass):
    {graph}.{index}.{label}.py    the graph as readable Python (GraphModule.code)
    {graph}.{index}.{label}.dot   the graph for Graphviz (.svg beside it when `dot` is installed)
and per graph {graph}.diff, a unified diff of the input against the final code.
Plus report.txt and report.json. The directory is written whole or not at
all; a non-empty one is replaced only with `overwrite=True` (NOTE [output
directories] in `laplace_passes.files`).
"""

from __future__ import annotations

import difflib
import shutil
import subprocess
from pathlib import Path

import torch.fx

from laplace_passes.files import staged_directory
from laplace_passes.report import Report


def dump_report(report: Report, out_dir: str | Path, overwrite: bool = False) -> list[Path]:
    """Write everything into `out_dir`; return the paths written."""
    with staged_directory(out_dir, overwrite) as staging:
        written = _write_report(report, staging)
    return [Path(out_dir) / path.relative_to(staging) for path in written]


def _write_report(report: Report, out: Path) -> list[Path]:
    written = [_write(out / "report.txt", str(report) + "\n"), _write(out / "report.json", report.to_json(indent=2))]
    render_svg = shutil.which("dot") is not None
    for record in report.graphs:
        for index, (label, gm) in enumerate(record.snapshots):
            stem = f"{record.name}.{index}.{label}"
            written.append(_write(out / f"{stem}.py", gm.code))
            dot_path = _write(out / f"{stem}.dot", graph_to_dot(gm.graph, f"{record.name} {label}"))
            written.append(dot_path)
            if render_svg:
                written.append(_render_svg(dot_path))
        diff = difflib.unified_diff(
            record.before.code.splitlines(keepends=True),
            record.after.code.splitlines(keepends=True),
            fromfile=f"{record.name} (input)",
            tofile=f"{record.name} (after {', '.join(l for l, _ in record.snapshots[1:]) or 'no pass'})",
        )
        written.append(_write(out / f"{record.name}.diff", "".join(diff)))
    return written


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


def _render_svg(dot_path: Path) -> Path:
    svg_path = dot_path.with_suffix(".svg")
    subprocess.run(["dot", "-Tsvg", str(dot_path), "-o", str(svg_path)], check=True, timeout=120)
    return svg_path
