"""Output directories (`export_stablehlo`, `dump_report`, the CLI's --stablehlo and --dump):
checked before the work, written whole or not at all, never mixed with an earlier run's files; and the demo's
--checkpoint-dir, which a run adds to: checked before the first training step."""

import errno
import json
import os

import pytest
import torch
import torch.fx

import laplace_passes
from laplace_passes.tools import dump
from laplace_passes.tools.cli import main
from laplace_passes.tools.dump import dump_report
from laplace_passes.infra.files import OutputDirError, check_output_dir
from laplace_passes.driver import export


def small_report():
    report = laplace_passes.Report(target="cpu")
    report.new_graph("dynamo", torch.fx.symbolic_trace(lambda x: (x * 2).sin()))
    return report


def used_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale_0.mlir").write_text("from an earlier run")
    return out


def fail_if_called(*args, **kwargs):
    raise AssertionError("the work started before the destination was checked")


def test_dump_refuses_a_used_directory_and_replaces_it_whole_with_overwrite(tmp_path):
    out = used_dir(tmp_path)
    with pytest.raises(OutputDirError, match=r"out is not empty: .* overwrite=True \(--force\)"):
        dump_report(small_report(), out)
    assert [p.name for p in out.iterdir()] == ["stale_0.mlir"]
    written = dump_report(small_report(), out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written.written)
    assert not (out / "stale_0.mlir").exists() and (out / "dynamo_0.0.input.py").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing left beside it


