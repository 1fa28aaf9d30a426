"""REST, retrieval-based speculative decoding (He et al. 2023): drafts retrieved from a corpus datastore.

The datastore is a corpus as one token array (texts separated by -1) plus its suffix array: every position
sorted by the tokens that follow it. All occurrences of a token sequence then form one contiguous range of the
suffix array, found by binary search. At each step the drafter finds the longest suffix of the context
(max_query tokens down to min_query) that occurs in the corpus, reads the tokens that followed up to
max_matches occurrences (evenly spread over the range, so frequent continuations stay frequent), merges them
into a trie and keeps the max_nodes most frequent nodes as a token tree, verified in one forward.

Build a datastore once with `build_datastore(tokenizer, texts, path)` or the CLI
`accelgen datastore build --model M --dataset sharegpt --out PATH`; it is saved as .npy files and
memory-mapped at use, so opening it is instant and only the pages a lookup touches are read.
With context=True the request's own text (prompt + output so far) is searched too, as prompt lookup does
(its last 2–3 tokens, most recent match), and that continuation is added to the same trie weighing as much as
all the corpus matches together: text the request repeats is likelier than what other texts said next.
Drafts are deterministic, so the method is exact for sampling too.

Files in a datastore folder:
    tokens.npy        (n,) int32: the corpus, -1 after every text
    suffix_array.npy  (n,) int32/int64: positions sorted by their next sort_depth tokens (built as a full
                      suffix array, which is sorted by any number of tokens)
    datastore.json    format, tokenizer, vocabulary bound, sizes (checked on open), build time; written last
"""

from __future__ import annotations

import bisect
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pydivsufsort
import torch
from tqdm.auto import tqdm

from accelgen.atomic import CorruptFileError, read_checked, save_npy_atomically, write_json_atomically
from accelgen.draft import Draft, Verdict
from accelgen.drafters.base import BuildContext, Drafter
from accelgen.drafters.budget import sized_by_costs
from accelgen.drafters.candidate_tree import CandidateTree
from accelgen.drafters.prompt_lookup import NGramIndex, check_at_least_one, check_size_range, lookup_candidates
from accelgen.errors import InputError
from accelgen.registry import MethodOptions, MethodSpec, Part, register

CONTEXT_MAX_NGRAM = 3  # context=True: the longest tail looked up in the request's own text, as pld's default
SEPARATOR = -1  # ends every text; sorts before every token, and no query contains it
TOKENS_FILE, SUFFIXES_FILE, META_FILE = "tokens.npy", "suffix_array.npy", "datastore.json"
BUILD_COMMAND = "accelgen datastore build --model M --dataset sharegpt"
FORMAT_VERSION = 1


