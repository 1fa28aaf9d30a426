"""`accelgen train speed-model`: a small model whose layers share weights in a cycle, trained from scratch for
SPEED (accelgen/train/speed.py); the same folder then serves `--method speed` and plain decoding."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from accelgen.atomic import write_json_atomically
from accelgen.cli.common import FILE_ERRORS, console, reported_errors, set_threads
from accelgen.cli.flags import Flags, command, flag
from accelgen.cli.train.common import (
    DATASET_HELP,
    HELD_OUT_HELP,
    out_flag,
    progress_bar,
    threads_flag,
)
from accelgen.errors import InputError
from accelgen.train.loop import ScaleOut, is_main_process
from accelgen.train.speed import SpeedModelConfig

REPORT_FILE = "speed_model.json"


@dataclass
class SpeedModelRun:
    tokenizer: str = flag("smollm2-135m", "Tokenizer (and vocabulary) of the new model: embedded name, HF id or folder.")
    dataset: str = flag("sharegpt", DATASET_HELP)
    out: Path = out_flag("Folder for checkpoints and the trained model (an existing checkpoint there is resumed).")
    held_out: int = flag(16, HELD_OUT_HELP)
    threads: Optional[int] = threads_flag()


def speed_model(run: SpeedModelRun, config: SpeedModelConfig, scale: ScaleOut) -> None:
    """Train a shared-cycle model from scratch; held-out perplexity and first-repeat exit agreement at the end."""
    from accelgen.cli.datastore import dataset_texts, load_tokenizer
    from accelgen.models import shared_cycle
    from accelgen.train.layerskip import packed_windows
    from accelgen.train.speed import held_out_metrics, new_model, train_speed_model

    with reported_errors(FILE_ERRORS):
        set_threads(run.threads)
        tokenizer = load_tokenizer(run.tokenizer)
        with console.status("tokenizing …"):
            windows = packed_windows(tokenizer, dataset_texts(run.dataset), config.seq_len,
                                     config.steps * config.batch_size + run.held_out)
        if len(windows) <= run.held_out:
            raise InputError(f"the dataset gave {len(windows)} windows; more than --held-out {run.held_out} are needed")
        held, training = windows[: run.held_out], windows[run.held_out :]
        model = new_model(len(tokenizer), config)
        with progress_bar(config.steps) as show:
            result = train_speed_model(model, training, config, run.out, scale=scale, progress=lambda row: show(
                row, "loss {final_loss:.3f}, exit loss {exit_loss:.3f}, {tokens_per_second:.0f} tokens/s"))
        if not is_main_process():
            return  # the first process evaluates and saves
        with console.status("held-out metrics …"):
            metrics = held_out_metrics(model, held)
        shared_cycle.save(model, tokenizer, run.out)
        write_json_atomically(Path(run.out) / REPORT_FILE, {
            "tokenizer": run.tokenizer, "dataset": run.dataset, "config": asdict(config),
            "parameters": sum(parameter.numel() for parameter in model.parameters()),
            "training_windows": len(training), "training_seconds": result["seconds"],
            "resumed_at": result["resumed_at"], "held_out_windows": run.held_out, "held_out": metrics})
    console.print(f"trained {result['stopped_at'] - result['resumed_at']} steps in {result['seconds']:.0f}s → {run.out}; "
                  f"held out: perplexity {metrics['perplexity']:.1f}, first-repeat exit agrees with the last layer "
                  f"{metrics['exit_agrees_with_last']:.1%}; use --model {run.out} --method speed")


speed_model_command = command(speed_model, Flags(SpeedModelRun),
                              Flags(SpeedModelConfig, renamed={"heads": "--attention-heads"}), Flags(ScaleOut))
