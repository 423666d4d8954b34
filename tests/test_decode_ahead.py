"""The decode step compiled ahead of time (AOTInductor): the JIT step's tokens, logits and states; each loop's
first call guarded and the rest in the library; weights looked up again per loop; libraries kept on disk and run
by generate's default without a compile of its own; and a failed export or compile declined with the reason, its
steps run through the JIT-compiled graph."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import model_zoo
from model_zoo import decode_ahead
from model_zoo.decode import DecodeStep
from model_zoo.decode_ahead import AheadOfTimeStep, _library_key, _resolve, _role

TIGHT = {"rtol": 1e-5, "atol": 1e-5}
BATCH = 64  # the large batch class: the library's batch is dynamic from 64 sequences up


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return model_zoo.build("tiny").eval()


@pytest.fixture(scope="module")
def library_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("aot_libraries"))


@pytest.fixture(scope="module")
def step(model, library_dir):
    """The model's own ahead-of-time step (what generate uses), its libraries in a folder of this module."""
    step = model.ahead_of_time_step
    step.cache_dir = library_dir
    return step


def prompt(batch, length, seed=0):
    return torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def decode(step, model, ids, steps, fed=None):
    """Greedy tokens, logits and final buffers of `steps` steps of one loop after prefilling `ids` (the tokens
    fed to the steps appended to `fed`)."""
    logits, states = model(ids, output_final_states=True)
    buffers = step.state_buffer(states)
    return (*run_loop(step.loop(buffers), logits[:, -1].argmax(-1), steps, fed), buffers)


@torch.no_grad()
def run_loop(loop, token, steps, fed=None):
    """Greedy tokens and logits of `steps` calls of `loop` from `token` (the tokens fed appended to `fed`)."""
    tokens, all_logits = [], []
    for _ in range(steps):
        if fed is not None:
            fed.append(token)
        step_logits, token = loop(token)
        tokens.append(token)
        all_logits.append(step_logits)
    return torch.stack(tokens, 1), torch.stack(all_logits, 1)


def test_steps_equal_the_jit_steps_and_the_eager_reference(model, step, library_dir, caplog):
    ids, fed = prompt(BATCH, 6), []
    ready = step.libraries_ready()
    with caplog.at_level("WARNING", logger="laplace.progress"):
        tokens, logits, buffers = decode(step, model, ids, 10, fed)
    assert step.libraries_ready() == ready + 1 and not step.report.notes
    assert [r.getMessage() for r in caplog.records if r.name == "laplace.progress"] == [
        f"compiling the decode step for 64 or more sequences ahead of time (AOTInductor), once; the library is kept "
        f"in {library_dir}"]
    jit_tokens, jit_logits, jit_buffers = decode(DecodeStep(model), model, ids, 10)
    assert torch.equal(tokens, jit_tokens)
    torch.testing.assert_close(logits, jit_logits, **TIGHT)
    for state, jit_state in zip(buffers, jit_buffers, strict=True):
        torch.testing.assert_close(state, jit_state, **TIGHT)
    with torch.no_grad():  # the reference: the whole sequence through the model eagerly
        full_logits, _ = model(torch.cat([ids, torch.stack(fed, 1)], 1), output_final_states=True)
    torch.testing.assert_close(logits, full_logits[:, ids.shape[1]:], **TIGHT)


@pytest.fixture
def library_calls(monkeypatch):
    """The libraries each later step of a loop ran, in order."""
    calls, run = [], decode_ahead._Library.run
    monkeypatch.setattr(decode_ahead._Library, "run", lambda self, *a: calls.append(self) or run(self, *a))
    return calls


def test_a_loops_first_call_is_guarded_and_its_later_calls_run_the_library(model, step, monkeypatch, library_calls):
    guarded, compiled = [], step._compiled
    monkeypatch.setattr(step, "_compiled", lambda *a: guarded.append(1) or compiled(*a))
    decode(step, model, prompt(BATCH, 3, seed=1), 1)
    ready, guarded[:] = step.libraries_ready(), []
    for _ in range(2):
        decode(step, model, prompt(BATCH + 5, 3, seed=1), 4)
    assert (len(guarded), len(library_calls)) == (2, 6)  # per loop: one guarded call, three in the library
    assert step.libraries_ready() == ready  # 69 sequences: the same batch class, the same library
    assert len(set(map(id, library_calls))) == 1


