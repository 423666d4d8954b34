"""What the CLI shows and writes besides the report: the demo's progress line, `--dump`'s drawings."""

import io
import os
import re
import sys

import laplace_passes
from laplace_passes.demo import train as demo
from laplace_passes.tools import dump
from laplace_passes.tools.cli import main
from tests.cli_models import two_layer_gla

# -- the demo's progress line ------------------------------------------------------------------


class Terminal(io.StringIO):
    """What a terminal shows of a line redrawn with carriage returns: the last drawing over the earlier ones."""

    def isatty(self):
        return True

    def screen(self) -> str:
        line = ""
        for drawing in self.getvalue().rstrip("\n").split("\r"):
            line = drawing + line[len(drawing):]
        return line


def test_progress_line_says_compiling_first_and_never_shows_stale_figures(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    progress = demo._progress_bar(3, 0, enabled=True)
    progress.set_postfix_str("compiling ...")
    assert "compiling" in terminal.screen()
    for tokens_per_s in (13_206.0, 3_266.0, 5.0):  # the figure gets shorter step by step
        progress.set_postfix_str(demo.progress_postfix(1.5, tokens_per_s), refresh=False)
        progress.update(1)
        progress.refresh()
        assert terminal.screen().endswith(f"tok/s {tokens_per_s:>9,.0f}"), terminal.screen()
    progress.close()
    drawings = [d for d in terminal.getvalue().split("\r") if "tok/s" in d]
    assert len({len(d.rstrip("\n")) for d in drawings}) == 1  # fixed widths: no drawing is shorter


# -- `inspect --dump`: drawing with Graphviz never fails the dump --------------------------------


def _fake_dot(bin_dir, slow_names: str) -> None:
    """A `dot` that writes an .svg at once, or hangs on files whose name contains `slow_names`."""
    script = bin_dir / "dot"
    script.write_text(
        "#!/bin/sh\n"  # called as: dot -Tsvg IN.dot -o OUT.svg
        f'case "$2" in *{slow_names}*) sleep 60 ;; esac\n'
        'echo "<svg/>" > "$4"\n'
    )
    script.chmod(0o755)


def test_dump_draws_small_graphs_and_names_the_ones_it_does_not(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_dot(bin_dir, slow_names="inference")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(dump, "SVG_TIMEOUT_S", 1.0)
    monkeypatch.setattr(dump, "MAX_SVG_NODES", 40)
    out = tmp_path / "graphs"
    assert main(["inspect", "tests.cli_models:two_layer_gla", "--target", "cpu", "--dump", str(out)]) == 0
    err = capsys.readouterr().err
    dots = {p.stem for p in out.glob("*.dot")}
    svgs = {p.stem for p in out.glob("*.svg")}
    assert svgs and dots > svgs  # every graph written as .dot; some drawn, some not
    for stem in dots - svgs:
        assert f"not drawn as .svg (the .dot is written): {stem}.dot: " in err
    assert any(s.startswith("inference") for s in dots) and not any(s.startswith("inference") for s in svgs)
    assert "dot took more than 1 s" in err and "nodes > 40" in err


def test_dump_without_graphviz_writes_every_dot_and_says_once_how_to_draw_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` here
    assert main(["inspect", "tests.cli_models:two_layer_gla", "--target", "cpu", "--dump", str(tmp_path / "g")]) == 0
    assert list((tmp_path / "g").glob("*.dot")) and not list((tmp_path / "g").glob("*.svg"))
    err = capsys.readouterr().err
    assert err.count("no .svg drawn: Graphviz's `dot` is not on PATH") == 1 and "apt-get install graphviz" in err
    assert (tmp_path / "g" / "report.txt").read_text().rstrip().endswith(f"dump: {dump.NO_GRAPHVIZ}")


def test_dump_notes_graphviz_missing_only_when_it_is(tmp_path, monkeypatch):
    fn, inputs = two_layer_gla()
    report = laplace_passes.inspect(fn, *inputs, target="cpu")
    monkeypatch.setattr(dump.shutil, "which", lambda name: None)
    assert dump.dump_report(report, tmp_path / "without").notes == [dump.NO_GRAPHVIZ]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_dot(bin_dir, slow_names="never")
    monkeypatch.setattr(dump.shutil, "which", lambda name: str(bin_dir / name))
    monkeypatch.setenv("PATH", str(bin_dir))
    drawn = dump.dump_report(report, tmp_path / "with")
    assert drawn.notes == [] and "Graphviz" not in (tmp_path / "with" / "report.txt").read_text()


# -- progress on stderr during the long waits --------------------------------------------------


def test_inspect_says_on_stderr_what_it_is_doing_as_it_goes(capsys):
    assert main(["inspect", "tests.cli_models:two_layer_gla", "--target", "cpu"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("inspect tests.cli_models:two_layer_gla: capturing and transforming") and \
        err[-1].startswith("done in ")
    progress = [line.strip() for line in err[1:-1]]
    assert progress[0] == "capturing the graphs of fn at inputs [1, 100, 2, 8], [1, 100, 2, 8], " \
        "[1, 100, 2, 8], [1, 100, 2, 8] ...", err
    # Each graph's passes, each said before and timed after, in the order they ran; the eager inner compiler is
    # instant and not said.
    assert [line.partition(":")[0] for line in progress[1:-1]] == ["dynamo_0"] * 2 + ["inference_0"] * 2
    assert progress[1:-1:2] == ["dynamo_0: the passes ...", "inference_0: the passes ..."]
    assert all(re.fullmatch(r"\w+: the passes: done in \d+\.\d s", line) for line in progress[2:-1:2]), progress
    assert re.fullmatch(r"capturing the graphs of fn .*: done in \d+\.\d s", progress[-1])


def test_drawing_stops_when_its_total_time_is_used_up(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_dot(bin_dir, slow_names="never")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(dump, "SVG_TOTAL_S", 0.0)
    fn, inputs = two_layer_gla()
    dumped = dump.dump_report(laplace_passes.inspect(fn, *inputs, target="cpu"), tmp_path / "g")
    assert not list((tmp_path / "g").glob("*.svg"))
    small = [reason for reason in dumped.not_drawn if "nodes >" not in reason]
    assert small and all(reason.endswith("the 0 s for drawing are used up") for reason in small)
