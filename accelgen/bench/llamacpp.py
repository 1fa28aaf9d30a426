"""llama.cpp as a peer in the benchmark: the CPU engine users would otherwise pick, on the same GGUF file.

Three rows run llama.cpp's own server loop (the `xllamacpp` wheel), each loaded once per run:

    llamacpp        plain greedy decoding
    llamacpp-draft  its draft-model speculation, with the run's draft model's GGUF file
    llamacpp-ngram  its n-gram speculation (ngram-simple: prompt and output lookup, no second model)

Each gets the same prompt token ids (never text, so tokenization cannot differ), max_new_tokens and thread
count as every other row; greedy (temperature 0, top-k 1); it stops at the model's end-of-generation tokens
like the other rows (ignore_eos false), the EOS that ended it included in its tokens; no prompt cache, so each
call reads its prompt as the others do. The new token ids come back with the response's post-sampling
probabilities (cheap: with top-k 1 only the chosen token is left, whereas llama.cpp's full log-probabilities
would sort the vocabulary at every token and slow it down). Outputs are compared token for token against the
plain `llamacpp` row: the engines round differently from PyTorch, so a difference from HF greedy is not an error.
"""

from __future__ import annotations

import time

from accelgen.bench.records import generation_record
from accelgen.errors import InputError
from accelgen.models.loading import gguf_file

PEERS = {
    "llamacpp": "llama.cpp's server on the model's GGUF file, greedy: the CPU engine users would otherwise pick",
    "llamacpp-draft": "llama.cpp's draft-model speculation (its defaults) with the draft model's GGUF file",
    "llamacpp-ngram": "llama.cpp's n-gram speculation (ngram-simple, its defaults): no second model",
}
# llama.cpp's defaults in the pinned build, written out so the report shows the values used and a variant can
# change them (llamacpp-draft@draft_max=8); the names follow llama-server's flags (--draft-max, --spec-ngram-size-n)
OPTIONS = {
    "llamacpp": {},
    "llamacpp-draft": {"draft_max": 3, "draft_min": 0, "draft_p_min": 0.0},
    "llamacpp-ngram": {"ngram_size_n": 12, "ngram_size_m": 48, "ngram_min_hits": 1},
}
CONTEXT_TOKENS = 4096  # per server: the longest prompt plus max_new_tokens must fit
INSTALL_HINT = "pip install 'accelgen[llamacpp]'"


def xllamacpp():
    try:
        import xllamacpp as module
    except ImportError:
        raise InputError(f"the llama.cpp rows need the xllamacpp package: {INSTALL_HINT}") from None
    return module


def gguf_files(model: str | None, drafts: list[str], peers: bool) -> dict:
    """The GGUF files llama.cpp will run (the target's, unless None; the drafts'), checked before anything is
    loaded, by name for the report. peers: llama.cpp's own rows run, so its package must be installed."""
    if peers:
        xllamacpp()
    files = {"target": gguf_file(model).name} if model is not None else {}
    if drafts:
        files["draft"] = ", ".join(dict.fromkeys(gguf_file(draft).name for draft in drafts))
    return files


def make_server(peer: str, model: str, draft: str | None, threads: int, options: dict | None = None):
    """A llama.cpp server for one peer row; model and draft are embedded names or .gguf paths; options: the
    row's OPTIONS."""
    xl = xllamacpp()
    options = {**OPTIONS[peer], **(options or {})}
    params = xl.CommonParams()
    params.model.path = str(gguf_file(model))
    params.n_ctx, params.n_parallel, params.verbosity = CONTEXT_TOKENS, 1, -1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
    speculative, kinds = params.speculative, xl.common_speculative_type
    if peer == "llamacpp-draft":
        if draft is None:
            raise InputError("llamacpp-draft needs a draft model (pass --draft)")
        speculative.types = [kinds.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE]
        speculative.draft.mparams.path = str(gguf_file(draft))
        speculative.draft.cpuparams.n_threads = speculative.draft.cpuparams_batch.n_threads = threads
        speculative.draft.n_max, speculative.draft.n_min = options["draft_max"], options["draft_min"]
        speculative.draft.p_min = options["draft_p_min"]
    elif peer == "llamacpp-ngram":
        speculative.types = [kinds.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE]
        ngram = speculative.ngram_simple
        ngram.size_n, ngram.size_m, ngram.min_hits = options["ngram_size_n"], options["ngram_size_m"], options["ngram_min_hits"]
    return xl.Server(params)


class LlamaCppPeers:
    """The run's llama.cpp servers, one per row, started on first use: loading is not timed, and the runner's
    warm-up call starts them before the first timed one."""

    def __init__(self, model: str, draft: str | None, threads: int):
        self.model, self.draft, self.threads = model, draft, threads
        self.servers: dict[str, object] = {}

    def run(self, method, options: dict, prompt_ids: list[int], max_new_tokens: int) -> dict:
        """method: the row (a BenchMethod of source "llamacpp": its name, the peer it runs, its own draft)."""
        peer = method.registered_name
        if method.name not in self.servers:
            draft = (method.draft or self.draft) if peer == "llamacpp-draft" else None
            self.servers[method.name] = make_server(peer, self.model, draft, self.threads, options)
        return run_peer(self.servers[method.name], prompt_ids, max_new_tokens, speculative=peer != "llamacpp")


def completion_request(prompt_ids: list[int], max_new_tokens: int) -> dict:
    return {"prompt": [int(token) for token in prompt_ids], "n_predict": max_new_tokens,
            "temperature": 0.0, "top_k": 1, "ignore_eos": False, "cache_prompt": False,
            "n_probs": 1, "post_sampling_probs": True}  # the token ids come back with the probabilities


def run_peer(server, prompt_ids: list[int], max_new_tokens: int, speculative: bool = False) -> dict:
    """One greedy completion of the prompt's token ids; a benchmark record. llama.cpp reports drafted and
    accepted tokens only when it drafted some: a speculative row that drafted none counts zeros."""
    started = time.perf_counter()
    response = server.handle_completions(completion_request(prompt_ids, max_new_tokens))
    seconds = time.perf_counter() - started
    if "choices" not in response:
        raise RuntimeError(f"llama.cpp refused the request ({len(prompt_ids)} prompt tokens, context "
                           f"{CONTEXT_TOKENS}): {response}")
    read = response.get("usage", {}).get("prompt_tokens")
    if read is not None and read != len(prompt_ids):
        raise RuntimeError(f"llama.cpp read {read} prompt tokens, not the {len(prompt_ids)} it was given")
    choice = response["choices"][0]
    token_ids = [entry["id"] for entry in (choice.get("logprobs") or {}).get("content", [])]
    timings = response.get("timings", {})
    unreported = 0 if speculative else None
    # llama.cpp does not report its verification forwards, so these rows have acceptance but no τ
    return generation_record(token_ids, seconds, "stop" if choice.get("finish_reason") == "stop" else "length",
                             draft_tokens=timings.get("draft_n", unreported),
                             accepted_draft_tokens=timings.get("draft_n_accepted", unreported))