def test_weights_changed_or_replaced_between_loops_are_the_ones_used(model, step, library_calls):
    ids = prompt(BATCH, 4, seed=2)
    _, before, _ = decode(step, model, ids, 6)
    graphs, ready = step.graphs_compiled(), step.libraries_ready()
    down_proj = model.layers[0].mlp.down_proj
    original = down_proj.weight
    try:
        with torch.no_grad():
            model.embeddings.weight.mul_(1.5)  # trained in place
        down_proj.weight = torch.nn.Parameter(original.detach().flip(0) * 3)  # replaced by a new tensor
        library_calls.clear()
        tokens, logits, _ = decode(step, model, ids, 6)
        jit_tokens, jit_logits, _ = decode(DecodeStep(model), model, ids, 6)
    finally:
        with torch.no_grad():
            model.embeddings.weight.div_(1.5)
        down_proj.weight = original
    assert len(library_calls) == 5  # the same graph and library, with the weights looked up again
    assert (step.graphs_compiled(), step.libraries_ready()) == (graphs, ready)
    assert (logits - before).abs().max() > 0.1  # the new weights give other logits
    assert torch.equal(tokens, jit_tokens)
    torch.testing.assert_close(logits, jit_logits, **TIGHT)


@torch.no_grad()
def decode_int32(step, model, ids, steps):
    """As `decode`, each step fed its tokens as int32: Dynamo guards on the dtype, so another graph runs."""
    logits, states = model(ids, output_final_states=True)
    loop, token, out = step.loop(step.state_buffer(states)), logits[:, -1].argmax(-1), []
    for _ in range(steps):
        step_logits, token = loop(token.int())
        out.append(step_logits)
    return torch.stack(out, 1)


def test_tokens_of_another_dtype_run_another_graphs_library_and_then_the_first_again(model, step, library_calls):
    """Each loop runs the library of the graph its first call ran, not the library last compiled."""
    ids = prompt(BATCH, 3, seed=8)
    decode(step, model, ids, 2)
    (first,) = library_calls
    int32 = decode_int32(step, model, ids, 4)
    torch.testing.assert_close(int32, decode_int32(DecodeStep(model), model, ids, 4), **TIGHT)
    _, int64, _ = decode(step, model, ids, 4)
    torch.testing.assert_close(int64, decode(DecodeStep(model), model, ids, 4)[1], **TIGHT)
    other, again = library_calls[1:4], library_calls[4:]
    assert all(lib is other[0] for lib in other) and other[0] is not first
    assert again == [first] * 3


def test_a_library_on_disk_is_loaded_not_compiled(model, step, library_dir, monkeypatch):
    decode(step, model, prompt(BATCH, 3), 2)  # the library is on disk (built by an earlier test or now)
    libraries = sorted(os.listdir(library_dir))
    monkeypatch.setattr(decode_ahead, "_compile_package", lambda *a: pytest.fail("compiled again"))
    fresh = AheadOfTimeStep(model, cache_dir=library_dir)
    tokens, logits, _ = decode(fresh, model, prompt(BATCH, 3, seed=4), 5)
    expected_tokens, expected_logits, _ = decode(DecodeStep(model), model, prompt(BATCH, 3, seed=4), 5)
    assert fresh.libraries_ready() == 1 and sorted(os.listdir(library_dir)) == libraries
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, **TIGHT)


def test_generate_ahead_of_time_gives_the_compiled_decodes_tokens(model, step, library_calls):
    ids = prompt(BATCH, 5, seed=3)
    ahead = model.generate(ids, 7, decode="ahead-of-time", return_logits=True)
    assert model.ahead_of_time_step is step and len(library_calls) == 5  # 6 steps: the first guarded
    compiled = model.generate(ids, 7, decode="compiled", return_logits=True)
    assert torch.equal(ahead.tokens, compiled.tokens)
    torch.testing.assert_close(ahead.logits, compiled.logits, **TIGHT)


