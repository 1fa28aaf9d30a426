"""What the trainer commands share: their common flags, a progress bar fed by the trainers' progress rows, and
a model with token windows (or hidden states) of a dataset to train on."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

from accelgen.atomic import write_json_atomically
from accelgen.cli.common import console, set_threads
from accelgen.cli.flags import REQUIRED, flag
from accelgen.errors import InputError
from accelgen.train.loop import is_main_process, main_process_first, training_device

TARGET_WEIGHTS_HELP = ("Weight format of the frozen target: fp32, bf16, int8 or int4 (weight-only quantized). "
                       "What is trained learns the target as loaded: use it with the target in the same format.")
FROZEN_DTYPE_HELP = "Dtype of the frozen model (default: its embedded one)."
DATASET_HELP = "sharegpt, jsonl:FILE or regenerated:DIR (`accelgen data regenerate`); several joined by commas."
HELD_OUT_HELP = "Further windows kept out of training, to evaluate on."
TARGET_HELP = "Target: embedded name, HF id or local folder."  # where a draft model is trained for it
EXTRACT_FORMATS = ("auto", "fp32", "bf16")
EXTRACT_FORMAT_HELP = ("Format the frozen target extracts features (and trains) in, where --dtype and --weights are "
                       "not given: auto (the faster prefill on this machine, as measured, else by its bf16 support; "
                       "a feature store being resumed keeps its own), fp32 or bf16.")
FEATURE_STORE = "features"  # the sharded feature stores in the --features folder, one per extractor


def model_flag(default: Any = "smollm2-135m", help: str = "Embedded name, HF id or local folder.") -> Any:
    return flag(default, help, "-m")


def features_flag(sharing: str) -> Any:
    return flag(None, f"Folder of the target's feature cache (default: --out); {sharing} run's folder shares its cache.")


def draft_flag(help: str) -> Any:
    return flag(REQUIRED, help, "-d")


def out_flag(help: str) -> Any:
    return flag(REQUIRED, help)  # no -o: that is --option, a method option, in every command


def threads_flag() -> Any:
    return flag(None, "torch CPU threads (default: torch's).", min=1)


def device_flag(help: str) -> Any:
    """--device of a trainer whose models also run outside the training loop (which runs where accelerate puts
    it); `help` says which models and the default."""
    return flag(None, help)


def check_device_flag(device: str | None) -> None:
    """A --device that is not there, refused as the flags are read (a ValueError: exit status 2)."""
    from accelgen.models.loading import resolve_device

    if device is not None:
        resolve_device(device)


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
    extract_format: str = flag("auto", EXTRACT_FORMAT_HELP)

    def __post_init__(self):
        if self.extract_format not in EXTRACT_FORMATS:
            raise InputError(f"--extract-format {self.extract_format}: choose one of {', '.join(EXTRACT_FORMATS)}")


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
        raise InputError(f"layer {count - 1} is the last layer: it needs no exit head")
    with console.status(f"hidden states of {data.numel():,} positions at layers {chosen} …"):
        return (target_model, chosen, collect_hidden_states(target_model, data[held_out:], chosen),
                collect_hidden_states(target_model, data[:held_out], chosen))


def model_and_windows(model: str, dtype: str | None, dataset: str, seq_len: int, windows: int, held_out: int,
                      threads: int | None, weights: str | None = None):
    """(model on this process's training device, tokenizer, windows + held_out packed windows of the dataset, the
    held-out ones first)."""
    from accelgen.cli.datastore import dataset_texts
    from accelgen.models import load_model
    from accelgen.models.loading import pytorch_weights
    from accelgen.train.layerskip import packed_windows

    if weights not in (None, "fp32", "bf16", "int8", "int4"):
        raise InputError(f"--weights {weights}: training needs the PyTorch model; choose fp32, bf16, int8 or int4")
    set_threads(threads)
    texts = dataset_texts(dataset)  # a dataset that is not there is named before the model loads
    for part in dataset.split(","):
        if part.startswith("regenerated:"):
            note_regenerated_by(part.removeprefix("regenerated:"), model)
    with console.status(f"loading {model}{f' ({weights})' if weights else ''} …"):
        target_model, tokenizer = load_model(model, dtype=dtype, weights=pytorch_weights(model, weights, dtype),
                                             device=str(training_device()))
    with console.status("tokenizing …"):
        data = packed_windows(tokenizer, texts, seq_len, windows + held_out)
    if len(data) <= held_out:
        raise InputError(f"the dataset gave {len(data)} windows; more than --held-out {held_out} are needed")
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
    tokenizer: Any = None

    def training(self) -> tuple:
        return self.windows[self.held_out:], self.features[self.held_out:], self.choices[self.held_out:]

    def evaluation(self) -> tuple:
        return self.windows[:self.held_out], self.features[:self.held_out], self.choices[:self.held_out]


def note_regenerated_by(folder: str, model: str) -> None:
    """Say so where the regenerated data was answered by another model than the one trained for."""
    from accelgen.datasets.regenerated import regenerated_settings

    settings = regenerated_settings(folder)
    if settings is not None and settings["model"] != model:
        console.print(f"note: the answers in {folder} were made by {settings['model']}, not {model}")


def feature_store(run: FeaturesRun, extractor: str) -> Path:
    """The folder of the run's feature store for one extractor ("last-hidden": EAGLE's and Medusa's)."""
    return Path(run.features or run.out) / FEATURE_STORE / extractor


