"""`laplace-passes demo` across processes: torchrun (one node, two nodes), checkpoints, restarts.

One small training (6 steps, T = 16, global batch 12) is the reference, run
in this process at W = 1 with a checkpoint every 2 steps. Every other run is
torchrun as the README writes it (but the last leg of the resume chain,
`demo --world-size 4` run from this process), and must give the reference's
per-step losses (relative difference <= 1e-3: the ranks' gradients are
summed in another order). Each run prints its JSON result once (rank 0).
Each torchrun start costs seconds of imports and compiling per process, so
the runs are few and chained: one checkpoint directory carries
W = 1 -> 2 -> 4, and the W = 4 leg is also the README's `demo --world-size 4`
(ShardedMuon's step rewritten to all-to-alls).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from laplace_passes.demo import checkpoint as demo_checkpoint
from laplace_passes.tools.cli import main
from laplace_passes.demo.train import DemoConfig, run_demo
from laplace_passes.demo.distributed import LaunchError, launch_local
from tests import processes
from tests._dist import free_port

BIN = Path(sys.executable).parent
TESTS = Path(__file__).resolve().parent
SMALL = ["--batch", "12", "--seq-len", "16", "--num-pairs", "2", "--no-progress", "--json"]
RUN_TIMEOUT = 300


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(losses of steps 1..6 at W = 1, its checkpoint directory with steps 2, 4, 6)."""
    directory = tmp_path_factory.mktemp("reference")
    config = DemoConfig(steps=6, batch=12, seq_len=16, num_pairs=2, progress=False,
                        checkpoint_dir=str(directory), checkpoint_every=2)
    return run_demo(config).losses, directory


def torchrun(*args: str, env: dict | None = None) -> subprocess.Popen:
    environment = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
                   **(env or {})}
    return processes.start([str(BIN / "torchrun"), *args], env=environment)


def result_of(process: subprocess.Popen) -> dict:
    """The one JSON result the run printed (rank 0), after checking it printed exactly one."""
    out, err = processes.communicate(process, RUN_TIMEOUT)
    assert process.returncode == 0, err[-4000:]
    assert out.count('"losses"') == 1, f"the result must be printed once:\n{out[:2000]}"
    return json.loads(out)


def assert_close(losses, expected):
    assert len(losses) == len(expected)
    for step, (got, want) in enumerate(zip(losses, expected), start=1):
        assert abs(got - want) <= 1e-3 * abs(want), f"step {step}: {got} vs {want} (all: {losses} vs {expected})"


def copy_checkpoint(source: Path, step: int, destination: Path) -> None:
    name = f"step_{step:08d}"
    shutil.copytree(source / name, destination / name)


def test_resume_across_world_sizes_and_a_killed_rank(reference, tmp_path, capsys):
    """W = 1's checkpoint at step 2 resumed by torchrun at W = 2, whose rank 1 is SIGKILLed at step 4
    (--max-restarts 1, a checkpoint every step): the restarted ranks resume from step 3. Then
    `demo --world-size 4` (launched from this process: the ranks fork from a server that has imported
    torch, seconds faster than torchrun's fresh interpreters) resumes from W = 2's checkpoint at step 4.
    Every step's loss is the uninterrupted reference's: each rank trains its own rows of the global batch."""
    losses, saved = reference
    copy_checkpoint(saved, 2, tmp_path)
    run = torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                   str(TESTS / "demo_rank_killer.py"), "2", "demo", *SMALL, "--steps", "4",
                   "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1",
                   env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    two = result_of(run)
    assert (two["world_size"], two["resumed_from"]) == (2, 3)  # the restarted attempt's result
    assert_close(two["losses"], losses[:4])
    assert main(["demo", *SMALL, "--steps", "6", "--world-size", "4", "--checkpoint-dir", str(tmp_path)]) == 0
    four = json.loads(capsys.readouterr().out)
    assert (four["world_size"], four["resumed_from"]) == (4, 4)
    assert_close(four["losses"], losses)
    assert_muon_step_rewritten(four, world_size=4)


def assert_muon_step_rewritten(result: dict, world_size: int) -> None:
    """ShardedMuon's step went through the laplace backend: its gather became two all-to-alls."""
    (traffic,) = [g["traffic"] for g in result["report_dict"]["muon_step"]["graphs"] if g["traffic"] is not None]
    assert traffic["world_size"] == world_size
    assert [c["op"] for c in traffic["before"]] == ["all_gather_into_tensor"]
    assert [c["op"] for c in traffic["after"]] == ["all_to_all_single", "all_to_all_single"]
    assert traffic["lower_bound_bytes"] <= traffic["received_after"] < traffic["received_before"]
    assert traffic["received_ratio"] == pytest.approx(traffic["received_before"] / traffic["received_after"])
    assert traffic["ns_flops_after"] < traffic["ns_flops_before"]
    assert result["muon_received_ratio"] == traffic["received_ratio"]