@pytest.mark.parametrize("batch", [1, 3])
def test_one_sequence_and_the_small_batch_class_have_libraries_of_their_own(model, step, library_calls, batch):
    ids = prompt(batch, 4, seed=5)
    ready = step.libraries_ready()
    tokens, logits, _ = decode(step, model, ids, 5)
    expected_tokens, expected_logits, _ = decode(DecodeStep(model), model, ids, 5)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, **TIGHT)
    assert step.libraries_ready() == ready + 1 and len(library_calls) == 4 and not step.report.notes


def test_a_failed_compile_is_declined_with_its_reason_and_the_jit_step_decodes(model, tmp_path, monkeypatch):
    def no_compile(*args):
        raise RuntimeError("AOTInductor is not available here")

    monkeypatch.setattr(decode_ahead, "_compile_package", no_compile)
    monkeypatch.delenv("LAPLACE_PASSES_STRICT", raising=False)
    declined = AheadOfTimeStep(model, cache_dir=str(tmp_path))
    ids = prompt(3, 4, seed=6)
    tokens, logits, _ = decode(declined, model, ids, 4)
    expected_tokens, expected_logits, _ = decode(DecodeStep(model), model, ids, 4)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logits, expected_logits, **TIGHT)
    (note,) = declined.report.notes
    assert note.startswith("decode step for 3 sequences not compiled ahead of time (RuntimeError: AOTInductor is "
                           "not available here); its loop runs the JIT-compiled graph")
    monkeypatch.setenv("LAPLACE_PASSES_STRICT", "1")
    with pytest.raises(RuntimeError, match="AOTInductor is not available here"):
        decode(AheadOfTimeStep(model, cache_dir=str(tmp_path)), model, ids, 2)


def test_a_buffer_that_is_not_dense_is_declined_and_decodes_through_the_jit_step(model, tmp_path, library_calls):
    ids = prompt(3, 4, seed=7)
    with torch.no_grad():
        logits, states = model(ids, output_final_states=True)
    expected_tokens, expected_logits, _ = decode(DecodeStep(model), model, ids, 3)
    sparse = AheadOfTimeStep(model, cache_dir=str(tmp_path))
    wide = [torch.zeros(3, 4, 16, 32) for _ in states]
    buffers = [w[:, :2].copy_(s) for w, s in zip(wide, states)]  # two heads of four: not dense
    tokens, all_logits = run_loop(sparse.loop(buffers), logits[:, -1].argmax(-1), 3)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(all_logits, expected_logits, **TIGHT)
    assert sparse.libraries_ready() == 0 and not os.listdir(tmp_path) and not library_calls
    (note,) = sparse.report.notes
    assert note.startswith("decode step for 3 sequences not compiled ahead of time (a state buffer is not dense in "
                           "its layout"), note


def test_what_keeps_a_loop_from_a_library():
    why = decode_ahead._why_no_library
    tokens, buffers = torch.zeros(2, dtype=torch.long), [torch.zeros(2, 2, 16, 32)]
    assert why(["graph"], tokens, buffers) is None
    assert why([], tokens, buffers) == "Dynamo ran no graph of its own"
    assert why(["a", "b"], tokens, buffers) == "Dynamo split the step into 2 graphs"
    assert why(["graph"], tokens[:0], [b[:0] for b in buffers]) == "no sequences"
    assert "on ['cpu', 'meta']" in why(["graph"], tokens, [torch.zeros(2, 2, 16, 32, device="meta")])
    assert "not dense" in why(["graph"], tokens, [torch.zeros(2, 4, 16, 32)[:, 1:3]])