def extraction_format(run: FeaturesRun, extractor: str) -> tuple[str | None, str]:
    """(weights to load the target in, or None for --dtype/--weights, why): --extract-format, where auto is the
    format of a store being resumed, else the faster prefill on this machine (accelgen/train/shards.py)."""
    from accelgen.train.shards import FeatureStore, prefill_format

    if run.dtype is not None or run.weights is not None:
        return None, "as --dtype/--weights load it"
    if run.extract_format != "auto":
        return run.extract_format, "--extract-format"
    stored = FeatureStore.saved_identity(feature_store(run, extractor))
    if stored is not None and stored.get("format") in ("fp32", "bf16"):
        return stored["format"], "the format of the feature store being resumed"
    return prefill_format(run.model, run.threads)


def target_features(run: FeaturesRun, target_model, data, extractor: str, extract: Callable,
                    described: dict | None = None) -> dict:
    """{name: tensor (count, ...)}: extract(window batch (b, n)) -> {name: tensor (b, ...)} over the run's windows
    data (count, n), kept in the sharded feature store of the --features folder for this extractor (resumed where
    a run stopped, refused where it belongs to another model, format, dataset, window length or `described`)."""
    from accelgen.costs import model_format, model_key
    from accelgen.train.shards import stored_features

    identity = {"extractor": extractor, "model": run.model, "model_shape": model_key(target_model),
                "format": model_format(target_model), "dataset": run.dataset, "seq_len": run.seq_len,
                **(described or {})}
    with main_process_first(), progress_bar(len(data), f"target features of windows ({extractor})") as show:
        return stored_features(feature_store(run, extractor), identity, data, extract,
                               progress=lambda done: show({"step": done}, ""))


def windows_and_features(run: FeaturesRun, layers_for: Callable | None = None) -> FeatureWindows:
    """The run's target, windows, and the target's features of them with its next-token choices, in the
    --features folder's sharded feature store, extracted in the faster format where none is asked for.

    The features are the target's last hidden states (EAGLE, Medusa), or with layers_for(target) -> layer indices,
    the residual stream entering those layers side by side (EAGLE-3)."""
    from accelgen.train import eagle

    extractor = "last-hidden" if layers_for is None else "layer-states"
    weights, why = extraction_format(run, extractor)
    if weights is not None:
        console.print(f"features extracted in {weights}: {why}")
    target_model, tokenizer, data = model_and_windows(run.model, run.dtype, run.dataset, run.seq_len, run.windows,
                                                      run.held_out, run.threads, weights or run.weights)
    if layers_for is None:
        layers, described = None, None
        collect = partial(eagle.collect_features, target_model)
    else:
        layers = tuple(int(layer) for layer in layers_for(target_model))
        described = {"layers": list(layers)}
        collect = partial(eagle.collect_layer_states, target_model, layers=layers)
    features = target_features(run, target_model, data, extractor,
                               lambda windows: dict(zip(("features", "choices"), collect(windows))), described)
    return FeatureWindows(target_model, data, features["features"], features["choices"], run.held_out, tokenizer)


def trained_head(run: FeaturesRun, data: FeatureWindows, config, train: Callable, status: str, scale=None):
    """(head, times): the head that train(target, windows, features, choices, config=, out_dir=, progress=,
    scale=) -> (head, times) fits to the windows held in, checkpointed in and saved to --out for the run's model
    (by the first process, where several train it)."""
    with progress_bar(config.steps) as show:
        head, times = train(data.target_model, *data.training(), config=config, out_dir=run.out,
                            progress=lambda row: show(row, status), scale=scale)
    head.base_model = run.model
    if is_main_process():
        head.save(run.out)
    return head, times


def save_evaluation(run: WindowsRun, config, times: dict, evaluation: dict) -> None:
    """--out/evaluation.json: the held-out evaluation, with the config and the training's times."""
    write_json_atomically(Path(run.out) / "evaluation.json", {
        "held_out_windows": run.held_out, "config": asdict(config), "training_seconds": times["seconds"],
        "resumed_at": times["resumed_at"], "processes": times.get("processes", 1), **evaluation})


def target_and_trainable_draft(model: str, draft: str, dtype: str | None, threads: int | None,
                               device: str | None = None):
    """The target (in dtype) and the draft model on `device` (None: the training device), the draft in float32 to
    train; (target, tokenizer, draft, the draft's tokenizer, the dtype to save the draft in)."""
    from accelgen.models import load_model
    from accelgen.models.loading import pytorch_weights

    set_threads(threads)
    device = device or str(training_device())
    with console.status(f"loading {model} and {draft} on {device} …"):
        target_model, tokenizer = load_model(model, dtype=dtype, weights=pytorch_weights(model, None, dtype),
                                             device=device)
        draft_model, draft_tokenizer = load_model(draft, weights=pytorch_weights(draft, None), device=device)
    saved_dtype = draft_model.dtype  # the trained draft is saved as the original was
    draft_model.float()  # it trains in place: float32 keeps small updates
    return target_model, tokenizer, draft_model, draft_tokenizer, saved_dtype