# --- building --------------------------------------------------------------------------------------------


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Positions of tokens (n,) sorted by their suffixes: a full suffix array (libdivsufsort, through
    pydivsufsort); a suffix that ends early sorts before its extensions. Returns (n,) int64.

    Lookups read at most sort_depth tokens of each suffix, so any order by the first sort_depth tokens serves
    them; a full suffix array is one (its finer order only settles ties no lookup can see), and libdivsufsort
    builds it 3-5x faster than the numpy prefix doubling it replaced (1-5M tokens of ShareGPT, 2 CPU cores).

    Example: tokens [b a b a] -> suffixes "baba" "aba" "ba" "a" -> sorted "a" "aba" "ba" "baba" -> [3 1 2 0].
    """
    if len(tokens) == 0:  # pydivsufsort takes the minimum id, which an empty array lacks
        return np.zeros(0, dtype=np.int64)
    # signed ids are ordered as numbers (-1, the separator, first); any integer dtype is sorted by value
    return pydivsufsort.divsufsort(np.ascontiguousarray(tokens)).astype(np.int64)


def write_datastore(sequences: Iterable[Sequence[int]], path, *, sort_depth: int = 64, progress: bool = True,
                    info: dict | None = None, started: float | None = None) -> dict:
    """Save token sequences as a datastore folder at path; returns its datastore.json contents (build_seconds
    counted from `started`, default now).

    Each file is written atomically, and datastore.json, which records the other files' sizes, is removed first and
    written last: a build killed at any point leaves no datastore.json (a clear error on open, naming the folder),
    never new tokens beside an old suffix array."""
    if sort_depth < 2:
        raise InputError(f"sort_depth must be >= 2, got {sort_depth}")
    started = time.perf_counter() if started is None else started
    pieces, count = [], 0
    for sequence in sequences:
        piece = np.asarray(list(sequence) + [SEPARATOR], dtype=np.int32)
        if piece[:-1].min(initial=0) < 0:
            raise InputError("token ids must be non-negative")
        pieces.append(piece)
        count += 1
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    with tqdm(desc="sorting suffixes", total=1, unit=" array", disable=not progress) as bar:  # one call: its time
        suffixes = build_suffix_array(tokens)
        bar.update()
    suffixes = suffixes.astype(np.int32 if len(tokens) < 2**31 else np.int64)
    folder = Path(path)
    (folder / META_FILE).unlink(missing_ok=True)
    sizes = {name: save_npy_atomically(folder / name, array).stat().st_size
             for name, array in ((TOKENS_FILE, tokens), (SUFFIXES_FILE, suffixes))}
    meta = {
        "format": FORMAT_VERSION,
        **(info or {}),
        "texts": count,
        "tokens": int(len(tokens) - count),  # without separators
        "max_token_id": int(tokens.max()) if len(tokens) else -1,
        "sort_depth": sort_depth,
        "bytes": sum(sizes.values()),
        "file_bytes": sizes,  # checked on open: files of another build, or truncated ones, are refused
        "build_seconds": round(time.perf_counter() - started, 2),
    }
    write_json_atomically(folder / META_FILE, meta)
    return meta


def build_datastore(tokenizer, texts: Iterable[str], path, *, sort_depth: int = 64, batch_size: int = 512,
                    progress: bool = True, tokenizer_name: str | None = None) -> dict:
    """Tokenize texts (no special tokens) and save them as a datastore at path; returns its datastore.json
    contents, build_seconds included (tokenizing + sorting + writing). tokenizer_name is recorded for users
    (default: the tokenizer's own name_or_path)."""
    started = time.perf_counter()

    def tokenized() -> Iterable[list[int]]:
        with tqdm(desc="tokenizing", unit=" texts", disable=not progress) as bar:
            batch: list[str] = []
            for text in texts:
                batch.append(text)
                if len(batch) == batch_size:
                    yield from tokenizer(batch, add_special_tokens=False).input_ids
                    bar.update(len(batch))
                    batch = []
            if batch:
                yield from tokenizer(batch, add_special_tokens=False).input_ids
                bar.update(len(batch))

    name = tokenizer_name or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    info = {"tokenizer": name, "vocab_size": len(tokenizer)}
    return write_datastore(tokenized(), path, sort_depth=sort_depth, progress=progress, info=info, started=started)


# --- lookup ----------------------------------------------------------------------------------------------


class _SuffixPrefixes:
    """The suffix array as a sorted sequence of each suffix's first `length` tokens, for bisect."""

    def __init__(self, tokens: np.ndarray, suffixes: np.ndarray, length: int):
        self.tokens, self.suffixes, self.length = tokens, suffixes, length

    def __len__(self) -> int:
        return len(self.suffixes)

    def __getitem__(self, i: int) -> list[int]:
        start = int(self.suffixes[i])
        return self.tokens[start : start + self.length].tolist()


class Datastore:
    """A datastore folder, memory-mapped; share one object between requests to skip even the open."""

    def __init__(self, path):
        folder = Path(path)
        if not (folder / META_FILE).is_file():
            raise FileNotFoundError(f"no REST datastore at {folder} (no {META_FILE}: none was built there, or its "
                                    f"build was interrupted): build one with `{BUILD_COMMAND} --out {folder}`")
        self.path = folder
        rebuild = f"rebuild the datastore with `{BUILD_COMMAND} --out {folder}`"
        self.meta = read_checked(folder / META_FILE, lambda file: json.loads(file.read_text()), rebuild)
        if self.meta.get("format") != FORMAT_VERSION:
            raise InputError(f"datastore at {folder} has format {self.meta.get('format')}; "
                             f"rebuild it (this version reads {FORMAT_VERSION})")
        self.tokens = self.open_array(TOKENS_FILE, rebuild)  # (n,) int32
        self.suffixes = self.open_array(SUFFIXES_FILE, rebuild)  # (n,) int
        self.sort_depth = int(self.meta["sort_depth"])

    def open_array(self, name: str, rebuild: str) -> np.ndarray:
        """One of the datastore's arrays, memory-mapped, after checking that it is the one datastore.json describes
        (its size; older datastores record none) and holds every token and separator."""
        path = self.path / name
        found = path.stat().st_size if path.is_file() else 0
        recorded = self.meta.get("file_bytes", {}).get(name, found)
        if found != recorded:
            raise CorruptFileError(f"{path} has {found} bytes where {META_FILE} records {recorded}: it is missing, "
                                   f"truncated or from another build; {rebuild}")
        array = read_checked(path, lambda file: np.load(file, mmap_mode="r"), rebuild)
        length = self.meta["tokens"] + self.meta["texts"]  # one separator per text
        if array.shape != (length,):
            raise CorruptFileError(f"{path} has shape {array.shape} where {META_FILE} records ({length},): it is from "
                                   f"another build; {rebuild}")
        return array

    def __len__(self) -> int:
        return len(self.tokens)

    def find(self, query: list[int]) -> tuple[int, int]:
        """[lo, hi): the suffix-array range of the suffixes starting with query (empty when lo == hi)."""
        view = _SuffixPrefixes(self.tokens, self.suffixes, len(query))
        lo = bisect.bisect_left(view, query)
        if lo == len(view) or view[lo] != query:
            return lo, lo
        return lo, bisect.bisect_right(view, query, lo)

    def longest_match(self, tail: list[int], min_length: int, max_length: int) -> tuple[int, int, int] | None:
        """(length, lo, hi) for the longest suffix of tail, min_length..max_length tokens, in the corpus.

        Binary search on the length: if the last m tokens occur in the corpus, so do the last m - 1.
        """
        best = None
        shortest, longest = min_length, min(max_length, len(tail), self.sort_depth)
        while shortest <= longest:
            length = (shortest + longest) // 2
            lo, hi = self.find(tail[-length:])
            if lo < hi:
                best = (length, lo, hi)
                shortest = length + 1
            else:
                longest = length - 1
        return best

    def continuations(self, lo: int, hi: int, skip: int, depth: int, max_matches: int) -> list[list[int]]:
        """The depth tokens after the first `skip` tokens of up to max_matches suffixes in [lo, hi), evenly
        spread over the range; each cut at the end of its text."""
        count = min(hi - lo, max_matches)
        if count <= 0 or depth <= 0:
            return []
        picks = np.unique(np.linspace(lo, hi - 1, num=count).round().astype(np.int64))
        starts = self.suffixes[picks].astype(np.int64) + skip  # (k,)
        positions = starts[:, None] + np.arange(depth)  # (k, depth)
        inside = positions < len(self.tokens)
        windows = np.where(inside, self.tokens[np.minimum(positions, len(self.tokens) - 1)], SEPARATOR)
        result = []
        for window in windows.tolist():
            cut = window.index(SEPARATOR) if SEPARATOR in window else depth
            result.append(window[:cut])
        return result


# --- drafter ---------------------------------------------------------------------------------------------


class RestDrafter(Drafter):
    def __init__(self, datastore: Datastore, max_query: int = 16, min_query: int = 2, max_matches: int = 500,
                 draft_depth: int = 6, max_nodes: int = 8, context: bool = False):
        check_size_range(("min_query", min_query), ("max_query", max_query))
        if max_query > datastore.sort_depth:
            raise InputError(f"max_query {max_query} exceeds the datastore's sort_depth {datastore.sort_depth}; "
                             "rebuild it deeper or query less")
        check_at_least_one(max_matches=max_matches, draft_depth=draft_depth, max_nodes=max_nodes)
        self.datastore = datastore
        self.max_query, self.min_query = max_query, min_query
        self.max_matches = max_matches
        self.draft_depth = draft_depth
        self.max_nodes = max_nodes
        self.context_index = NGramIndex(min_query, max(min_query, CONTEXT_MAX_NGRAM)) if context else None

    def propose(self, context: torch.Tensor, max_nodes: int) -> Draft:
        """context: (L,) long; only its last max_query tokens are read."""
        depth = min(self.draft_depth, max_nodes)
        match = self.datastore.longest_match(context[-self.max_query :].tolist(), self.min_query, self.max_query)
        retrieved = []
        if match is not None:
            length, lo, hi = match
            retrieved = self.datastore.continuations(lo, hi, length, depth, self.max_matches)
        tree = CandidateTree()
        for continuation in retrieved:
            tree.add(continuation)  # weight 1 each: a node's weight is its frequency among the matches
        if self.context_index is not None:
            self.context_index.follow(context)
            for continuation in lookup_candidates(self.context_index, depth, branches=1):
                tree.add(continuation, weight=len(retrieved) + 1)  # outweighs the corpus: the request repeats itself
        return tree.draft(min(self.max_nodes, max_nodes))

    def update(self, draft: Draft, verdict: Verdict, target_logits: torch.Tensor) -> None:
        pass


def open_datastore(datastore, vocab_size: int) -> Datastore:
    """A Datastore from a path or an open Datastore, checked against the target's vocabulary."""
    if datastore is None:
        raise InputError("method 'rest' needs a datastore: build one with `accelgen datastore build` "
                         "and pass datastore=PATH")
    store = datastore if isinstance(datastore, Datastore) else Datastore(datastore)
    if store.meta["max_token_id"] >= vocab_size:
        raise InputError(
            f"datastore {store.path} holds token id {store.meta['max_token_id']}, beyond the target's vocabulary "
            f"({vocab_size}); it was built with another tokenizer ({store.meta.get('tokenizer', 'unknown')})"
        )
    return store


@dataclass(frozen=True)
class RestOptions(MethodOptions):
    datastore: object = None  # a Datastore or its folder (`accelgen datastore build`)
    max_query: int = 16  # the longest context suffix looked up ...
    min_query: int = 2  # ... and the shortest
    max_matches: int = 500  # corpus matches read per lookup
    draft_depth: int = 6  # the deepest tree node
    max_nodes: int | str = "auto"  # tree nodes per draft; "auto": sized each step by the measured costs
    context: bool = False  # also draft from the prompt and output's own n-grams


def _make(build: BuildContext, options: RestOptions):
    store = open_datastore(options.datastore, build.target_model.config.vocab_size)
    settings = {name: value for name, value in options.as_dict().items() if name not in ("datastore", "max_nodes")}
    return sized_by_costs(lambda nodes: RestDrafter(store, **settings, max_nodes=nodes), options.max_nodes,
                          build.target_model)


register(
    MethodSpec(
        name="rest",
        family="speculative",
        lossless="distribution-exact",
        paper="He et al. 2023, arXiv:2311.08252",
        summary="retrieves what followed the context's longest suffix in a corpus (suffix array), verified as a tree",
        drafter=Part(_make, RestOptions),
        needs=("datastore",),
    )
)