def test_a_graph_without_every_buffer_is_not_the_step():
    decode_ahead._Inputs([("tokens",), ("state", 0), ("state", 1), ("batch",)]).check_whole(2)
    with pytest.raises(ValueError, match=r"does not take \[\('state', 1\)\]: it is not the whole step"):
        decode_ahead._Inputs([("tokens",), ("state", 0), ("weight", ".model.w")]).check_whole(2)


def test_inputs_are_read_from_the_steps_arguments_and_the_model_only(model, step):
    assert _role("args[0]") == ("tokens",)
    assert _role("args[1][3]") == ("state", 3)
    assert _role("args[1][0].size()[0]") == ("batch",)
    path = "model.layers.1.mlp_norm.weight"
    assert _role("model_or_fn.__self__." + path) == ("weight", path)
    assert _resolve(step, path) is not None and torch.equal(_resolve(step, path), model.layers[1].mlp_norm.weight)
    # What Dynamo records, as input_source names it: the role of each input of the step's graph.
    decode(step, model, prompt(BATCH, 2), 1)
    graph = [g.after for g in step.report.graphs if g.kind == "dynamo"][0]
    roles = decode_ahead._Inputs.of(graph).roles
    assert roles[:2] == [("batch",), ("tokens",)] and ("state", 1) in roles
    assert ("weight", "model.embeddings.weight") in roles
    with pytest.raises(ValueError, match=r"comes from DECAY, neither the step's arguments nor the model"):
        _role("DECAY")
    with pytest.raises(ValueError, match="has no module, parameter or buffer 'missing'"):
        _resolve(step, "model.missing.weight")
    with pytest.raises(ValueError, match="is not a tensor reached by attributes"):
        _resolve(step, "model.layers[0]")
    with pytest.raises(ValueError, match="is not a tensor reached by attributes"):
        _resolve(step, "model.layers")
    with pytest.raises(TypeError, match="AheadOfTimeStep takes no inner="):
        AheadOfTimeStep(model, inner="eager")


def test_libraries_are_per_batch_class_and_buffer_layout():
    k_innermost = DecodeStep.state_buffer([torch.zeros(70, 2, 16, 32)])
    assert _library_key(70, k_innermost) == _library_key(1000, DecodeStep.state_buffer([torch.zeros(1000, 2, 16, 32)]))
    assert _library_key(70, k_innermost) != _library_key(70, [torch.zeros(70, 2, 16, 32)])
    assert _library_key(70, k_innermost) != _library_key(3, DecodeStep.state_buffer([torch.zeros(3, 2, 16, 32)]))


def test_a_loop_that_compiles_nothing_runs_the_jit_graph_until_a_library_is_on_disk(model, tmp_path, monkeypatch,
                                                                                    library_calls):
    ids = prompt(BATCH, 3, seed=9)
    expected_tokens, expected_logits, _ = decode(DecodeStep(model), model, ids, 4)
    compiles, compile_package = [], decode_ahead._compile_package
    monkeypatch.setattr(decode_ahead, "_compile_package", lambda *a: compiles.append(1) or compile_package(*a))
    load_only = AheadOfTimeStep(model, cache_dir=str(tmp_path))
    guarded, compiled = [], load_only._compiled
    monkeypatch.setattr(load_only, "_compiled", lambda *a: guarded.append(1) or compiled(*a))

    def decode_load_only():
        with torch.no_grad():
            logits, states = model(ids, output_final_states=True)
        loop = load_only.loop(load_only.state_buffer(states), compile_missing=False)
        tokens, all_logits = run_loop(loop, logits[:, -1].argmax(-1), 4)
        assert torch.equal(tokens, expected_tokens)
        torch.testing.assert_close(all_logits, expected_logits, **TIGHT)

    hashed, package_path = [], decode_ahead._package_path
    monkeypatch.setattr(decode_ahead, "_package_path", lambda *a: hashed.append(1) or package_path(*a))
    for _ in range(2):  # nothing on disk: every step through the JIT-compiled graph, nothing compiled
        decode_load_only()
    assert (len(guarded), len(library_calls), compiles, os.listdir(tmp_path)) == (8, 0, [], [])
    assert len(hashed) == 1  # the second loop looked at the path it remembered, not hashing the graph again
    (note,) = load_only.report.notes
    assert note == ("decode step for 64 sequences runs its JIT-compiled graph: no library compiled ahead of time for "
                    "it on disk (generate(..., decode=\"ahead-of-time\") compiles one)")
    decode(AheadOfTimeStep(model, cache_dir=str(tmp_path)), model, ids, 2)  # another step compiles its library
    assert len(compiles) == 1 and len(os.listdir(tmp_path)) == 1
    guarded.clear(), library_calls.clear()
    decode_load_only()  # the library on disk now: loaded, and the later steps run it
    assert (len(guarded), len(library_calls), len(compiles), load_only.libraries_ready()) == (1, 3, 1, 1)


