"""What the trainer commands share: their common flags, a progress bar fed by the trainers' progress rows, and
a model with token windows (or hidden states) of a dataset to train on."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from accelgen.atomic import write_json_atomically
from accelgen.cli.common import FILE_ERRORS, console, reported_errors, set_threads
from accelgen.cli.flags import REQUIRED, flag

TARGET_WEIGHTS_HELP = ("Weight format of the frozen target: fp32, bf16, int8 or int4 (weight-only quantized). "
                       "What is trained learns the target as loaded: use it with the target in the same format.")
FROZEN_DTYPE_HELP = "Dtype of the frozen model (default: its embedded one)."
DATASET_HELP = "sharegpt or jsonl:FILE."
HELD_OUT_HELP = "Further windows kept out of training, to evaluate on."
TARGET_HELP = "Target: embedded name, HF id or local folder."  # where a draft model is trained for it


def model_flag(default: Any = "smollm2-135m", help: str = "Embedded name, HF id or local folder.") -> Any:
    return flag(default, help, "-m")


def features_flag(sharing: str) -> Any:
    return flag(None, f"Folder of the target's feature cache (default: --out); {sharing} run's folder shares its cache.")


def draft_flag(help: str) -> Any:
    return flag(REQUIRED, help, "-d")


def out_flag(help: str) -> Any:
    return flag(REQUIRED, help, "-o")


def threads_flag() -> Any:
    return flag(None, "torch CPU threads (default: torch's).", min=1)


@dataclass
class WindowsRun:
    """The flags of a trainer on token windows of a dataset (each trainer says what its --out folder holds)."""

    model: str = model_flag()
    dataset: str = flag("sharegpt", DATASET_HELP)
    out: Path = out_flag("Folder for what is trained.")
    windows: int = flag(64, "Windows of --seq-len tokens whose hidden states are kept.")
    held_out: int = flag(8, HELD_OUT_HELP)
    seq_len: int = flag(128)
    threads: Optional[int] = threads_flag()


@dataclass
class FrozenTargetRun(WindowsRun):
    """The flags of a trainer over a frozen target that may be loaded in another dtype or weight format."""

    dtype: Optional[str] = flag(None, FROZEN_DTYPE_HELP)
    weights: Optional[str] = flag(None, TARGET_WEIGHTS_HELP)


@dataclass
class FeaturesRun(FrozenTargetRun):
    """The flags of a head trained on the frozen target's cached features (EAGLE, Medusa)."""

    features: Optional[Path] = features_flag("another head's")
    windows: int = flag(256, "Windows of --seq-len tokens whose features are cached.")
    seq_len: int = flag(256)


