"""The code-summary task as a folder: what every NAR model trains and is measured on.

    task.json             what was mined (roots, sizes), the split sizes, the vocabulary size
    train.jsonl           the examples of each split (data.Example records), split by package
    valid.jsonl
    test.jsonl
    vocab.json            the compact vocabulary (tokens.Vocabulary), built on the training split's texts
    tokenizer/            the tokenizer whose pieces the vocabulary holds (SmolLM2's), so the folder stands alone
    teacher/<split>/      with `distill_task`: the AR teacher's answers (train/regenerate.py's resumable shards)

Sequence-level knowledge distillation (Kim & Rush 2016), as every NAT paper trains: the targets are the summaries
an autoregressive teacher writes greedily, which are more regular than people's docstrings and so easier for a
model that writes all tokens at once. The original docstring stays as a second reference.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from accelgen.atomic import save_pretrained_atomically, write_json_atomically
from accelgen.errors import InputError
from accelgen.nar.catalog import TOKENIZER_FOLDER, VOCAB_FILE
from accelgen.nar.data import Example, cached_corpus, load_examples, save_examples, split_by_package
from accelgen.nar.tokens import Vocabulary, encode_pairs

TASK_FILE, TEACHER_FOLDER = "task.json", "teacher"
SPLITS = ("train", "valid", "test")
TARGETS = ("teacher", "docstring")
SUMMARY_REQUEST = ("Write the first line of the docstring of this Python function: one short sentence of at most "
                   "12 words that starts with a verb and says what the function does. Reply with that sentence "
                   "only.\n\n```python\n{source}```")
SUMMARY_MAX_NEW_TOKENS = 48  # the teacher's answer budget: a one-line summary, with room for a preamble
# what a teacher's answers were asked with: part of their settings, so a changed request never resumes old answers
REQUEST_NAME = "code-summary-" + hashlib.sha1(SUMMARY_REQUEST.encode()).hexdigest()[:8]
# A small teacher often answers "The function `f` returns ..." however it is asked: the subject is cut, so that the
# summary reads as a docstring's first line ("Returns ...").
TEACHER_SUBJECT = re.compile(r"^(the|this)\s+(python\s+)?(`[\w.]+`\s+)?(function|method)(\s+`[\w.]+`)?\s+"
                             r"(is\s+(designed|used)\s+to\s+)?", re.IGNORECASE)


@dataclass(frozen=True)
class Task:
    folder: Path
    vocabulary: Vocabulary
    splits: dict[str, list[Example]]
    teacher: dict[str, list[str]]  # split -> the teacher's summaries of its first examples (not distilled: absent)

    def pairs(self, split: str, target: str = "teacher", limit: int | None = None) -> list[tuple[str, str]]:
        """(source, summary) of the split's first `limit` examples, the summary the teacher's (of the examples it
        summarised) or the docstring's."""
        if target not in TARGETS:
            raise InputError(f"target must be one of {TARGETS}, got {target!r}")
        examples = self.splits[split][:limit]
        if target == "docstring":
            return [(example.source, example.summary) for example in examples]
        if split not in self.teacher:
            raise InputError(f"{self.folder} has no teacher summaries of its {split} split: run `accelgen nar distill "
                             f"--task {self.folder}` first, or train on --target docstring")
        return [(example.source, summary) for example, summary in zip(examples, self.teacher[split])]

    def rows(self, split: str, target: str, max_source_len: int, max_target_len: int, limit: int | None = None):
        """The split's pairs encoded as the padded rows the trainers read (tokens.encode_pairs)."""
        return encode_pairs(self.vocabulary, self.pairs(split, target, limit), max_source_len, max_target_len)


