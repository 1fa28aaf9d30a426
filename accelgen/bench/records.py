"""The record every benchmark row returns for one generation, whatever ran it (HF, accelgen, llama.cpp)."""

from __future__ import annotations


def generation_record(token_ids: list[int], seconds: float, finish_reason: str, *, target_forwards: int | None = None,
                      committed_per_step: list[int] | None = None, draft_tokens: int | None = None,
                      accepted_draft_tokens: int | None = None, draft_seconds: float | None = None, **extra) -> dict:
    """New tokens (an EOS that ended generation included), the wall time around the one call, and what the
    engine reports of its forwards and drafts: None where it does not say (never a guessed zero). extra: fields
    only some methods have (early exit's mean_layers, auto's choice, ...)."""
    return {
        "token_ids": list(token_ids),
        "new_tokens": len(token_ids),
        "finish_reason": finish_reason,
        "seconds": seconds,
        "target_forwards": target_forwards,
        "committed_per_step": committed_per_step,
        "draft_tokens": draft_tokens,
        "accepted_draft_tokens": accepted_draft_tokens,
        "draft_seconds": draft_seconds,
        **extra,
    }
