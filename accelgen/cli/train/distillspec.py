"""`accelgen train distillspec`: distil a draft model toward the target on the draft's own generations
(accelgen/train/distill.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console

from accelgen.cli.common import FILE_ERRORS, console, reported_errors
from accelgen.cli.flags import REQUIRED, Flags, command, flag
from accelgen.cli.train.common import (TARGET_HELP, draft_flag, model_flag, out_flag, progress_bar,
                                       target_and_trainable_draft, threads_flag)
from accelgen.train.loop import ScaleOut, is_main_process


@dataclass
class DistillSpecRun:
    model: str = model_flag(REQUIRED, TARGET_HELP)
    draft: str = draft_flag("Draft model to distill (same tokenizer as the target).")
    dataset: str = flag("sharegpt", "Prompts: humaneval, sharegpt or jsonl:FILE (benchmark prompts never train; "
                                    "see docs/distillation.md).")
    out: Path = out_flag("Folder for the distilled draft (then: --method distillspec --draft OUT).")
    divergence: str = flag("fkl", "fkl (KL(target ‖ draft)), rkl (KL(draft ‖ target)) or tvd (total variation).")
    steps: int = flag(40)
    prompts: int = flag(64, "Training prompts, cycled through.")
    held_out: int = flag(8, "Prompts kept out of training, to measure α on before and after.")
    max_new_tokens: int = flag(64, "Tokens the draft generates per prompt, and per held-out prompt when measuring α.",
                               "-n")
    batch_size: int = flag(4, "Sequences per step.")
    learning_rate: float = flag(5e-6)
    train_layers: Optional[int] = flag(None, "Train the draft's last N decoder layers (default: all); embeddings "
                                             "and LM head stay frozen.")
    gamma: int = flag(5, "Draft length when measuring α.")
    dtype: Optional[str] = flag(None, "Dtype of the target (default: its embedded one); the draft trains in float32.")
    seed: int = flag(0)
    threads: Optional[int] = threads_flag()


def distillspec(run: DistillSpecRun, scale: ScaleOut) -> None:
    """DistillSpec: distill the draft toward the target on the draft's own generations; α before and after."""
    from accelgen.drafters.draft_model import check_vocabularies
    from accelgen.train.distill import (acceptance, check_divergence, distill, distillation_prompts, distilled_for,
                                        save_distilled)

    started = time.perf_counter()
    with reported_errors(FILE_ERRORS):
        check_divergence(run.divergence)  # before minutes of loading and measuring
        target_model, tokenizer, draft_model, draft_tokenizer, saved_dtype = target_and_trainable_draft(
            run.model, run.draft, run.dtype, run.threads)
        check_vocabularies(target_model, draft_model)
        training, held = distillation_prompts(run.dataset, tokenizer, run.prompts, run.held_out)

        def measured_acceptance() -> dict:
            return acceptance(target_model, draft_model, tokenizer, held, max_new_tokens=run.max_new_tokens,
                              gamma=run.gamma)

        with console.status(f"α before, on {len(held)} held-out prompts …"):
            before = measured_acceptance()
        with progress_bar(run.steps) as show:
            result = distill(target_model, draft_model, tokenizer, training, steps=run.steps, batch_size=run.batch_size,
                             max_new_tokens=run.max_new_tokens, divergence_name=run.divergence,
                             learning_rate=run.learning_rate, train_layers=run.train_layers, seed=run.seed,
                             progress=lambda row: show(row, "loss {loss:.4f}, {tokens_per_second:.0f} tokens/s"),
                             scale=scale)
        if not is_main_process():
            return  # the first process measures α after and saves
        with console.status("α after …"):
            after = measured_acceptance()
        save_distilled(draft_model.to(saved_dtype), draft_tokenizer, run.out, {
            **distilled_for(target_model, run.model), "draft": run.draft, "dataset": run.dataset,
            "divergence": run.divergence, "steps": run.steps, "batch_size": run.batch_size,
            "max_new_tokens": run.max_new_tokens, "learning_rate": run.learning_rate,
            "train_layers": run.train_layers, "seed": run.seed, "training_prompts": len(training),
            "held_out_prompts": len(held), "taught_tokens": result["taught_tokens"], "losses": result["losses"],
            "training_seconds": result["seconds"], "processes": result["processes"],
            "wall_seconds": time.perf_counter() - started, "gamma": run.gamma, "before": before, "after": after})
    Console().print(f"α on {len(held)} held-out prompts: {before['acceptance_rate']:.1%} → {after['acceptance_rate']:.1%}"
                    f" (τ {before['mean_accepted_tokens']:.2f} → {after['mean_accepted_tokens']:.2f}), "
                    f"trained {run.steps} steps in {result['seconds']:.0f}s")
    console.print(f"distilled draft → {run.out}; use: --method distillspec --draft {run.out}")


distillspec_command = command(distillspec, Flags(DistillSpecRun), Flags(ScaleOut))
