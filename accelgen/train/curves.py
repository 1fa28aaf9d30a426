"""Learning curves of the trained drafters (`accelgen train eagle|medusa --eval-every N`): every N steps, the
training tokens seen so far, the held-out top-1 per draft depth, and tau (tokens per target forward) measured by
generating greedily with the head as it is at that step. They go to `curve.json` in the out folder (atomically,
after every point, and kept across a resumed run), and `curve.png` plots them. A head trained further in a later
session (`--resume-from`) continues its curve there, each session recorded (machine, minutes, tokens), its start
marked in the plot.

tau is measured on a few held-out prompts with a small fixed tree (TAU_TREE) so that a point costs seconds on a
CPU; it is a relative figure for comparing recipes and training lengths, not the method's best tau.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from accelgen.atomic import save_figure_atomically, write_json_atomically
from accelgen.errors import InputError

CURVE_JSON, CURVE_PNG = "curve.json", "curve.png"
TAU_PROMPTS, TAU_PROMPT_TOKENS, TAU_NEW_TOKENS = 2, 48, 24  # held-out windows' beginnings, and tokens generated
TAU_TREE = {"width": 4, "depth": 4, "max_nodes": 8}


def tau_prompts(windows: torch.Tensor) -> list[list[int]]:
    """Prompts for measuring tau: the beginnings of the first held-out windows (count, n)."""
    return [window[:TAU_PROMPT_TOKENS].tolist() for window in windows[:TAU_PROMPTS]]


@torch.no_grad()
def measured_tau(model, tokenizer, prompts: list[list[int]], method: str, head, tree: dict | None = None) -> float:
    """Tokens per target forward when `method` drafts with `head` (saved to a scratch folder) on prompts, greedy."""
    from accelgen.loop import generate

    new_tokens = forwards = 0
    was_training = head.training
    with tempfile.TemporaryDirectory() as folder:
        head.save(folder)
        for prompt in prompts:
            result = generate(model, tokenizer, prompt, method=method, max_new_tokens=TAU_NEW_TOKENS,
                                       heads=folder, **(tree or TAU_TREE))
            new_tokens += result.stats["new_tokens"]
            forwards += result.stats["target_forwards"]
    head.train(was_training)
    return new_tokens / max(forwards, 1)


def held_out_recorder(out, every: int, tokens_per_step: int, label: str, model, tokenizer,
                      held_out_windows: torch.Tensor, method: str, accuracy: Callable[[torch.nn.Module], list[float]],
                      tree: dict | None = None, resumed_from=None, session: dict | None = None) -> "CurveRecorder":
    """A CurveRecorder whose tau is measured with `method` (tree: its options, default TAU_TREE) on the beginnings
    of held-out windows (count, n); resumed_from and session as CurveRecorder's."""
    prompts = tau_prompts(held_out_windows)
    return CurveRecorder(out, every, tokens_per_step, label, accuracy,
                         lambda head: measured_tau(model, tokenizer, prompts, method, head, tree), resumed_from, session)