def test_two_nodes_over_a_loopback_rendezvous(reference):
    """Two torchrun agents ("nodes") of one process each, c10d rendezvous on 127.0.0.1."""
    losses, _ = reference
    node = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "demo-test", "--local-addr", "127.0.0.1",
            "--rdzv-conf", "join_timeout=120", "--no-python", "laplace-passes", "demo", *SMALL, "--steps", "2"]
    nodes = [torchrun(*node), torchrun(*node)]
    outputs = [processes.communicate(node, RUN_TIMEOUT) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outputs]
    printed = [json.loads(out) for out, _ in outputs if out.strip()]
    assert len(printed) == 1, [out[:500] for out, _ in outputs]  # rank 0's node only
    assert printed[0]["world_size"] == 2
    assert_close(printed[0]["losses"], losses[:2])


def test_a_checkpoint_of_other_settings_is_refused(reference, tmp_path):
    """README: a run refuses a checkpoint written with other settings (here the seed), naming them."""
    _, saved = reference
    copy_checkpoint(saved, 2, tmp_path)
    config = DemoConfig(steps=6, batch=12, seq_len=16, num_pairs=2, seed=1, progress=False, checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"from a different run \(seed 0 there, 1 here\)"):
        run_demo(config)


@pytest.fixture
def no_training(monkeypatch):
    """Building the model (before its state is loaded) and launching ranks fail: the checks must come first."""
    def fail_if_called(*args, **kwargs):
        raise AssertionError("the run went past the checkpoint's checks")

    monkeypatch.setattr("laplace_passes.demo.train._build", fail_if_called)
    monkeypatch.setattr("laplace_passes.demo.train.launch_local", fail_if_called)


def refusal(args, capsys) -> str:
    """The one line `demo ARGS` refuses with (exit status 2)."""
    assert main(["demo", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("laplace-passes demo: error: "), err
    return err


@pytest.mark.parametrize("world_size", ["1", "4"])
def test_resuming_with_another_model_names_both_before_loading(reference, tmp_path, capsys, no_training, world_size):
    _, saved = reference
    copy_checkpoint(saved, 2, tmp_path)
    err = refusal([*SMALL, "--steps", "6", "--model", "plain-tiny", "--world-size", world_size,
                   "--checkpoint-dir", str(tmp_path)], capsys)
    assert f"the checkpoint {tmp_path}/step_00000002 is from a different run (model 'tiny' there, 'plain-tiny' " \
           "here); use another --checkpoint-dir or the same settings" in err


def test_the_settings_are_compared_before_any_state_is_loaded(reference, tmp_path):
    """A template of another model's keys: the settings are refused, not the first key the checkpoint lacks."""
    _, saved = reference
    copy_checkpoint(saved, 2, tmp_path)
    config = DemoConfig(model="fla-gla-tiny", steps=6, batch=12, seq_len=16, num_pairs=2)
    settings = {name: getattr(config, name) for name in demo_checkpoint.RUN_SETTINGS}
    template = {"model": {"not.in.the.checkpoint": torch.zeros(1)}, "settings": ""}
    with pytest.raises(demo_checkpoint.CheckpointError, match=r"model 'tiny' there, 'fla-gla-tiny' here"):
        demo_checkpoint.load(str(tmp_path), 2, template, settings)
    assert template["settings"] == ""  # nothing was loaded into it


def damage_data_file(step: Path) -> str:
    (data,) = step.glob("*.distcp")
    size = data.stat().st_size
    with open(data, "r+b") as file:
        file.truncate(size // 2)
    return f"the checkpoint's data file {data} is truncated ({size // 2:,} of {size:,} bytes)"


def damage_metadata(step: Path) -> str:
    metadata = step / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])
    return f"the checkpoint's {metadata} is damaged ("


@pytest.mark.parametrize("damage", [damage_data_file, damage_metadata])
def test_a_damaged_checkpoint_names_its_file(reference, tmp_path, capsys, no_training, damage):
    _, saved = reference
    copy_checkpoint(saved, 2, tmp_path)
    message = damage(tmp_path / "step_00000002")
    err = refusal([*SMALL, "--steps", "6", "--checkpoint-dir", str(tmp_path)], capsys)
    assert message in err and f"remove {tmp_path}/step_00000002 to resume from the checkpoint before it" in err


def test_a_checkpoint_past_the_steps_is_refused_first(reference, tmp_path, capsys, no_training):
    _, saved = reference
    copy_checkpoint(saved, 4, tmp_path)
    err = refusal([*SMALL, "--steps", "3", "--checkpoint-dir", str(tmp_path)], capsys)
    assert f"the newest checkpoint in {tmp_path} is at step 4, past steps=3: ask for more --steps" in err


def test_a_ranks_refusal_is_one_line(monkeypatch, capsys):
    """What a rank raises about the input (its checkpoint, memory) reads as at W = 1, not as every rank's traceback."""
    def failed_rank(*args, **kwargs):
        raise LaunchError({1: "Traceback (most recent call last):\n  ...\nOutOfMemory: out of memory (...): fix"},
                          {1: "OutOfMemory: out of memory (...): use a smaller --seq-len or --batch"})

    monkeypatch.setattr("laplace_passes.demo.train.launch_local", failed_rank)
    err = refusal([*SMALL, "--steps", "2", "--world-size", "2"], capsys)
    assert err.endswith("error: rank 1: out of memory (...): use a smaller --seq-len or --batch\n")


def test_batch_must_divide_over_the_ranks():
    with pytest.raises(ValueError, match="global batch and must divide over 4 ranks"):
        run_demo(DemoConfig(steps=1, batch=6, world_size=4))


def test_launch_local_reports_the_failed_rank():
    """A rank that raises comes back with its traceback; one that exits, with its exit code."""
    import operator

    with pytest.raises(LaunchError, match=r"(?s)rank \d: Traceback.*ZeroDivisionError") as failed:
        launch_local(2, operator.truediv, 1, 0, timeout_s=120)
    assert failed.value.failures and set(failed.value.failures) <= {0, 1}
    assert set(failed.value.raised) == set(failed.value.failures)
    assert all(text == "ZeroDivisionError: division by zero" for text in failed.value.raised.values())
    with pytest.raises(LaunchError, match="rank 0: exited with code 3") as exited:
        launch_local(1, os._exit, 3, timeout_s=120)
    assert exited.value.raised == {}


def test_launch_local_forks_ranks_from_the_fork_server_by_default():
    """Forked from the preloaded server (its child, not this process's); spawn's ranks are this process's children."""
    forked = launch_local(2, os.getppid, timeout_s=120)
    assert os.getpid() not in forked and len(set(forked)) == 1
    assert launch_local(1, os.getppid, timeout_s=120, start_method="spawn") == [os.getpid()]
    with pytest.raises(ValueError, match="start_method must be 'forkserver' or 'spawn', got 'fork'"):
        launch_local(2, os.getppid, start_method="fork")


@pytest.mark.parametrize("agent_store", ["True", "False"])
def test_a_restartable_run_sharing_the_agents_store_is_warned_about(monkeypatch, capsys, agent_store):
    """torchrun --max-restarts with the agent's store shared: gloo's rendezvous would fail on restart (rank 0 warns)."""
    import torch.distributed as dist

    from laplace_passes.demo.distributed import join_process_group

    joined = []
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: joined.append(kwargs))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    for name, value in {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "WORLD_SIZE": "2",
                        "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": agent_store}.items():
        monkeypatch.setenv(name, value)
    assert join_process_group(timeout_s=5) == (0, 2) and len(joined) == 1
    warning = capsys.readouterr().err
    if agent_store == "True":
        assert "pytorch/pytorch#135712" in warning and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warning
    else:  # a c10d rendezvous that does not share the store: nothing to warn about
        assert warning == ""


