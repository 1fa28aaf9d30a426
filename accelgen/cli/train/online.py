"""`accelgen train online`: stream requests through `online` and watch the draft's acceptance rise
(accelgen/train/online.py)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rich.console import Console

from accelgen.atomic import save_pretrained_atomically, write_json_atomically
from accelgen.cli.common import FILE_ERRORS, console, reported_errors
from accelgen.cli.flags import REQUIRED, Flags, command, flag
from accelgen.cli.train.common import (TARGET_HELP, check_device_flag, device_flag, draft_flag, model_flag, out_flag,
                                       progress_bar, target_and_trainable_draft, threads_flag)
from accelgen.errors import InputError


@dataclass
class OnlineRun:
    model: str = model_flag(REQUIRED, TARGET_HELP)
    draft: str = draft_flag("Draft model, updated as the requests stream by.")
    dataset: str = flag("humaneval", "The stream of requests, in order: humaneval, sharegpt, specbench:FILE or "
                                     "jsonl:FILE.")
    out: Path = out_flag("Folder for online.json, online.png (and --save-draft).")
    requests: int = flag(40, "Requests in the stream.")
    interval: int = flag(5, "Update the draft after every N requests.")
    max_new_tokens: int = flag(64, "Tokens generated per request.", "-n")
    gamma: int = flag(5, "Draft length.")
    update_steps: int = flag(4, "AdamW steps per update.")
    learning_rate: float = flag(1e-5)
    divergence: str = flag("fkl", "fkl, rkl or tvd.")
    buffer_size: int = flag(512, "Rejected positions kept between updates.")
    target_top_k: int = flag(32, "Tokens of the target's distribution kept per position.")
    train_layers: Optional[int] = flag(None, "Train the draft's last N decoder layers (default: all).")
    baseline: bool = flag(False, "Also run each request with an untouched copy of the draft (speculative): α without "
                                 "learning (twice the time).")
    save_draft: bool = flag(False, "Save the updated draft into OUT/draft.")
    dtype: Optional[str] = flag(None, "Dtype of the target (default: its embedded one); the draft runs and trains in "
                                      "float32.")
    threads: Optional[int] = threads_flag()
    device: Optional[str] = device_flag("Where the target and the draft run, and the draft learns: cpu, cuda, cuda:N "
                                        "or auto (default: this machine's GPU if it has one, else the CPU).")

    def __post_init__(self):
        check_device_flag(self.device)


def online(run: OnlineRun) -> None:
    """Online speculative decoding over a stream of requests: α per request as the draft learns (JSON + plot)."""
    from accelgen.datasets import load_dataset, prompt_token_ids
    from accelgen.train.distill import check_divergence
    from accelgen.train.online import OnlineLearner, moving_average, plot_acceptance, stream_requests

    out, interval = Path(run.out), run.interval
    with reported_errors(FILE_ERRORS):
        check_divergence(run.divergence)
        stream = load_dataset(run.dataset, limit=run.requests)
        if not stream:
            raise InputError(f"dataset {run.dataset!r} has no prompts")
        target_model, tokenizer, draft_model, draft_tokenizer, saved_dtype = target_and_trainable_draft(
            run.model, run.draft, run.dtype, run.threads, run.device)
        baseline_draft = copy.deepcopy(draft_model) if run.baseline else None
        learner = OnlineLearner()
        learning = dict(interval=interval, update_steps=run.update_steps, learning_rate=run.learning_rate,
                        divergence=run.divergence, buffer_size=run.buffer_size, target_top_k=run.target_top_k,
                        train_layers=run.train_layers)
        with progress_bar(len(stream), "requests") as show:
            rows = stream_requests(target_model, draft_model, tokenizer,
                                   [prompt_token_ids(tokenizer, prompt) for prompt in stream], learner,
                                   max_new_tokens=run.max_new_tokens, gamma=run.gamma, baseline_draft=baseline_draft,
                                   progress=lambda row: show(row, "α {acceptance_rate:.0%}, {updates} updates"),
                                   **learning)
        for row, prompt in zip(rows, stream):
            row["id"] = prompt.id
        out.mkdir(parents=True, exist_ok=True)
        average = moving_average([row["acceptance_rate"] for row in rows], interval)
        write_json_atomically(out / "online.json", {
            "model": run.model, "draft": run.draft, "dataset": run.dataset, "requests": len(rows),
            "max_new_tokens": run.max_new_tokens, "gamma": run.gamma, **learning,
            "first_requests_acceptance": average[min(interval, len(rows)) - 1],
            "last_requests_acceptance": average[-1], "updates": learner.updates, "rows": rows})
        plot_acceptance(rows, out / "online.png", interval)
        if run.save_draft:
            save_pretrained_atomically(out / "draft", draft_model.to(saved_dtype), draft_tokenizer)
    Console().print(f"α, mean of {interval} requests: first {average[min(interval, len(rows)) - 1]:.1%}, last "
                    f"{average[-1]:.1%} ({len(learner.updates)} updates over {len(rows)} requests)")
    console.print(f"→ {run.out}/online.json, {run.out}/online.png"
                  + (f"; updated draft: {run.out}/draft" if run.save_draft else ""))


online_command = command(online, Flags(OnlineRun))
