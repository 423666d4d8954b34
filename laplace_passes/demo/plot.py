"""The demo's learning curves as a picture: `laplace-passes demo --plot FILE` (the `plot` extra, matplotlib).

Two panels over the training steps: the training loss of every step, and the
recall accuracy on the evaluation batch (measured every `recall_every` steps
and at the end) against chance.
"""

from __future__ import annotations

import importlib
from pathlib import Path

INSTALL_HINT = "pip install 'laplace_passes[plot]' (or pip install matplotlib)"


def check_can_plot(path: str) -> None:
    """Refuse, before any training, a plot that could not be drawn or written."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        raise ImportError(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}") from None
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise OSError(f"--plot {path}: the directory {parent} does not exist: create it or plot elsewhere")


def plot_curves(result, path: str) -> None:
    """Draw `result`'s (a DemoResult) loss and recall curves into `path` (the format from its suffix)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    steps = list(range(1, len(result.losses) + 1))  # a resumed run's losses include the checkpoint's
    figure, (loss_axes, recall_axes) = plt.subplots(2, 1, sharex=True, figsize=(7, 6))
    loss_axes.plot(steps, result.losses, linewidth=1)
    loss_axes.set_ylabel("training loss")
    loss_axes.set_title(f"MQAR: recall {result.accuracy:.1%} after {steps[-1]} steps")
    recall_axes.plot([step for step, _ in result.recalls], [accuracy for _, accuracy in result.recalls], marker="o")
    recall_axes.axhline(result.chance, linestyle="--", color="gray", label=f"chance {result.chance:.1%}")
    if result.listed_chance is not None:  # above this line the model associates keys with values
        recall_axes.axhline(result.listed_chance, linestyle=":", color="gray",
                            label=f"a random listed value {result.listed_chance:.1%}")
    recall_axes.set_ylim(0, 1)
    recall_axes.set_ylabel("recall accuracy")
    recall_axes.set_xlabel("step")
    recall_axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)

