"""The code blocks of README.md and the docs pages, and the markers that say how tests/test_readme.py checks them.

A marker is an HTML comment (invisible on GitHub) on the line before a block:

    <!-- readme-test: run -->
    <!-- readme-test: run | setup: ids = torch.randint(0, 128, (1, 64)) | replace: 2048 -> 64 -->
    <!-- readme-test: run | shrink: --seq-len 64 --steps 2 -->
    <!-- readme-test: skip: why, and which test checks it instead -->

Blocks: fenced ```python blocks, and indented (4-space) blocks holding a
`laplace-passes` command. Every such block needs a marker (tests/README.md).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The user's pages: the README and the docs it sends readers on to (docs/DESIGN.md explains the code, and
# its blocks are sketches, not commands).
PAGES = [ROOT / page for page in (
    "README.md", "docs/usage.md", "docs/api.md", "docs/passes.md", "docs/fla.md", "docs/lowering.md",
    "docs/model_zoo.md", "docs/benchmarks.md")]
MARKER = re.compile(r"^<!-- readme-test: (?P<body>.*) -->$")
CLI = "laplace-passes"


@dataclass
class Marker:
    action: str  # "run" or "skip"
    reason: str = ""  # why a block is skipped
    setup: str = ""  # Python run before the block
    replace: list[tuple[str, str]] = field(default_factory=list)  # text substitutions in the block
    shrink: list[str] = field(default_factory=list)  # CLI options set on every command of a shell block


@dataclass
class Block:
    kind: str  # "python" or "shell"
    line: int  # 1-based line of the block's first code line in its page
    text: str
    marker: Marker | None
    page: str = "README.md"  # the page's path from the repository root

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def cli_commands(self) -> list[list[str]]:
        """The argument lists of the `laplace-passes` commands in a shell block (`cli_runs` without the env)."""
        return [argv for _, argv in self.cli_runs()]

    def cli_runs(self) -> list[tuple[dict[str, str], list[str]]]:
        """Each `laplace-passes` command of a shell block: the variables set before it, and its arguments.

        `&&` chains are split, `\\`-continued lines joined, and a command run
        by a launcher (`torchrun ... --no-python laplace-passes demo ...`)
        counts from the `laplace-passes` word on. `NAME=value` words that
        start a command (`TORCH_LOGS="laplace" laplace-passes ...`) are its
        environment.
        """
        runs = []
        for line in self.text.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            segments, current = [], []
            for word in words + ["&&"]:
                if word == "&&":
                    segments.append(current)
                    current = []
                else:
                    current.append(word)
            for seg in segments:
                starts = [i for i, word in enumerate(seg) if Path(word).name == CLI]
                if starts:
                    runs.append((_leading_assignments(seg[:starts[0]]), seg[starts[0] + 1:]))
        return runs

    def python_source(self) -> str:
        text = self.text
        for old, new in self.marker.replace:
            if old not in text:
                raise ValueError(f"{self.id}: marker replaces {old!r}, which the block does not contain")
            text = text.replace(old, new)
        return text


ASSIGNMENT = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>.*)$")


def _leading_assignments(words: list[str]) -> dict[str, str]:
    """The `NAME=value` words a command starts with (a launcher's words end them)."""
    env = {}
    for word in words:
        found = ASSIGNMENT.match(word)
        if not found:
            break
        env[found["name"]] = found["value"]
    return env


def parse_marker(body: str) -> Marker:
    if body.startswith("skip:"):
        reason = body.removeprefix("skip:").strip()
        if not reason:
            raise ValueError("a skip marker must give its reason: <!-- readme-test: skip: why -->")
        return Marker("skip", reason=reason)
    action, *parts = [p.strip() for p in body.split(" | ")]
    if action != "run":
        raise ValueError(f"unknown readme-test action {action!r}: use 'run' or 'skip: reason'")
    marker = Marker("run")
    for part in parts:
        key, _, value = part.partition(":")
        value = value.strip()
        if key == "setup":
            marker.setup = value
        elif key == "replace":
            old, arrow, new = value.partition(" -> ")
            if not arrow:
                raise ValueError(f"replace needs 'OLD -> NEW', got {value!r}")
            marker.replace.append((old, new))
        elif key == "shrink":
            marker.shrink = shlex.split(value)
        else:
            raise ValueError(f"unknown readme-test part {key!r}: use setup, replace or shrink")
    return marker


def all_blocks() -> list[Block]:
    """The blocks of every page in `PAGES`."""
    return [block for page in PAGES for block in readme_blocks(page)]


def readme_blocks(path: Path = README) -> list[Block]:
    """Every fenced python block and every indented block that runs `laplace-passes`, with its marker."""
    lines = path.read_text().splitlines()
    page = path.relative_to(ROOT).as_posix()
    blocks: list[Block] = []
    marker, i = None, 0
    while i < len(lines):
        line = lines[i]
        found = MARKER.match(line)
        if found:
            marker = parse_marker(found["body"])
            i += 1
            continue
        if line.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if line.strip() == "```python":
                blocks.append(Block("python", i + 2, "\n".join(lines[i + 1:end]) + "\n", marker, page))
            marker, i = None, end + 1
            continue
        if line.startswith("    ") and (i == 0 or not lines[i - 1].strip() or MARKER.match(lines[i - 1])):
            end = i
            while end < len(lines) and lines[end].startswith("    "):
                end += 1
            block = Block("shell", i + 1, "\n".join(l[4:] for l in lines[i:end]) + "\n", marker, page)
            if block.cli_commands():
                blocks.append(block)
            marker, i = None, end
            continue
        marker = None  # a marker applies only to a block on the very next line
        i += 1
    return blocks


def dangling_markers(path: Path = README) -> list[int]:
    """Lines of markers not followed by a block they apply to."""
    lines = path.read_text().splitlines()
    starts = {b.line for b in readme_blocks(path)}
    dangling = []
    for i, line in enumerate(lines):
        if MARKER.match(line):
            next_code = i + 2 if i + 1 < len(lines) and not lines[i + 1].startswith("```") else i + 3
            if next_code not in starts:
                dangling.append(i + 1)
    return dangling
