"""`accelgen train sot-router`: Skeleton-of-Thought's router (accelgen/skeleton/router.py), a logistic regression on
the model's own features of a question, learning the labels a larger model gives as the paper's prompting router
(accelgen/skeleton/labels.py, cached)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from accelgen.atomic import write_json_atomically
from accelgen.cli.common import FILE_ERRORS, console, load_with_progress, reported_errors, set_threads
from accelgen.cli.flags import Flags, command, flag
from accelgen.cli.train.common import check_device_flag, device_flag, model_flag, out_flag, progress_bar, threads_flag
from accelgen.errors import InputError
from accelgen.skeleton.router import RouterConfig
from accelgen.train.loop import ScaleOut, is_main_process, main_process_first


@dataclass
class SotRouterRun:
    model: str = model_flag("qwen2.5-coder-0.5b", "The model SoT runs on (the router reads its features).")
    weights: Optional[str] = flag("bf16", "Weight format of --model: fp32, bf16, int8 or int4.")
    labeller: str = flag("qwen2.5-coder-1.5b", "The model asked the paper's router prompt, for the labels (the judge "
                                               "of `accelgen bench-sot`).")
    labeller_weights: Optional[str] = flag("bf16", "Weight format of --judge.")
    sharegpt: int = flag(96, "ShareGPT questions to label.", min=0)
    humaneval: int = flag(32, "HumanEval prompts to label.", min=0)
    skip: int = flag(16, "Questions of each dataset left out first (the benchmark's: `accelgen bench-sot`).", min=0)
    labels: Optional[Path] = flag(None, "The labels' cache file (default: OUT/labels.json); a rerun reuses it.")
    out: Path = out_flag("Folder for the router (then: accelgen sot --router OUT).")
    threads: Optional[int] = threads_flag()
    device: Optional[str] = device_flag("Where the judge answers and the model reads the questions: cpu, cuda, "
                                        "cuda:N or auto (default: cpu); the router trains where accelerate puts it.")

    def __post_init__(self):
        check_device_flag(self.device)


def router_questions(run: SotRouterRun) -> tuple[list[str], list[str]]:
    """(questions, the dataset of each): ShareGPT's and HumanEval's after the first `skip` of each."""
    from accelgen.datasets import load_dataset

    questions, sources = [], []
    for name, count in (("sharegpt", run.sharegpt), ("humaneval", run.humaneval)):
        if count:
            texts = [prompt.text for prompt in load_dataset(name, limit=run.skip + count)[run.skip:]]
            questions += texts
            sources += [name] * len(texts)
    if len(questions) < 2:
        raise InputError("ask for at least 2 questions (--sharegpt, --humaneval)")
    return questions, sources


def labelled(run: SotRouterRun, questions: list[str]) -> list[int]:
    from accelgen.skeleton.labels import cached_labels

    labeller, tokenizer = load_with_progress(run.labeller, None, run.labeller_weights, run.device)
    with progress_bar(len(questions), f"labels by {run.labeller}") as show:
        return cached_labels(labeller, tokenizer, questions, run.labels or run.out / "labels.json", run.labeller,
                             progress=lambda done: show({"step": done}, ""))


def sot_router(run: SotRouterRun, config: RouterConfig, scale: ScaleOut) -> None:
    """SoT-R: label questions with a larger model's answer to the paper's router prompt, then fit a router on
    the model's own features of them; held-out accuracy beside always answering the majority label."""
    import torch

    from accelgen.skeleton.router import (SkeletonRouter, held_out_split, question_features, router_accuracy,
                                          train_router)
    from accelgen.models.loading import pytorch_weights

    set_threads(run.threads)
    with reported_errors(FILE_ERRORS):
        questions, sources = router_questions(run)
        started = time.perf_counter()
        with main_process_first():  # the first labels and caches them, the others read the cache
            labels = torch.tensor(labelled(run, questions))
        labelling = time.perf_counter() - started
        model, tokenizer = load_with_progress(run.model, None, pytorch_weights(run.model, run.weights), run.device)
        with progress_bar(len(questions), f"features by {run.model}") as show:
            features = question_features(model, tokenizer, questions, lambda done: show({"step": done}, ""))
        training, held = held_out_split(len(questions), config.held_out, config.seed)
        started = time.perf_counter()
        with torch.random.fork_rng():  # the same untrained router on every process
            torch.manual_seed(config.seed)
            router = SkeletonRouter.for_model(model, run.model, config.threshold)
        with progress_bar(config.steps) as show:
            train_router(router, features[training], labels[training], config,
                         lambda row: show(row, "loss {logistic_loss:.3f}"), scale=scale)
        training_seconds = time.perf_counter() - started
        if not is_main_process():
            return  # the first process evaluates and saves
        router.save(run.out)
        evaluation = {"held_out": router_accuracy(router, features[held], labels[held]),
                      "training": router_accuracy(router, features[training], labels[training]),
                      "suits_sot_by_dataset": {name: [int(label) for label, source in zip(labels, sources)
                                                      if source == name] for name in sorted(set(sources))}}
    write_json_atomically(run.out / "evaluation.json", {
        "model": run.model, "weights": run.weights, "labeller": run.labeller, "config": asdict(config),
        "labelling_seconds": labelling, "training_seconds": training_seconds, **evaluation})
    held_out = evaluation["held_out"]
    console.print(f"held out: accuracy {held_out['accuracy']:.1%} on {held_out['questions']} questions (always the "
                  f"majority label: {held_out['majority_accuracy']:.1%}; balanced {held_out['balanced_accuracy']:.1%})")
    console.print(f"router → {run.out}; use: accelgen sot --model {run.model} --router {run.out} \"...\"")


# the labelling model is --judge, as in bench-sot, which asks it the same router prompt (--labeller: its old name)
sot_router_command = command(sot_router, Flags(SotRouterRun, renamed={"labeller": "--judge",
                                                                      "labeller_weights": "--judge-weights"}),
                             Flags(RouterConfig), Flags(ScaleOut))