def test_more_steps_trains_past_the_checkpoint(reference, tmp_path, capsys):
    """`--more-steps 2` from the checkpoint at step 4 trains steps 5 and 6: the uninterrupted run's losses."""
    losses, saved = reference
    copy_checkpoint(saved, 4, tmp_path)
    assert main(["demo", *SMALL, "--more-steps", "2", "--checkpoint-dir", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["resumed_from"] == 4
    assert_close(result["losses"], losses)
    assert demo_checkpoint.newest_step(str(tmp_path)) == 6  # saved at the new end


def test_a_checkpoint_at_the_steps_says_there_is_nothing_to_train(reference, tmp_path, capsys, no_training):
    """Running the same command again resumes at its last step: one line says so, and how to train on."""
    _, saved = reference
    copy_checkpoint(saved, 6, tmp_path)
    with pytest.raises(AssertionError, match="went past the checkpoint's checks"):  # the note comes first
        main(["demo", *SMALL, "--steps", "6", "--checkpoint-dir", str(tmp_path)])
    assert capsys.readouterr().err == (f"the checkpoint in {tmp_path} is at step 6 = --steps: nothing to train "
                                       "(evaluating it); pass --more-steps N or a larger --steps to train on\n")


@pytest.mark.parametrize("args,message", [
    (["--more-steps", "2"], "more_steps counts from a checkpoint: it needs checkpoint_dir"),
    (["--more-steps", "2", "--steps", "6", "--checkpoint-dir", "ck"], "--steps and --more-steps: give one"),
    (["--more-steps", "0", "--checkpoint-dir", "ck"], "more_steps must be a positive int, got 0"),
])
def test_more_steps_is_refused_without_its_checkpoint_or_beside_steps(args, message, capsys, no_training):
    assert message in refusal([*SMALL, *args], capsys)


def test_more_steps_under_restarts_is_refused(tmp_path, monkeypatch, capsys, no_training):
    """A restart runs the command again, which would count the steps again from the newer checkpoint."""
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    err = refusal([*SMALL, "--more-steps", "2", "--checkpoint-dir", str(tmp_path)], capsys)
    assert "--more-steps under torchrun --max-restarts" in err and "give the total as --steps" in err