def build_task(folder: Path, tokenizer, roots: list[Path] | None = None, vocab_size: int = 8000,
               held_out_fraction: float = 0.1, max_source_chars: int = 1500, workers: int = 1,
               seed: int = 0) -> dict:
    """Mine, split and save the task into folder (the mined corpus is cached in folder/cache); returns task.json."""
    folder = Path(folder)
    examples = cached_corpus(folder / "cache", roots, max_source_chars, workers=workers)
    splits = dict(zip(SPLITS, split_by_package(examples, held_out_fraction, seed)))
    for split, split_examples in splits.items():
        save_examples(folder / f"{split}.jsonl", split_examples)
    texts = [text for example in splits["train"] for text in (example.source, example.summary)]
    Vocabulary.from_texts(tokenizer, texts, vocab_size).save(folder / VOCAB_FILE)
    save_pretrained_atomically(folder / TOKENIZER_FOLDER, tokenizer)
    summary = {"examples": {split: len(split_examples) for split, split_examples in splits.items()},
               "packages": {split: len({example.package for example in split_examples})
                            for split, split_examples in splits.items()},
               "vocab_size": vocab_size, "held_out_fraction": held_out_fraction,
               "max_source_chars": max_source_chars, "seed": seed,
               "roots": [str(root) for root in (roots or [])] or "standard library and site-packages"}
    write_json_atomically(folder / TASK_FILE, summary)  # last: a folder without it is not a task
    return summary


def load_task(folder: Path) -> Task:
    """The task saved in folder, with the teacher's summaries of every split distilled completely."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not (folder / TASK_FILE).is_file():
        raise InputError(f"{folder} is not a code-summary task folder (no {TASK_FILE}): make one with "
                         f"`accelgen nar data --out {folder}`")
    tokenizer = AutoTokenizer.from_pretrained(folder / TOKENIZER_FOLDER)
    vocabulary = Vocabulary.load(folder / VOCAB_FILE, tokenizer)
    splits = {split: load_examples(folder / f"{split}.jsonl") for split in SPLITS}
    teacher = {}
    for split, examples in splits.items():
        summaries = teacher_summaries(folder / TEACHER_FOLDER / split)
        if summaries:  # the first len(summaries) examples (distill_task may have been given a limit)
            teacher[split] = summaries[:len(examples)]
    return Task(folder, vocabulary, splits, teacher)


# --- the teacher ---------------------------------------------------------------------------------------------


def summary_prompts(examples: list[Example], split: str):
    """The teacher's prompt for each example (a chat request holding the function)."""
    from accelgen.datasets import Prompt

    return [Prompt(f"{split}-{index}", "code-summary", SUMMARY_REQUEST.format(source=example.source), chat=True)
            for index, example in enumerate(examples)]


def teacher_line(answer: str) -> str:
    """The summary in a teacher's answer: the first sentence of its first line with words, without quotes,
    backticks, a leading 'Summary:' or a subject ("The function `f` returns x." -> "Returns x."). An answer
    without one gives '' (such an example is dropped when encoded)."""
    for line in answer.splitlines():
        if line.strip().startswith("```"):  # a code fence, not a summary
            continue
        line = line.strip().strip("`\"'").strip()
        line = re.sub(r"^(#+\s*|[-*]\s+|(one-line )?summary:\s*)", "", line, flags=re.IGNORECASE).strip()
        if re.search(r"[A-Za-z]", line):
            line = re.split(r"(?<=[.!?])\s+(?=[A-Z])", TEACHER_SUBJECT.sub("", line), maxsplit=1)[0]
            return line[:1].upper() + line[1:]
    return ""


def teacher_summaries(folder: Path) -> list[str] | None:
    """The teacher's summaries in a regenerate folder, in prompt order (None: no answers there)."""
    from accelgen.datasets.regenerated import read_manifest, regenerated_records

    if read_manifest(folder) is None:
        return None
    records = list(regenerated_records(folder))
    order = sorted(records, key=lambda record: int(record["id"].rsplit("-", 1)[1]))
    return [teacher_line(record["answer"]) for record in order]


def distill_task(task_folder: Path, model, tokenizer, settings, splits=SPLITS, limit: int | None = None,
                 progress: Callable[[str, dict], None] | None = None) -> dict:
    """The teacher's greedy summaries of the first `limit` examples of each split, answered in resumable shards
    under task_folder/teacher/<split> (train/regenerate.py); returns {split: prompts answered}."""
    from accelgen.train.regenerate import regenerate

    task_folder = Path(task_folder)
    answered = {}
    for split in splits:
        examples = load_examples(task_folder / f"{split}.jsonl")[:limit]
        row = regenerate(model, tokenizer, summary_prompts(examples, split), task_folder / TEACHER_FOLDER / split,
                         settings, progress=None if progress is None else lambda row, split=split: progress(split, row))
        answered[split] = row["prompts_done"]
    return answered