@contextlib.contextmanager
def progress_bar(steps: int, description: str = "training"):
    """Yields show(row, status_format): a progress bar fed by the trainers' progress rows; into a log file (not a
    terminal), a plain line every tenth of the run instead."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    if not console.is_terminal:
        every = max(1, steps // 10)

        def show(row: dict, status: str) -> None:
            if row["step"] % every == 0 or row["step"] == steps:
                console.print(f"{description} {row['step']}/{steps}: {status.format(**row)}")

        yield show
        return

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("{task.fields[status]}"), TimeRemainingColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(description, total=steps, status="")
        yield lambda row, status: bar.update(task, completed=row["step"], status=status.format(**row))


def hidden_states_for(model: str, dataset: str, layers: str | None, windows: int, held_out: int, seq_len: int,
                      threads: int | None):
    """(model, exit layers, hidden states for training, hidden states held out) for the exit trainers."""
    from accelgen.exits.calm import check_exit_layers
    from accelgen.train.exit_heads import collect_hidden_states

    target_model, _, data = model_and_windows(model, "float32", dataset, seq_len, windows, held_out, threads)
    count = target_model.config.num_hidden_layers
    chosen = check_exit_layers(None if layers is None else layers.split(","), count)
    if count - 1 in chosen:
        raise ValueError(f"layer {count - 1} is the last layer: it needs no exit head")
    with console.status(f"hidden states of {data.numel():,} positions at layers {chosen} …"):
        return (target_model, chosen, collect_hidden_states(target_model, data[held_out:], chosen),
                collect_hidden_states(target_model, data[:held_out], chosen))


def model_and_windows(model: str, dtype: str | None, dataset: str, seq_len: int, windows: int, held_out: int,
                      threads: int | None, weights: str | None = None):
    """(model, tokenizer, windows + held_out packed windows of the dataset, the held-out ones first)."""
    from accelgen.cli.datastore import dataset_texts
    from accelgen.models import load_model
    from accelgen.train.layerskip import packed_windows

    if weights not in (None, "fp32", "bf16", "int8", "int4"):
        raise ValueError(f"--weights {weights}: training needs the PyTorch model; choose fp32, bf16, int8 or int4")
    set_threads(threads)
    with console.status(f"loading {model}{f' ({weights})' if weights else ''} …"):
        target_model, tokenizer = load_model(model, dtype=dtype, weights=weights)
    with console.status("tokenizing …"):
        data = packed_windows(tokenizer, dataset_texts(dataset), seq_len, windows + held_out)
    if len(data) <= held_out:
        raise ValueError(f"the dataset gave {len(data)} windows; more than --held-out {held_out} are needed")
    return target_model, tokenizer, data


@dataclass
class FeatureWindows:
    """A frozen target with token windows of a dataset and the target's features and next-token choices there;
    the first `held_out` windows are kept out of training."""

    target_model: Any
    windows: Any  # (count, n) long
    features: Any  # (count, n, d)
    choices: Any  # (count, n) long
    held_out: int

    def training(self) -> tuple:
        return self.windows[self.held_out:], self.features[self.held_out:], self.choices[self.held_out:]

    def evaluation(self) -> tuple:
        return self.windows[:self.held_out], self.features[:self.held_out], self.choices[:self.held_out]


def windows_and_features(run: FeaturesRun) -> FeatureWindows:
    """The run's target, windows, and the target's features of them, cached in the --features folder."""
    from accelgen.train.eagle import cached_features

    target_model, _, data = model_and_windows(run.model, run.dtype, run.dataset, run.seq_len, run.windows,
                                              run.held_out, run.threads, run.weights)
    with progress_bar(len(data), "target features of windows") as show:
        cached, choices = cached_features(target_model, data, run.features or run.out,
                                          progress=lambda done: show({"step": done}, ""))
    return FeatureWindows(target_model, data, cached, choices, run.held_out)


def trained_head(run: FeaturesRun, data: FeatureWindows, config, train: Callable, status: str):
    """(head, times): the head that train(target, windows, features, choices, config=, out_dir=, progress=) ->
    (head, times) fits to the windows held in, checkpointed in and saved to --out for the run's model."""
    with progress_bar(config.steps) as show:
        head, times = train(data.target_model, *data.training(), config=config, out_dir=run.out,
                            progress=lambda row: show(row, status))
    head.base_model = run.model
    head.save(run.out)
    return head, times


def train_and_evaluate_head(run: FeaturesRun, config, train: Callable, evaluate: Callable, status: str):
    """(times, evaluation): the trained_head on the run's windows and features, then
    evaluate(target, head, windows, features, choices) on the windows held out."""
    with reported_errors(FILE_ERRORS):
        data = windows_and_features(run)
        head, times = trained_head(run, data, config, train, status)
        return times, evaluate(data.target_model, head, *data.evaluation())


def save_evaluation(run: FeaturesRun, config, times: dict, evaluation: dict) -> None:
    """--out/evaluation.json: the held-out evaluation, with the config and the training's times."""
    write_json_atomically(Path(run.out) / "evaluation.json", {
        "held_out_windows": run.held_out, "config": asdict(config), "training_seconds": times["seconds"],
        "resumed_at": times["resumed_at"], **evaluation})


def target_and_trainable_draft(model: str, draft: str, dtype: str | None, threads: int | None):
    """The target (in dtype) and the draft model, the draft in float32 to train; (target, tokenizer, draft,
    the draft's tokenizer, the dtype to save the draft in)."""
    from accelgen.models import load_model

    set_threads(threads)
    with console.status(f"loading {model} and {draft} …"):
        target_model, tokenizer = load_model(model, dtype=dtype)
        draft_model, draft_tokenizer = load_model(draft)
    saved_dtype = draft_model.dtype  # the trained draft is saved as the original was
    draft_model.float()  # it trains in place: float32 keeps small updates
    return target_model, tokenizer, draft_model, draft_tokenizer, saved_dtype
