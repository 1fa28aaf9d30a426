"""`accelgen train nar`: a non-autoregressive model (or the AR student) on the code-summary task (accelgen/nar/)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from accelgen.atomic import write_json_atomically
from accelgen.cli.common import console, reported_errors, set_threads
from accelgen.cli.flags import REQUIRED, Flags, command, flag
from accelgen.nar.train import TrainSettings
from accelgen.train.loop import ScaleOut, is_main_process


@dataclass
class NARRun:
    method: str = flag(REQUIRED, "ar, nat, enat, refine, mask-predict, nat-crf, sat, synst, latent, flowseq, "
                                 "bert-nar or curriculum (`accelgen nar methods`).")
    task: Path = flag(REQUIRED, "A folder made by `accelgen nar data` (and `accelgen nar distill`).")
    out: Path = flag(REQUIRED, "Folder for the model (and its checkpoint: a rerun resumes).")
    target: str = flag("teacher", "Train on the teacher's summaries (sequence-level distillation) or the original "
                                  "docstrings.")
    examples: int = flag(0, "Train on the first N training examples only (0: all).", min=0)
    option: Optional[list[str]] = flag(None, "Method option NAME=VALUE (repeatable), e.g. group_size=4 for sat.", "-o")
    width: int = flag(256, "Backbone width.", min=8)
    heads: int = flag(4, "Attention heads per layer.", min=1)
    encoder_layers: int = flag(3, "Encoder layers.", min=1)
    decoder_layers: int = flag(3, "Decoder layers.", min=1)
    feedforward: int = flag(1024, "Width of each layer's feed-forward block.", min=8)
    max_source_len: int = flag(256, "Source tokens the encoder reads (longer functions are cut).", min=8)
    max_target_len: int = flag(32, "Summary tokens (longer summaries are cut).", min=2)
    dropout: float = flag(0.1, "Dropout while training.")
    threads: Optional[int] = flag(None, "torch CPU threads (default: torch's).", min=1)


def train_nar(run: NARRun, settings: TrainSettings, scale: ScaleOut) -> None:
    """A NAR model or the AR student on the code-summary task: progress, atomic checkpoints (a rerun resumes
    exactly), the held-out loss on the valid split, then the model folder for `accelgen nar generate/bench`."""
    from accelgen.cli.nar import parse_options
    from accelgen.cli.train.common import progress_bar
    from accelgen.nar.backbone import BackboneConfig
    from accelgen.nar.catalog import nar_method, new_model, save_trained
    from accelgen.nar.task import load_task
    from accelgen.nar.train import train_model

    set_threads(run.threads)
    with reported_errors():
        method = nar_method(run.method)
        options = parse_options(method.load_class().__init__, run.option or [], f"method {run.method}")
        with console.status(f"reading the task in {run.task} …"):
            task = load_task(run.task)
            limits = dict(max_source_len=run.max_source_len, max_target_len=run.max_target_len)
            rows = task.rows("train", run.target, limit=run.examples or None, **limits)
            held_out = task.rows("valid", run.target, limit=512, **limits)
        config = BackboneConfig(vocab_size=len(task.vocabulary), width=run.width, heads=run.heads,
                                encoder_layers=run.encoder_layers, decoder_layers=run.decoder_layers,
                                feedforward=run.feedforward, dropout=run.dropout, **limits)
        model = new_model(run.method, config, options, rows, task.vocabulary)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    console.print(f"{run.method}: {parameters / 1e6:.1f}M parameters, {len(rows['src']):,} training pairs "
                  f"({run.target} summaries), {settings.steps} steps of {settings.batch_size}")
    run.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with reported_errors(), progress_bar(settings.steps, f"training {run.method}") as show:
        result = train_model(model, rows, settings, held_out=held_out, checkpoint=run.out / "checkpoint.pt",
                             scale=scale, progress=lambda row: show(row, "loss {loss:.3f}"))
    if not is_main_process():
        return
    save_trained(model, run.out, task.vocabulary)
    write_json_atomically(run.out / "training.json", {
        "method": run.method, "options": model.options(), "target": run.target, "task": str(run.task),
        "training_pairs": len(rows["src"]), "parameters": parameters, "settings": asdict(settings),
        "held_out_loss": result["held_out"], "training_seconds": result["seconds"],
        "wall_seconds": time.perf_counter() - started, "resumed_at": result["resumed_at"]})
    losses = result["held_out"]
    console.print(f"held-out loss {losses[0][1]:.3f} → {losses[-1][1]:.3f} (valid split) in "
                  f"{result['seconds']:.0f}s of training → {run.out}; use: accelgen nar generate --model {run.out} "
                  f"\"def f(x): ...\"")


nar_command = command(train_nar, Flags(NARRun, renamed={"heads": "--attention-heads"}), Flags(TrainSettings),
                      Flags(ScaleOut))