def test_generates_default_runs_a_library_compiled_already_and_decode_compiled_never(model, step, library_calls):
    ids = prompt(BATCH, 4, seed=10)
    ahead = model.generate(ids, 6, decode="ahead-of-time", return_logits=True)  # compiles or loads the library
    library_calls.clear()
    default = model.generate(ids, 6, return_logits=True)
    assert len(library_calls) == 4  # 5 steps: the first guarded
    library_calls.clear()
    jit = model.generate(ids, 6, decode="compiled", return_logits=True)
    assert not library_calls
    for other in (default, jit):
        assert torch.equal(other.tokens, ahead.tokens)
        torch.testing.assert_close(other.logits, ahead.logits, **TIGHT)


LOAD_AND_EXIT = textwrap.dedent("""
    import sys, torch, model_zoo
    from model_zoo.decode_ahead import AheadOfTimeStep
    torch.manual_seed(0)
    model = model_zoo.build("tiny").eval()
    step = AheadOfTimeStep(model, cache_dir=sys.argv[1])
    ids = torch.randint(1, 128, (64, 3))
    with torch.no_grad():
        logits, states = model(ids, output_final_states=True)
        loop, token = step.loop(step.state_buffer(states), compile_missing=False), logits[:, -1].argmax(-1)
        for _ in range(3):
            _, token = loop(token)
    assert step.libraries_ready() == 1
""")


def test_a_process_that_loaded_a_library_leaves_no_folder_in_the_temp_directory(model, step, library_dir, tmp_path):
    """A loader unpacks its library into a folder of the temp directory, removed only when the loader is
    destroyed: the step releases its libraries at exit."""
    decode(step, model, prompt(BATCH, 3), 2)  # the library on disk (built by an earlier test or now)
    temp = tmp_path / "temp"
    temp.mkdir()
    done = subprocess.run([sys.executable, "-c", LOAD_AND_EXIT, library_dir], env={**os.environ, "TMPDIR": str(temp)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [p.name for p in temp.iterdir() if p.name.startswith("aotinductor")]


def test_guards_once_per_loop_off_guards_each_jit_call_and_leaves_a_library_alone(model, step, tmp_path, monkeypatch,
                                                                                 library_calls):
    stances, set_stance = [], torch.compiler.set_stance
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: stances.append(k) or set_stance(*a, **k))
    monkeypatch.setattr(step, "guards_once_per_loop", False)
    decode(step, model, prompt(BATCH, 3, seed=11), 4)  # the library (on disk from an earlier test, or compiled)
    assert len(library_calls) == 3
    no_library = AheadOfTimeStep(model, cache_dir=str(tmp_path), guards_once_per_loop=False)
    guarded, compiled = [], no_library._compiled
    monkeypatch.setattr(no_library, "_compiled", lambda *a: guarded.append(1) or compiled(*a))
    ids = prompt(BATCH, 3, seed=11)
    with torch.no_grad():
        logits, states = model(ids, output_final_states=True)
    run_loop(no_library.loop(no_library.state_buffer(states), compile_missing=False), logits[:, -1].argmax(-1), 4)
    assert len(guarded) == 4 and len(library_calls) == 3
    assert not [k for k in stances if k.get("skip_guard_eval_unsafe")]  # every JIT call fully guarded