def test_a_dump_failing_half_way_leaves_the_destination_as_it_was(tmp_path, monkeypatch):
    out = used_dir(tmp_path)

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(dump, "graph_to_dot", broken)  # after report.txt and the first .py are written
    with pytest.raises(OSError, match="disk full"):
        dump_report(small_report(), out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["stale_0.mlir"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the partial directory is gone


def test_export_refuses_a_used_directory_before_any_work(tmp_path, monkeypatch):
    out = used_dir(tmp_path)
    monkeypatch.setattr(export, "capture_graphs", fail_if_called)
    with pytest.raises(OutputDirError, match="is not empty"):
        laplace_passes.export_stablehlo(lambda x: x.sin(), torch.ones(3), out_dir=out)


def test_re_export_with_overwrite_leaves_only_the_files_the_manifest_lists(tmp_path):
    pytest.importorskip("torch_mlir")
    x = torch.ones(2, 3, requires_grad=True)
    first = laplace_passes.export_stablehlo(lambda x: (x * 2).sin(), x, target="cpu", out_dir=tmp_path / "hlo")
    assert [g["file"] for g in first.manifest["graphs"]] == ["forward_0.mlir", "backward_0.mlir"]
    with torch.no_grad():
        again = laplace_passes.export_stablehlo(lambda x: (x * 2).sin(), x, target="cpu", out_dir=tmp_path / "hlo",
                                                overwrite=True)
    listed = [g["file"] for g in again.manifest["graphs"]]
    assert listed == ["inference_0.mlir"]
    bytecode = [g["bytecode"] for g in again.manifest["graphs"]]
    assert sorted(p.name for p in (tmp_path / "hlo").iterdir()) == sorted([*listed, *bytecode, "manifest.json"])
    assert json.loads((tmp_path / "hlo" / "manifest.json").read_text()) == again.manifest


def test_export_refuses_a_meta_model_before_any_work(tmp_path, monkeypatch):
    pytest.importorskip("torch_mlir")
    monkeypatch.setattr(export, "capture_graphs", fail_if_called)
    model = torch.nn.Linear(3, 3, device="meta")
    with pytest.raises(ValueError, match=r"export_stablehlo: the model \(or an input\) lives on the meta device"):
        laplace_passes.export_stablehlo(model, torch.ones(2, 3), out_dir=tmp_path / "hlo")
    assert not (tmp_path / "hlo").exists()


@pytest.mark.parametrize("command", [["inspect", "tiny", "--dump"], ["export", "tiny", "--stablehlo"]])
@pytest.mark.parametrize("place,message", [
    ("a_file", "a_file: a file of that name is in the way"),
    ("a_file/sub", "cannot create the output directory {}/a_file/sub: {}/a_file is not a directory"),
])
def test_cli_checks_the_destination_first(command, place, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("mine")
    monkeypatch.setattr("laplace_passes.tools.cli.load_model", fail_if_called)
    assert main([*command, str(tmp_path / place)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(tmp_path, tmp_path) in err
    assert (tmp_path / "a_file").read_text() == "mine"


def test_cli_refuses_a_used_directory_without_force(tmp_path, monkeypatch, capsys):
    out = used_dir(tmp_path)
    monkeypatch.setattr("laplace_passes.tools.cli.load_model", fail_if_called)
    assert main(["inspect", "tiny", "--dump", str(out)]) == 2
    assert "is not empty: choose a new directory, or pass overwrite=True (--force)" in capsys.readouterr().err


def test_an_unwritable_parent_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr("laplace_passes.infra.files.os.access", lambda path, mode: False)  # tests may run as root
    with pytest.raises(OutputDirError, match=rf"{tmp_path} is not writable"):
        check_output_dir(tmp_path / "new")


def test_overwrite_never_replaces_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "inside").mkdir()
    monkeypatch.chdir(tmp_path / "inside")
    with pytest.raises(OutputDirError, match="it holds the current working directory"):
        check_output_dir(tmp_path, overwrite=True)
    with pytest.raises(OutputDirError, match="must be a path, got int"):
        check_output_dir(3)


def test_cli_a_write_failing_half_way_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    def broken(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("laplace_passes.inspect", lambda *args, **kwargs: small_report())
    monkeypatch.setattr(dump, "graph_to_dot", broken)
    assert main(["inspect", "tiny", "--seq-len", "8", "--dump", str(tmp_path / "graphs")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "laplace-passes inspect: error: [Errno 28] No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_a_place_where_no_directory_can_be_made_is_refused_first(monkeypatch, capsys):
    """/proc: writable by its permission bits for root, yet no directory can be made there."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc on this platform")
    monkeypatch.setattr("laplace_passes.tools.cli.load_model", fail_if_called)
    for command in (["inspect", "tiny", "--dump", "/proc/x"], ["export", "tiny", "--stablehlo", "/proc/x/y"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "cannot create the output directory /proc/x" in err, err
        assert "no directory can be made in /proc (" in err


def read_only_filesystem(*args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system")


# --- the demo's --checkpoint-dir: kept and added to (not replaced), checked before the first step -----------

@pytest.fixture
def no_training(monkeypatch):
    """The demo's work, at either world size, replaced by a failure: the checks must come first."""
    monkeypatch.setattr("laplace_passes.demo.train._train", fail_if_called)
    monkeypatch.setattr("laplace_passes.demo.train.launch_local", fail_if_called)


DEMO = ["demo", "--steps", "2", "--batch", "4", "--seq-len", "16", "--num-pairs", "2", "--no-progress"]


@pytest.mark.parametrize("world_size", ["1", "2"])
@pytest.mark.parametrize("place,message", [
    ("a_file", "cannot use {}/a_file as the checkpoint directory: a file of that name is in the way"),
    ("a_file/sub", "cannot create the checkpoint directory {}/a_file/sub: {}/a_file is not a directory"),
    ("read_only/new", "cannot create the checkpoint directory {}/read_only/new: no directory can be made in "
                      "{}/read_only (Read-only file system)"),
    ("read_only", "cannot write into the checkpoint directory {}/read_only: no directory can be made in "
                  "{}/read_only (Read-only file system)"),
])
def test_demo_checks_the_checkpoint_directory_before_training(world_size, place, message, tmp_path, monkeypatch,
                                                              capsys, no_training):
    (tmp_path / "a_file").write_text("mine")
    (tmp_path / "read_only").mkdir()
    if place.startswith("read_only"):  # a read-only mount, which root cannot write either
        monkeypatch.setattr("laplace_passes.infra.files.tempfile.mkdtemp", read_only_filesystem)
    assert main([*DEMO, "--world-size", world_size, "--checkpoint-dir", str(tmp_path / place)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("laplace-passes demo: error: ")
    assert message.format(tmp_path, tmp_path) in err
    assert (tmp_path / "a_file").read_text() == "mine" and list((tmp_path / "read_only").iterdir()) == []


def test_demo_names_an_unwritable_checkpoint_parent(tmp_path, monkeypatch, capsys, no_training):
    monkeypatch.setattr("laplace_passes.infra.files.os.access", lambda path, mode: False)  # tests may run as root
    assert main([*DEMO, "--checkpoint-dir", str(tmp_path / "new")]) == 2
    assert f"cannot create the checkpoint directory {tmp_path}/new: {tmp_path} is not writable" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
