"""The target's LM head cut to a draft vocabulary (FR-Spec's idea), shared by the EAGLE and Medusa heads, and
how that vocabulary is chosen from training data."""

from __future__ import annotations

import torch


class DraftLMHead:
    """The target's LM head cut to a draft vocabulary (FR-Spec's idea): on a CPU the LM head is most of a draft
    step's cost, and a few thousand frequent tokens carry nearly all of the text. Only those rows are computed;
    the rows are detached, so training a head through them never touches the target's weights."""

    def __init__(self, lm_head, vocab: torch.Tensor):
        """vocab: (V',) token ids to draft from; empty for the whole vocabulary."""
        self.vocab_size = lm_head.weight.shape[0]
        self.vocab = vocab.to(lm_head.weight.device) if len(vocab) else None
        weight, bias = lm_head.weight.detach(), None if lm_head.bias is None else lm_head.bias.detach()
        self.weight = weight if self.vocab is None else weight[self.vocab]
        self.bias = bias if bias is None or self.vocab is None else bias[self.vocab]

    def restricted(self, states: torch.Tensor) -> torch.Tensor:
        """(.., V') float32 logits over the draft vocabulary only, from states (.., d)."""
        return torch.nn.functional.linear(states.to(self.weight.dtype), self.weight, self.bias).float()

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        """(.., vocab) float32 logits from states (.., d); -inf outside the draft vocabulary."""
        logits = self.restricted(states)
        if self.vocab is None:
            return logits
        full = torch.full((*logits.shape[:-1], self.vocab_size), float("-inf"), device=logits.device)
        full[..., self.vocab] = logits
        return full

    def label_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (..) as indices into the draft vocabulary; -100 (cross-entropy's ignore_index) outside it."""
        if self.vocab is None:
            return tokens
        index = torch.full((self.vocab_size,), -100, dtype=torch.long)
        index[self.vocab.cpu()] = torch.arange(len(self.vocab))
        return index[tokens.cpu()].to(tokens.device)


def draft_vocabulary(windows: torch.Tensor, choices: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """(min(size, vocab_size),) token ids to draft from: those of the data and the target's choices, most
    frequent first, then the lowest ids not among them (a BPE vocabulary numbers its early, common merges first)."""
    size = min(size, vocab_size)
    counts = torch.bincount(torch.cat([windows.reshape(-1), choices.reshape(-1)]), minlength=vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices  # ties: lower id first
    return torch.sort(order[:size]).values
