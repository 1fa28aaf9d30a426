"""`accelgen train layerskip`: fine-tune so that early exits become accurate (accelgen/train/layerskip.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console

from accelgen.atomic import save_figure_atomically, write_json_atomically
from accelgen.cli.common import FILE_ERRORS, console, reported_errors
from accelgen.cli.flags import Flags, command, flag
from accelgen.cli.train.common import model_and_windows, model_flag, out_flag, progress_bar, threads_flag
from accelgen.train.layerskip import LayerSkipConfig
from accelgen.train.loop import ScaleOut, is_main_process


@dataclass
class LayerSkipRun:
    model: str = model_flag()
    dataset: str = flag("sharegpt", "sharegpt (assistant turns, without the benchmark's sample) or jsonl:FILE.")
    out: Path = out_flag("Folder for checkpoints and the trained model (an existing checkpoint there is resumed).")
    held_out: int = flag(16, "Windows kept out of training to measure exit accuracy.")
    threads: Optional[int] = threads_flag()


def layerskip(run: LayerSkipRun, config: LayerSkipConfig, scale: ScaleOut) -> None:
    """LayerSkip: layer dropout rising with depth + an early-exit loss; exit accuracy per layer before and after."""
    from rich.table import Table

    from accelgen.train.layerskip import exit_accuracy, train_layerskip

    with reported_errors(FILE_ERRORS):
        target_model, tokenizer, windows = model_and_windows(run.model, "float32", run.dataset, config.seq_len,
                                                             config.steps * config.batch_size, run.held_out,
                                                             run.threads)
        held, training = windows[:run.held_out], windows[run.held_out:]
        main = is_main_process()  # the first process evaluates and writes the results
        if main:
            with console.status("exit accuracy before training …"):
                before = exit_accuracy(target_model, held)
        with progress_bar(config.steps) as show:
            result = train_layerskip(target_model, tokenizer, training, config, run.out, scale=scale,
                                     progress=lambda row: show(row, "loss {loss:.3f}, {tokens_per_second:.0f} tokens/s"))
        if not main:
            return
        after = exit_accuracy(target_model, held)
    table = Table("layer", "next token (before)", "next token (after)", "agrees with last (before)",
                  "agrees with last (after)")
    for old, new in zip(before, after):
        table.add_row(str(old["layer"]), f"{old['next_token']:.1%}", f"{new['next_token']:.1%}",
                      f"{old['agrees_with_last']:.1%}", f"{new['agrees_with_last']:.1%}")
    Console().print(table)
    out = run.out
    write_json_atomically(Path(out) / "exit_accuracy.json", {
        "model": run.model, "dataset": run.dataset, "config": asdict(config),
        "training_seconds": result["seconds"], "resumed_at": result["resumed_at"], "held_out_windows": run.held_out,
        "exit_accuracy_before": before, "exit_accuracy_after": after})
    plot_exit_accuracy(before, after, Path(out) / "exit_accuracy.png")
    console.print(f"trained {result['stopped_at'] - result['resumed_at']} steps in {result['seconds']:.0f}s → {out} "
                  f"(use --model {out} --method layerskip); exit accuracy: {out}/exit_accuracy.json, .png")


def plot_exit_accuracy(before: list[dict], after: list[dict], path: Path) -> None:
    """Per layer, how often the exit agrees with the last layer, before and after training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for rows, label in ((before, "before"), (after, "after")):
        axes.plot([r["layer"] for r in rows], [100 * r["agrees_with_last"] for r in rows], marker="o", label=label)
    axes.set_xlabel("exit after layer")
    axes.set_ylabel("top-1 agrees with the last layer (%)")
    axes.set_title("LayerSkip training: early-exit accuracy")
    axes.legend()
    figure.tight_layout()
    save_figure_atomically(figure, path)
    plt.close(figure)


# the CLI's defaults, where they differ from the library's: shorter windows, more often checkpointed
layerskip_command = command(layerskip, Flags(LayerSkipRun),
                            Flags(LayerSkipConfig, defaults={"seq_len": 128, "rotation": 8, "checkpoint_every": 25}),
                            Flags(ScaleOut))
