"""Output directories (`export_stablehlo`, `dump_report`, the CLI's --stablehlo and --dump):
checked before the work, written whole or not at all, never mixed with an earlier run's files."""

import json

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
