"""llama.cpp as a peer in the benchmark: the CPU engine users would otherwise pick, on the same GGUF file.

Three rows run llama.cpp's own server loop (the `xllamacpp` wheel), each loaded once per run:

    llamacpp        plain greedy decoding
    llamacpp-draft  its draft-model speculation, with the run's draft model's GGUF file
    llamacpp-ngram  its n-gram speculation (prompt and output lookup, no second model)

Each gets the same prompt token ids, max_new_tokens and thread count as every other row; greedy (temperature
0, top-k 1); no prompt cache, so each call reads its prompt as the others do. The new token ids come back with
the response's log-probabilities, so outputs are compared token for token (against the plain `llamacpp` row:
the engines round differently from PyTorch, so a difference from HF greedy is not an error).
"""

from __future__ import annotations

import time

from accelgen.models.loading import gguf_file

PEERS = {
    "llamacpp": "llama.cpp's server on the model's GGUF file, greedy: the CPU engine users would otherwise pick",
    "llamacpp-draft": "llama.cpp's draft-model speculation (its defaults) with the draft model's GGUF file",
    "llamacpp-ngram": "llama.cpp's n-gram speculation (ngram-simple, its defaults): no second model",
}
CONTEXT_TOKENS = 4096


def xllamacpp():
    try:
        import xllamacpp as module
    except ImportError:
        raise ValueError("the llama.cpp rows need the xllamacpp package: pip install 'accelgen[llamacpp]'") from None
    return module


def make_server(peer: str, model: str, draft: str | None, threads: int):
    """A llama.cpp server for one peer row; model and draft are embedded names or .gguf paths."""
    xl = xllamacpp()
    params = xl.CommonParams()
    params.model.path = str(gguf_file(model))
    params.n_ctx, params.n_parallel, params.verbosity = CONTEXT_TOKENS, 1, -1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
    kinds = xl.common_speculative_type
    if peer == "llamacpp-draft":
        if draft is None:
            raise ValueError("llamacpp-draft needs a draft model (pass --draft)")
        params.speculative.types = [kinds.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE]
        params.speculative.draft.mparams.path = str(gguf_file(draft))
        params.speculative.draft.cpuparams.n_threads = params.speculative.draft.cpuparams_batch.n_threads = threads
    elif peer == "llamacpp-ngram":
        params.speculative.types = [kinds.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE]
    return xl.Server(params)


class LlamaCppPeers:
    """The run's llama.cpp servers, one per peer row, started on first use (loading is not timed)."""

    def __init__(self, model: str, draft: str | None, threads: int):
        self.model, self.draft, self.threads = model, draft, threads
        self.servers: dict[str, object] = {}

    def run(self, peer: str, prompt_ids: list[int], max_new_tokens: int) -> dict:
        if peer not in self.servers:
            self.servers[peer] = make_server(peer, self.model, self.draft, self.threads)
        return run_peer(self.servers[peer], prompt_ids, max_new_tokens)


def run_peer(server, prompt_ids: list[int], max_new_tokens: int) -> dict:
    """One greedy completion of the prompt's token ids; a benchmark record."""
    request = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
               "logprobs": 1, "cache_prompt": False}
    started = time.perf_counter()
    response = server.handle_completions(request)
    seconds = time.perf_counter() - started
    if "choices" not in response:
        raise RuntimeError(f"llama.cpp refused the request: {response}")
    choice = response["choices"][0]
    token_ids = [entry["id"] for entry in (choice.get("logprobs") or {}).get("content", [])]
    timings = response.get("timings", {})
    drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
    return {
        "token_ids": token_ids,
        "new_tokens": len(token_ids),
        "finish_reason": "stop" if choice.get("finish_reason") == "stop" else "length",
        "seconds": seconds,
        "target_forwards": None,  # llama.cpp does not report its verification forwards
        "committed_per_step": None,
        "draft_tokens": drafted,
        "accepted_draft_tokens": accepted,
        "draft_seconds": None,
    }
