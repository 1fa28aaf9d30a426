"""Quality and speed of NAR models side by side on the code-summary task's test split.

Per model: BLEU and chrF (sacrebleu) against the teacher's summaries and against the original docstrings, exact
match with the teacher; sequential decoder passes per output; latency at batch 1 and throughput at batch 32; and
speedups against the AR student and, when given, the AR teacher, measured in the same run. Latency is timed one
example at a time with the models interleaved (example 1 through every model and the teacher, then example 2, ...),
so that a slow spell of a noisy machine falls on all of them alike; a speedup is the baseline's total time over the
model's, on the same examples.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from accelgen.nar.backbone import MethodModel
from accelgen.nar.tokens import UNK, pad_sequences


@dataclass
class ModelRun:
    name: str
    model: MethodModel
    generate: Callable[[torch.Tensor, torch.Tensor], list[list[int]]]  # (src (B, S), src_mask (B, S)) -> ids
    scorer: MethodModel | None = None  # the AR model that rescores candidates (noisy parallel decoding)
    outputs: list[list[int]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # seconds per example, batch 1
    passes: list[int] = field(default_factory=list)  # sequential decoder passes per example, batch 1
    throughput: float = 0.0  # examples per second at batch_size


@dataclass
class TeacherRun:
    """The AR teacher the targets came from: a full LLM answering the distillation request for an example."""

    name: str
    answer: Callable[[list[int]], list[dict]]  # test example indices -> their answer records (train/regenerate.py)
    texts: list[str] = field(default_factory=list)  # its summaries of the latency examples
    latencies: list[float] = field(default_factory=list)
    passes: list[int] = field(default_factory=list)  # forwards: one per answer token (the prefill gives the first)
    throughput: float = 0.0  # examples per second over one batch of batch_size


def teacher_run(name: str, model, tokenizer, examples: list, settings) -> TeacherRun:
    """The teacher answering examples (data.Example) as `accelgen nar distill` asked it (settings: a
    RegenerateSettings; its batch_size is ignored, each call being one batch)."""
    from accelgen.datasets import prompt_token_ids
    from accelgen.nar.task import summary_prompts
    from accelgen.train.regenerate import answer_batch

    prompts = summary_prompts(examples, "test")
    token_ids = [prompt_token_ids(tokenizer, prompt, settings.prompt_format) for prompt in prompts]
    return TeacherRun(name, lambda indices: answer_batch(model, tokenizer, [prompts[i] for i in indices],
                                                         [token_ids[i] for i in indices], settings))


@contextlib.contextmanager
def counted_decoder_passes(model: nn.Module):
    """Yields a one-item list holding how many times any Transformer decoder stack in model ran a forward: the
    sequential passes decoding takes (the AR student's one per token, Mask-Predict's one per iteration, the latent
    model's steps and the token pass of the Latent Transformer, ...)."""
    count = [0]
    hooks = [module.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
             for module in model.modules() if isinstance(module, nn.TransformerDecoder)]
    try:
        yield count
    finally:
        for hook in hooks:
            hook.remove()


def noisy_parallel_runs(runs: list[ModelRun], samples: int) -> list[ModelRun]:
    """A "+npd" run beside each run whose method has noisy parallel decoding (NAT and the methods built on it,
    FlowSeq), its candidates rescored by the AR student's run in one batched pass; none without an AR run."""
    from accelgen.nar import flowseq, nat

    student = next((run.model for run in runs if run.model.method == "ar"), None)
    if student is None:
        return []
    added = []
    for run in runs:
        decode = flowseq.noisy_parallel_decode if isinstance(run.model, flowseq.FlowSeqModel) else \
            nat.noisy_parallel_decode if isinstance(run.model, nat.NATModel) else None
        if decode is not None:
            def generate(src, mask, model=run.model, decode=decode):
                return decode(model, src, mask, student.sequence_log_probs, samples=samples,
                              generator=torch.Generator().manual_seed(0)).sequences

            added.append(ModelRun(f"{run.name}+npd", run.model, generate, scorer=student))
    return added


def batches(rows: dict[str, torch.Tensor], size: int):
    """(src (b, S'), src_mask (b, S')) of consecutive rows, each cut to the widest source it holds."""
    for start in range(0, len(rows["src"]), size):
        src, mask = rows["src"][start:start + size], rows["src_mask"][start:start + size]
        width = max(int(mask.sum(dim=1).max()), 1)
        yield src[:, :width], mask[:, :width]


@torch.no_grad()
def measure(runs: list[ModelRun], rows: dict[str, torch.Tensor], latency_examples: int, batch_size: int = 32,
            progress: Callable[[str], None] | None = None, teacher: TeacherRun | None = None) -> None:
    """Fill each run's outputs (every row, at batch_size), throughput, and latency and passes (the first
    latency_examples rows, one at a time, the runs interleaved); and the teacher's throughput over the first
    batch_size rows and its latency, passes and summaries on the latency examples, interleaved with the runs."""
    from accelgen.nar.task import teacher_line

    for run in runs:
        if progress:
            progress(f"{run.name}: batch {batch_size}")
        run.generate(*next(batches(rows, 1)))  # warm-up: first-call allocations are no model's cost
        started = time.perf_counter()
        run.outputs = [output for src, mask in batches(rows, batch_size) for output in run.generate(src, mask)]
        run.throughput = len(run.outputs) / (time.perf_counter() - started)
    if teacher is not None:
        if progress:
            progress(f"{teacher.name}: batch {batch_size}")
        teacher.answer([0])  # warm-up
        batch = list(range(min(batch_size, len(rows["src"]))))
        started = time.perf_counter()
        teacher.answer(batch)
        teacher.throughput = len(batch) / (time.perf_counter() - started)
    for index, (src, mask) in enumerate(batches(rows, 1)):
        if index >= latency_examples:
            break
        if progress:
            progress(f"latency: example {index + 1}/{latency_examples}")
        for run in runs:
            with counted_decoder_passes(nn.ModuleList([run.model] + ([run.scorer] if run.scorer else []))) as count:
                started = time.perf_counter()
                run.generate(src, mask)
                run.latencies.append(time.perf_counter() - started)
            run.passes.append(count[0])
        if teacher is not None:
            started = time.perf_counter()
            record = teacher.answer([index])[0]
            teacher.latencies.append(time.perf_counter() - started)
            teacher.passes.append(len(record["answer_token_ids"]))
            teacher.texts.append(teacher_line(record["answer"]))


def quality(texts: list[str], teacher: list[str] | None, docstrings: list[str]) -> dict:
    """BLEU and chrF against the docstrings and, on the first len(teacher) texts, against the teacher's summaries
    (when given); exact match with the teacher."""
    import sacrebleu

    scores = {"bleu_docstring": sacrebleu.corpus_bleu(texts, [docstrings[:len(texts)]]).score,
              "chrf_docstring": sacrebleu.corpus_chrf(texts, [docstrings[:len(texts)]]).score}
    if teacher:
        texts = texts[:len(teacher)]
        teacher = teacher[:len(texts)]
        scores.update(bleu_teacher=sacrebleu.corpus_bleu(texts, [teacher]).score,
                      chrf_teacher=sacrebleu.corpus_chrf(texts, [teacher]).score,
                      exact_match_teacher=100 * sum(text.strip() == summary.strip()
                                                    for text, summary in zip(texts, teacher)) / len(texts))
    return scores


def timing(run: ModelRun | TeacherRun) -> dict:
    return {"passes_mean": sum(run.passes) / max(len(run.passes), 1),
            "latency_ms_mean": 1000 * sum(run.latencies) / max(len(run.latencies), 1),
            "throughput_batch": run.throughput, "latency_examples": len(run.latencies)}


def speedups(run: ModelRun | TeacherRun, base: ModelRun | TeacherRun) -> tuple[float, float]:
    """(batch-1 latency, batch throughput) of run over base's, on the same examples."""
    return sum(base.latencies) / sum(run.latencies), run.throughput / base.throughput


def summarise(runs: list[ModelRun], decode: Callable[[list[int]], str], teacher: list[str] | None,
              docstrings: list[str], baseline: str = "ar", teacher_run: TeacherRun | None = None) -> list[dict]:
    """One row per run: quality, passes, latency, throughput, and speedups against the run named baseline and the
    teacher; then the teacher's row (its quality against the docstrings of the latency examples it answered)."""
    base = next((run for run in runs if run.name == baseline), None)
    rows = []
    for run in runs:
        texts = [decode(output) for output in run.outputs]
        row = {"model": run.name, "method": run.model.method,
               "rescored_by": run.scorer.method if run.scorer else None, **quality(texts, teacher, docstrings),
               **timing(run), "examples": len(texts)}
        if base is not None:
            row["speedup_latency"], row["speedup_throughput"] = speedups(run, base)
        if teacher_run is not None:
            row["speedup_teacher_latency"], row["speedup_teacher_throughput"] = speedups(run, teacher_run)
        rows.append(row)
    if teacher_run is not None:
        row = {"model": teacher_run.name, "method": "teacher", "rescored_by": None,
               **quality(teacher_run.texts, None, docstrings), **timing(teacher_run),
               "examples": len(teacher_run.texts), "speedup_teacher_latency": 1.0, "speedup_teacher_throughput": 1.0}
        if base is not None:
            row["speedup_latency"], row["speedup_throughput"] = speedups(teacher_run, base)
        rows.append(row)
    return rows


def rows_of(pairs: list[tuple[str, str]], vocabulary, max_source_len: int) -> dict[str, torch.Tensor]:
    """The sources of (source, summary) pairs encoded for the models (the summaries are references only)."""
    sources = [ids or [UNK] for ids in vocabulary.encode_all([source for source, _ in pairs], max_source_len)]
    src, src_mask = pad_sequences(sources)
    return {"src": src, "src_mask": src_mask}


QUALITY_METRICS = ("bleu_teacher", "chrf_teacher", "bleu_docstring", "chrf_docstring")


def plot_quality_speed(rows: list[dict], path) -> None:
    """Quality against the speedup over the AR student at batch 1, one point per model, one panel per metric the
    rows have (against the teacher's summaries, then the docstrings)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [metric for metric in QUALITY_METRICS if any(metric in row for row in rows)]
    columns = min(len(metrics), 2) or 1
    rows_of_panels = (len(metrics) + columns - 1) // columns
    figure, panels = plt.subplots(rows_of_panels, columns, figsize=(7 * columns, 5 * rows_of_panels), squeeze=False)
    for axes, metric in zip(panels.flat, metrics):
        for row in [row for row in rows if metric in row]:
            axes.scatter(row.get("speedup_latency", 1.0), row[metric])
            axes.annotate(row["model"], (row.get("speedup_latency", 1.0), row[metric]), textcoords="offset points",
                          xytext=(4, 4), fontsize=8)
        axes.axvline(1.0, color="grey", linewidth=0.8)
        axes.set_xlabel("speedup over the AR student (batch 1 latency)")
        axes.set_ylabel(metric.replace("_", " against the ").replace("bleu", "BLEU").replace("chrf", "chrF"))
    for axes in list(panels.flat)[len(metrics):]:
        axes.set_visible(False)
    figure.suptitle("NAR models on code summaries: quality against speed")
    figure.tight_layout()
    from accelgen.atomic import write_atomically

    write_atomically(path, lambda partial: figure.savefig(partial, format="png", dpi=110))
    plt.close(figure)