class CurveRecorder:
    """An on_step(step, drafting_head) callback for the trainers: every `every` steps, a point of the curve.

    A head trained further in a later session (`--resume-from HEAD_DIR`) continues the curve of HEAD_DIR: its points
    and sessions come first, and this session's points count their tokens on from the tokens HEAD_DIR's head had
    seen. Each session is recorded with what the caller says of it (`session`: machine, dataset, ...), its steps,
    tokens and training minutes so far."""

    def __init__(self, out, every: int, tokens_per_step: int, label: str,
                 accuracy: Callable[[torch.nn.Module], list[float]], tau: Callable[[torch.nn.Module], float],
                 resumed_from=None, session: dict | None = None):
        """accuracy(head) -> held-out top-1 per depth; tau(head) -> measured tokens per target forward;
        resumed_from: the folder of the head this run goes on training (None: a new head)."""
        if every < 1:
            raise InputError(f"--eval-every must be >= 1, got {every}")
        self.path = Path(out) / CURVE_JSON
        self.every, self.tokens_per_step, self.label = every, tokens_per_step, label
        self.accuracy, self.tau = accuracy, tau
        earlier = saved_curve(Path(resumed_from) / CURVE_JSON) if resumed_from is not None else {}
        self.earlier_sessions = list(earlier.get("sessions", []))
        self.index = len(self.earlier_sessions)  # this session's
        self.tokens_before = self.earlier_sessions[-1]["tokens_seen"] if self.earlier_sessions else 0
        own = [point for point in saved_curve(self.path).get("points", []) if point.get("session", 0) == self.index]
        self.points = list(earlier.get("points", [])) + own  # own: this session's, where its run was resumed
        self.session = {"session": self.index, **(session or {}),
                        "resumed_from": None if resumed_from is None else Path(resumed_from).name}
        self.started = time.perf_counter()
        self.evaluating = 0.0  # seconds spent on the points, left out of the training time

    def __call__(self, step: int, drafting_head: Callable[[], torch.nn.Module]) -> None:
        if step % self.every:
            return
        began = time.perf_counter()
        if step == 0:  # the head as it starts, just before the first step: the training clock starts here
            self.started, self.evaluating = began, 0.0
        head = drafting_head()
        tokens = step * self.tokens_per_step
        train_seconds = round(began - self.started - self.evaluating, 2)
        point = {"session": self.index, "step": step, "tokens": self.tokens_before + tokens,
                 "train_seconds": train_seconds, "top1_per_depth": [round(value, 4) for value in self.accuracy(head)],
                 "tau": round(self.tau(head), 4)}
        self.evaluating += time.perf_counter() - began
        # a run resumed from its checkpoint replaces this session's points from where it resumed
        self.points = [kept for kept in self.points
                       if kept.get("session", 0) != self.index or kept["step"] < step] + [point]
        self.session.update(steps=step, tokens=tokens, tokens_seen=self.tokens_before + tokens,
                            train_minutes=round(train_seconds / 60, 2))
        write_json_atomically(self.path, {"label": self.label, "tokens_per_step": self.tokens_per_step,
                                          "tau_prompts": TAU_PROMPTS, "tau_new_tokens": TAU_NEW_TOKENS,
                                          "tau_tree": TAU_TREE, "sessions": self.earlier_sessions + [self.session],
                                          "points": self.points})

    def plot(self) -> str:
        """curve.png beside curve.json; a message saying what was written, or why not."""
        return plot_curves({self.label: self.points}, self.path.with_name(CURVE_PNG))


def saved_curve(path: Path) -> dict:
    """An earlier run's curve.json at path, {} if none (or unreadable: it is written again)."""
    try:
        curve = json.loads(path.read_text())
        return curve if isinstance(curve, dict) and isinstance(curve.get("points"), list) else {}
    except (OSError, ValueError):
        return {}


def plot_curves(curves: dict[str, list[dict]], path) -> str:
    """A plot of curves (label -> points) at path: held-out top-1 at depth 1 and 3, and tau, against training
    tokens. Needs matplotlib (the `bench` extra): without it, a message saying so and nothing written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no plot: matplotlib is not installed (pip install 'accelgen[bench]'); the curve is in {CURVE_JSON}"
    figure, (accuracy, tau) = plt.subplots(1, 2, figsize=(11, 4))
    for index, (label, points) in enumerate(curves.items()):
        tokens, color = [point["tokens"] for point in points], f"C{index}"  # one color per run, in both panels
        for depth, style in ((0, "-"), (2, ":")):
            values = [point["top1_per_depth"][depth] if len(point["top1_per_depth"]) > depth else None
                      for point in points]
            if any(value is not None for value in values):
                accuracy.plot(tokens, values, style, color=color, marker="o", label=f"{label}, depth {depth + 1}")
        tau.plot(tokens, [point["tau"] for point in points], color=color, marker="o", label=label)
        for later, earlier in zip(points[1:], points):  # where a later session went on training the head
            if later.get("session", 0) != earlier.get("session", 0):
                for axes in (accuracy, tau):
                    axes.axvline(later["tokens"], color=color, alpha=0.3, linestyle="--")
    accuracy.set(xlabel="training tokens", ylabel="held-out top-1", title="Top-1 per draft depth")
    tau.set(xlabel="training tokens", ylabel="tokens per target forward", title="Measured tau (greedy)")
    for axes in (accuracy, tau):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    save_figure_atomically(figure, path, dpi=110)
    plt.close(figure)
    return f"plot → {path}"
