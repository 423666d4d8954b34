"""The `laplace-passes` command.

    laplace-passes demo [--steps N] [--world-size W] ...   the main job (MQAR training)
    laplace-passes inspect MODEL [--json] [--dump DIR]      what the passes do to MODEL
    laplace-passes inspect --passes [--target T --inner I]  the passes a compile runs, in order
    laplace-passes export MODEL --stablehlo DIR             every graph as StableHLO + manifest.json
        [--muon --world-size W]                             ... and the demo's ShardedMuon step, one module for W ranks
    laplace-passes bench NAME [args...]                     run a benchmark script

DIR is written whole or not at all; a non-empty DIR is refused unless
--force, which replaces it and everything in it.

MODEL is a model_zoo config name (tiny, plain-tiny, small, laplace-3b,
fla-gla-tiny, fla-gla-1.3b, fla-hgrn2-tiny, fla-retnet-tiny, fla-rwkv6-tiny,
fla-gsa-tiny, fla-lightnet-tiny) or
`package.module:attr`, where attr is an nn.Module taking token ids, or a
callable returning `(model_or_fn, example_inputs_tuple)`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import importlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
PLOT_POINTS = 20  # recall measurements along the curve of `demo --plot`
MUON_EXPORT_RANKS = 4  # export --muon's ranks by default: trn2's all-to-all takes 4, 8, 16 or 32k


def main(argv: list[str] | None = None) -> int:
    from laplace_passes.tools.memory import allocation_failures_as_errors

    parser = _parser()
    args = parser.parse_args(argv)
    progress = _progress_on_stderr() if args.command in ("inspect", "export") else contextlib.nullcontext()
    try:
        with allocation_failures_as_errors("use a smaller --seq-len or --batch"), progress:
            return args.run(args)
    except Exception as error:  # noqa: BLE001 (what is not the input's or ours to explain is raised again)
        shown = _one_line_error(error)
        if shown is None:
            raise
        # A KeyError's message is the key alone: its name says what kind of error it is.
        text = f"{type(shown).__name__}: {shown}" if isinstance(shown, KeyError) else str(shown)
        print(f"laplace-passes {args.command}: error: {text}", file=sys.stderr)
        return 2


def _one_line_error(error: Exception) -> Exception | None:
    """The error to print as one line: bad input (ValueError, TypeError, a missing file or package, ...), a graph
    torch-mlir cannot lower, a function nothing was compiled of; unwrapped from Dynamo's BackendCompilerFailed,
    which a compile inside a training step (the demo) raises around them. None: a traceback's matter."""
    from torch._dynamo.exc import BackendCompilerFailed

    from laplace_passes.driver.compile_fx import NothingCapturedError
    from laplace_passes.lowering.diagnose import LoweringError

    if isinstance(error, BackendCompilerFailed):
        error = error.inner_exception
    one_line = (ValueError, TypeError, LookupError, ImportError, OSError, LoweringError, NothingCapturedError)
    return error if isinstance(error, one_line) else None


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions and epilogs as written; every option with a default shows it, with or without help text."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and _has_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if _has_default(action) and "%(default)" not in help_text and "(default" not in help_text:
            help_text += " (default: %(default)s)"
        return help_text.strip()


def _has_default(action: argparse.Action) -> bool:
    # Flags (default False) and options without a default have nothing to show.
    return bool(action.option_strings) and not any(action.default is nothing for nothing in (None, False)) \
        and action.default != argparse.SUPPRESS


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, formatter_class=_HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="laplace-passes", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_demo(commands)
    _add_inspect(commands)
    _add_export(commands)
    _add_bench(commands)
    _name_the_choices(commands.choices.values())
    return parser


def _name_the_choices(parsers) -> None:
    """--target and --inner of every command list what they accept, read from where they are registered."""
    from laplace_passes.driver.backend import INNER_COMPILERS
    from laplace_passes.infra.targets import TARGETS

    described = {
        "--target": f"hardware target: {', '.join(sorted(TARGETS))}",
        "--inner": f"inner compiler: {', '.join(INNER_COMPILERS)}",
    }
    for parser in parsers:
        for action in parser._actions:
            option = next((o for o in action.option_strings if o in described), None)
            if option is not None:
                action.help = described[option] + (f"; {action.help}" if action.help else "")


def _add_demo(commands) -> None:
    from laplace_passes.demo.train import DEMO_MODELS, DemoConfig

    defaults = DemoConfig()
    demo = commands.add_parser("demo", help="train the tiny GLA model on MQAR through backend='laplace'")
    demo.add_argument("--model", default=defaults.model, choices=DEMO_MODELS,
                      help="model_zoo's GLA LM (tiny; plain-tiny: its recurrence in plain PyTorch), or one of "
                      "flash-linear-attention's GLA-family models")
    demo.add_argument("--steps", type=int, metavar="N",
                      help=f"steps to train to, in all; a run resuming from a checkpoint trains the steps past "
                           f"its step (default: {defaults.steps})")
    demo.add_argument("--more-steps", type=int, metavar="N",
                      help="train N steps past the newest checkpoint in --checkpoint-dir (instead of --steps)")
    demo.add_argument("--batch", type=int, default=defaults.batch,
                      help="sequences per step, the global batch: split over the ranks (must divide), so the "
                           "same command trains the same way at any world size")
    demo.add_argument("--seq-len", type=int, default=defaults.seq_len)
    demo.add_argument("--num-pairs", type=int, default=defaults.num_pairs, help="key-value pairs to recall")
    demo.add_argument("--shift-keys", action=argparse.BooleanOptionalAction, default=None,
                      help="keys from the previous token (GLAConfig.shift_keys; default: on for tiny and plain-tiny, "
                           "whose recall stays at a random listed value's without it; fla's models: not available)")
    demo.add_argument("--target", default=defaults.target)
    demo.add_argument("--inner", default=defaults.inner)
    demo.add_argument("--world-size", type=int, default=defaults.world_size,
                      help="data-parallel ranks: local gloo processes started through torch.distributed's "
                           "elastic launcher (under torchrun leave it out: torchrun starts the processes)")
    demo.add_argument("--seed", type=int, default=defaults.seed)
    demo.add_argument("--muon-lr", type=float, default=defaults.muon_lr,
                      help="ShardedMuon's learning rate for the hidden matrices")
    demo.add_argument("--adamw-lr", type=float, default=defaults.adamw_lr,
                      help="AdamW's learning rate for the embeddings, the output head and the norms")
    demo.add_argument("--checkpoint-dir", metavar="DIR",
                      help="save checkpoints (torch.distributed.checkpoint) to DIR; if DIR holds one, resume from "
                           "the newest, at any world size")
    demo.add_argument("--checkpoint-every", type=int, metavar="N",
                      help="steps between checkpoints (default: one at the end)")
    demo.add_argument("--plot", metavar="FILE",
                      help="draw the loss and recall curves into FILE (.png, .svg, .pdf; the 'plot' extra: matplotlib)")
    demo.add_argument("--no-progress", action="store_true")
    demo.add_argument("--json", action="store_true", help="print the result as JSON")
    demo.set_defaults(run=_run_demo)


def _run_demo(args) -> int:
    from laplace_passes.demo.plot import check_can_plot, plot_curves
    from laplace_passes.demo.train import DemoConfig, run_demo

    if args.steps is not None and args.more_steps is not None:
        raise ValueError("--steps and --more-steps: give one (--steps is the total to train to, --more-steps the "
                         "steps past the checkpoint)")
    if args.plot:
        check_can_plot(args.plot)  # before the training, which takes a minute
    steps = DemoConfig.steps if args.steps is None else args.steps
    config = DemoConfig(model=args.model, steps=steps, batch=args.batch, seq_len=args.seq_len, num_pairs=args.num_pairs,
                        shift_keys=args.shift_keys,
                        target=args.target, inner=args.inner, world_size=args.world_size, seed=args.seed,
                        muon_lr=args.muon_lr, adamw_lr=args.adamw_lr,
                        progress=not args.no_progress, checkpoint_dir=args.checkpoint_dir,
                        checkpoint_every=args.checkpoint_every, more_steps=args.more_steps,
                        recall_every=max(1, (args.more_steps or steps) // PLOT_POINTS) if args.plot else None)
    result = run_demo(config)
    if result is None:  # a rank other than 0 of a torchrun job: rank 0 prints the result
        return 0
    if args.plot:
        plot_curves(result, args.plot)
        print(f"drew the loss and recall curves into {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.report)
        print(result.summary())
    return 0


def _add_inspect(commands) -> None:
    from laplace_passes.infra.report import COLUMNS

    width = max(len(name) for name in COLUMNS)
    columns = "\n".join(f"  {name:<{width}}  {meaning}" for name, meaning in COLUMNS.items())
    inspect = commands.add_parser("inspect", help="run the passes on MODEL and print the report",
                                  epilog=f"the report's columns:\n{columns}")
    inspect.add_argument("model", nargs="?", help="model_zoo config name or package.module:attr")
    inspect.add_argument("--seq-len", type=int, default=2048)
    inspect.add_argument("--batch", type=int, default=1)
    inspect.add_argument("--target", default="trn2")
    inspect.add_argument("--passes", action="store_true",
                         help="print the passes this target and --inner run, in order, and stop (no MODEL needed)")
    inspect.add_argument("--inner", default="eager",
                         help="the inner compiler the graphs run with while they are captured, and the one "
                              "--passes describes")
    inspect.add_argument("--json", action="store_true", help="print report.to_dict() as JSON")
    inspect.add_argument("--dump", metavar="DIR", help="write every graph before/after each pass to DIR")
    inspect.add_argument("--force", action="store_true", help="replace DIR (and everything in it) if it is not empty")
    inspect.set_defaults(run=_run_inspect)


def _run_inspect(args) -> int:
    import laplace_passes
    from laplace_passes.tools.dump import dump_report
    from laplace_passes.infra.files import check_output_dir

    if args.passes:
        from laplace_passes.driver.backend import compile_config
        from laplace_passes.driver.pipeline import describe

        # The pipeline alone: what else was given would be ignored, so it is refused, naming it.
        unused = [name for name, given in (("MODEL", args.model), ("--json", args.json), ("--dump", args.dump),
                                           ("--force", args.force)) if given]
        if unused:
            raise ValueError(f"--passes prints the pipeline only (for --target and --inner); {', '.join(unused)} "
                             "would be ignored: leave --passes out to inspect a model")
        print(describe(compile_config({"target": args.target, "inner": args.inner})))
        return 0
    if args.model is None:
        raise ValueError("MODEL is required (or --passes)")
    _check_options(target=args.target, inner=args.inner)  # before the work, which may take minutes
    if args.dump:
        check_output_dir(args.dump, args.force)
    model, example_inputs = load_model(args.model, args.batch, args.seq_len)
    with _status(f"inspect {args.model}: capturing and transforming its graphs "
                 f"{_at_inputs(example_inputs, args.batch, args.seq_len)}"):
        report = laplace_passes.inspect(model, *example_inputs, target=args.target, inner=args.inner)
    print(report.to_json(indent=2) if args.json else report)
    if args.dump:
        dumped = dump_report(report, args.dump, overwrite=args.force)
        for note in dumped.notes:
            print(note, file=sys.stderr)
        for reason in dumped.not_drawn:
            print(f"not drawn as .svg (the .dot is written): {reason}", file=sys.stderr)
        print(f"wrote {len(dumped.written)} files to {args.dump}", file=sys.stderr)
    return 0


def _add_export(commands) -> None:
    export = commands.add_parser(
        "export", help="lower every graph of MODEL to StableHLO (needs the 'lowering' extra)"
    )
    export.add_argument("model", help="model_zoo config name or package.module:attr")
    export.add_argument("--stablehlo", metavar="DIR", required=True,
                        help="write one .mlir per graph and manifest.json to DIR")
    export.add_argument("--force", action="store_true", help="replace DIR (and everything in it) if it is not empty")
    export.add_argument("--seq-len", type=int, default=256)
    export.add_argument("--batch", type=int, default=1)
    export.add_argument("--target", default="trn2")
    export.add_argument("--inference", action="store_true",
                        help="export the inference graph only (default: forward and backward of a training step)")
    export.add_argument("--muon", action="store_true",
                        help="also export the demo's ShardedMuon step over MODEL's parameters into DIR/muon_step "
                             "(one module for every rank, traced on --world-size local ranks; MODEL a model_zoo "
                             "config)")
    export.add_argument("--world-size", type=int, default=MUON_EXPORT_RANKS, metavar="W", action=_GivenAction,
                        help="ranks of the --muon step (trn2's all-to-all takes 4, 8, 16 or 32k)")
    export.add_argument("--json", action="store_true", help="print the manifest as JSON")
    export.set_defaults(run=_run_export, world_size_given=False)


class _GivenAction(argparse.Action):
    """Stores the value, and `<dest>_given` = True: an option given on the command line, told from its default."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _run_export(args) -> int:
    import torch

    import laplace_passes
    from laplace_passes.infra.files import check_output_dir

    check_output_dir(args.stablehlo, args.force)
    _check_options(target=args.target)
    if args.world_size_given and not args.muon:  # it would change nothing: say so
        raise ValueError(f"--world-size ({args.world_size}) sets the ranks of the --muon step: add --muon, or "
                         "leave --world-size out")
    if args.muon and ":" in args.model:  # before W ranks start, each of which would refuse the name
        raise ValueError(f"--muon exports the demo's ShardedMuon step over a model_zoo config's parameters; "
                         f"{args.model!r} is a package.module:attr: export it without --muon")
    if args.muon and args.world_size < 2:
        raise ValueError(f"--muon needs --world-size of at least 2 (got {args.world_size}): with one rank the "
                         "step has no communication to export")
    model, example_inputs = load_model(args.model, args.batch, args.seq_len)
    with tempfile.TemporaryDirectory(prefix="laplace_export_") as scratch:
        step = None
        if args.muon:  # first: a failure here leaves DIR as it was
            from laplace_passes.demo.muon_export import STEP_DIR, export_muon_step

            with _status(f"export {args.model}: the ShardedMuon step, traced and lowered on {args.world_size} ranks"):
                step = export_muon_step(args.model, world_size=args.world_size, target=args.target,
                                        out_dir=Path(scratch) / STEP_DIR)
        # Gradients on (the default): AOT Autograd makes the forward and backward graphs of a training step.
        context = torch.no_grad() if args.inference else contextlib.nullcontext()
        at = _at_inputs(example_inputs, args.batch, args.seq_len)
        with context, _status(f"export {args.model}: lowering every graph {at}"):
            exported = laplace_passes.export_stablehlo(model, *example_inputs, target=args.target,
                                                       out_dir=args.stablehlo, overwrite=args.force)
        manifest = exported.manifest
        if step is not None:
            shutil.move(str(Path(scratch) / step["dir"]), str(exported.out_dir / step["dir"]))
            manifest["muon_step"] = step
            (exported.out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        for entry in manifest["graphs"]:
            ops = sum(entry["op_counts"].values())
            print(f"{entry['file']:<32} {entry['kind']:<10} {ops:>7,} StableHLO ops")
        if "muon_step" in manifest:
            step = manifest["muon_step"]
            for name in step["graphs"]:
                collectives = ", ".join(f"{op.removeprefix('stablehlo.')} x{n}" for op, n in step["collectives"][name].items())
                print(f"{step['dir'] + '/' + name + '.mlir':<32} {'muon step':<10} {collectives} "
                      f"(W = {step['world_size']}, the same module on every rank)")
        count = len(manifest['graphs'])
        print(f"wrote {count} graph{'' if count == 1 else 's'}{' and the Muon step' if 'muon_step' in manifest else ''} "
              f"and manifest.json to {exported.out_dir}")
    return 0


def _check_options(**options) -> None:
    from laplace_passes.driver.backend import compile_config

    compile_config(options)  # an unknown target or inner compiler is a ValueError naming the known ones


@contextlib.contextmanager
def _progress_on_stderr():
    """The progress lines of `laplace_passes.infra.logs` on stderr, as they are logged (and only here)."""
    logger = logging.getLogger("laplace.progress")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("  %(message)s"))
    saved = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False  # TORCH_LOGS=laplace would print them a second time
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


@contextlib.contextmanager
def _status(what: str):
    """One line on stderr before long silent work, and how long it took after."""
    print(f"{what} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def _at_inputs(example_inputs, batch: int, seq_len: int) -> str:
    """The inputs a command captures at, in words: the --batch and --seq-len token ids, or what a callable
    `package.module:attr` returned (whose shapes the options do not set)."""
    shapes = [list(x.shape) for x in example_inputs if hasattr(x, "shape")]
    if shapes == [[batch, seq_len]]:
        return f"at batch {batch}, T = {seq_len}"
    return f"at the inputs it was given ({', '.join(map(str, shapes)) or 'no tensor'})"


def load_model(spec: str, batch: int, seq_len: int):
    """Resolve MODEL to (model_or_fn, example_inputs)."""
    import torch

    import model_zoo

    if batch < 1 or seq_len < 1:
        raise ValueError(f"--batch and --seq-len must be positive, got {batch} and {seq_len}")
    if ":" not in spec:
        if spec not in model_zoo.CONFIG_NAMES:
            raise ValueError(f"unknown model {spec!r}: use one of {', '.join(model_zoo.CONFIG_NAMES)} "
                             "or package.module:attr")
        model = model_zoo.build(spec)
        _check_batch_fits(batch, seq_len, model.config.vocab_size)
        device = next(model.parameters()).device
        ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        return model, (ids,)
    module_name, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except AttributeError as error:
        raise LookupError(f"{module_name} has no attribute {attr!r}") from error
    if isinstance(obj, torch.nn.Module):
        vocab = getattr(getattr(obj, "config", None), "vocab_size", None)
        if vocab is None:
            raise TypeError(f"{spec} is a module without config.vocab_size: give a callable returning "
                            "(model_or_fn, example_inputs) instead")
        _check_batch_fits(batch, seq_len, vocab)
        return obj, (torch.zeros(batch, seq_len, dtype=torch.long),)
    if callable(obj):
        made = obj()
        if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], tuple)):
            raise TypeError(f"{spec}() must return (model_or_fn, example_inputs_tuple), got {type(made).__name__}")
        return made
    raise TypeError(f"{spec} is a {type(obj).__name__}: expected an nn.Module or a callable")


def _check_batch_fits(batch: int, seq_len: int, vocab_size: int) -> None:
    """Refuse example inputs whose token ids and logits alone exceed this machine's memory."""
    from laplace_passes.tools.memory import check_fits

    per_token = 8 + 4 * vocab_size  # an int64 id, one float32 logit per vocabulary entry
    check_fits(batch * seq_len * per_token, f"--batch {batch} x --seq-len {seq_len:,} tokens (their ids and logits)",
               "use a smaller --seq-len or --batch")


def _add_bench(commands) -> None:
    names = available_benchmarks()
    width = max((len(name) for name in names), default=0)
    listed = "\n".join(f"  {name:<{width}}  {_first_line(BENCHMARKS_DIR / f'bench_{name}.py')}" for name in names)
    bench = commands.add_parser(
        "bench", help="run a benchmark script (needs a source checkout)",
        epilog=f"benchmarks (`laplace-passes bench NAME --help` for each one's arguments):\n{listed}" if names else
        f"no benchmark scripts at {BENCHMARKS_DIR}: `bench` runs from a source checkout")
    bench.add_argument("name", metavar="NAME", help=f"one of: {', '.join(names)}" if names else "benchmark name")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    bench.set_defaults(run=_run_bench)


def available_benchmarks() -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in BENCHMARKS_DIR.glob("bench_*.py"))


def _first_line(script: Path) -> str:
    """The first line of a script's docstring, read without importing it (imports take seconds)."""
    docstring = ast.get_docstring(ast.parse(script.read_text())) or ""
    return docstring.strip().splitlines()[0] if docstring.strip() else ""


def _run_bench(args) -> int:
    names = available_benchmarks()
    if not names:
        raise LookupError(f"no benchmark scripts at {BENCHMARKS_DIR}: `bench` runs from a source checkout")
    if args.name not in names:
        raise ValueError(f"unknown benchmark {args.name!r}; available: {', '.join(names)}")
    command = [sys.executable, "-m", f"benchmarks.bench_{args.name}", *args.args]
    return subprocess.run(command, cwd=BENCHMARKS_DIR.parent, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
