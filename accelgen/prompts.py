"""Prompts as the loop takes them: text, token ids (one row or a padded batch) or chat messages, to token ids;
and the EOS ids a model and its tokenizer declare. Token ids need no tokenizer (tokenizer None): the EOS ids then
come from the model's generation config, else its config."""

from __future__ import annotations

import torch

from accelgen.errors import InputError

ONE_PROMPT = ("one prompt is expected here; generate() takes several as a list of prompts or as a (batch, L) tensor "
              "with its attention_mask, and `accelgen serve` batches concurrent requests")


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of a text, id list/tensor or chat-message prompt; an empty prompt starts from BOS if there is one.
    Ids are never coerced: floats and bools are refused, not truncated, and so are several prompts at once."""
    if isinstance(prompt, torch.Tensor):
        ids = tensor_token_ids(prompt)
    elif isinstance(prompt, str):
        ids = with_tokenizer(tokenizer, "a text prompt")(prompt).input_ids if prompt else []
    elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        text = with_tokenizer(tokenizer, "a chat prompt").apply_chat_template(list(prompt), tokenize=False,
                                                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
    elif isinstance(prompt, (list, tuple)):
        try:  # a list of token ids, as Python, numpy or 0-d tensor integers; torch refuses ragged or text items
            tensor = torch.tensor(prompt, dtype=None if prompt else torch.long)
        except (TypeError, ValueError, RuntimeError):
            raise InputError(f"prompt must be one text, one list of token ids or one list of chat messages; "
                             f"{ONE_PROMPT}") from None
        if any(isinstance(token, bool) for token in prompt):
            raise InputError("prompt token ids must be integers, not bools")
        ids = tensor_token_ids(tensor)
    else:
        raise TypeError(f"prompt must be text, token ids or chat messages, not {type(prompt).__name__}")
    if not ids:
        if tokenizer is None:
            raise InputError("empty prompt and no tokenizer to give a BOS token to start from; give at least one token")
        if tokenizer.bos_token_id is None:
            raise InputError("empty prompt: this tokenizer has no BOS token to start from; give at least one token")
        ids = [tokenizer.bos_token_id]
    return ids


def with_tokenizer(tokenizer, what: str):
    """The tokenizer, or a ValueError saying that `what` needs one (token-id prompts do not)."""
    if tokenizer is None:
        raise InputError(f"{what} needs a tokenizer: pass the model's tokenizer, or give the prompt as token ids")
    return tokenizer


def tensor_token_ids(prompt: torch.Tensor) -> list[int]:
    """The ids of one prompt as a (L,) or (1, L) integer tensor (as a tokenizer returns it)."""
    check_integer_ids(prompt)
    if prompt.dim() == 2 and len(prompt) == 1:
        prompt = prompt[0]
    if prompt.dim() != 1:
        raise InputError(f"prompt token ids have shape {tuple(prompt.shape)}, not (L,) or (1, L): {ONE_PROMPT}")
    return prompt.tolist()


def check_integer_ids(token_ids: torch.Tensor) -> None:
    if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
        raise InputError(f"prompt token ids must be integers, got {token_ids.dtype} values")


def prompt_rows(prompt, attention_mask, pad_token_id: int | None, eos_ids: set[int]) -> tuple[list, bool]:
    """(the prompts, whether several were given): one prompt; a list of prompts (texts, id lists or tensors, chats);
    or token ids, (L,) or (batch, L), whose padding attention_mask marks, or else pad_token_id (several rows)."""
    if isinstance(prompt, torch.Tensor) or attention_mask is not None:
        token_ids = id_tensor(prompt)
        rows = token_ids[None] if token_ids.dim() == 1 else token_ids
        if rows.dim() != 2:
            raise InputError(f"prompt token ids have shape {tuple(token_ids.shape)}, not (L,) or (batch, L)")
        mask = padding_mask(rows, token_ids.shape, attention_mask, pad_token_id, eos_ids)
        return [row[keep].tolist() for row, keep in zip(rows, mask)], token_ids.dim() == 2 and len(rows) > 1
    several = (isinstance(prompt, (list, tuple)) and len(prompt) > 0
               and all(isinstance(item, (str, list, tuple)) or isinstance(item, torch.Tensor) and item.dim() > 0
                       for item in prompt))
    return (list(prompt), True) if several else ([prompt], False)


def id_tensor(prompt) -> torch.Tensor:
    """Token ids given with an attention_mask, as a tensor (a tensor, or a rectangular list of lists)."""
    try:
        token_ids = torch.as_tensor(prompt)
    except (TypeError, ValueError, RuntimeError):
        raise InputError("with attention_mask, the prompt must be token ids: a (batch, L) tensor or equal-length "
                         "lists") from None
    check_integer_ids(token_ids)
    return token_ids


def padding_mask(rows: torch.Tensor, shape: torch.Size, attention_mask, pad_token_id: int | None,
                 eos_ids: set[int]) -> torch.Tensor:
    """(batch, L) bool, True at each row's own tokens: attention_mask (of the prompt's shape), or where no mask is
    given and there are several rows, the tokens other than pad_token_id. Each row's tokens must be one run at
    its end (left padding) or start (right padding), as a tokenizer pads."""
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask)
        if mask.shape != shape:
            raise InputError(f"attention_mask has shape {tuple(mask.shape)}, the prompt {tuple(shape)}")
        if not ((mask == 0) | (mask == 1)).all():
            raise InputError("attention_mask must hold 0 (padding) and 1 (token) only")
        mask, marked_by = mask.reshape(rows.shape).bool(), "attention_mask"
    elif len(rows) > 1 and pad_token_id is not None and bool((rows == pad_token_id).any()):
        if pad_token_id in eos_ids:  # an EOS at a row's end may be text: padding cannot be told from it
            raise InputError(f"the prompts hold pad_token_id {pad_token_id}, which is also an EOS token, so their "
                             "padding cannot be told from their text: pass attention_mask")
        mask, marked_by = rows != pad_token_id, f"pad_token_id {pad_token_id}"
    else:
        return torch.ones_like(rows, dtype=torch.bool)
    for index, keep in enumerate(mask):
        kept = keep.nonzero().flatten()
        one_run = len(kept) == 0 or int(kept[-1] - kept[0]) + 1 == len(kept)
        if not one_run or len(kept) and kept[0] > 0 and kept[-1] < len(keep) - 1:
            raise InputError(f"prompt row {index}: its padding ({marked_by}) is neither left nor right padding")
    return mask


def eos_token_ids(model, tokenizer) -> set[int]:
    """EOS ids from the model's generation config and the tokenizer (chat models often have several); without a
    tokenizer (None), from the generation config, else the model's config (none: generation runs to its limit)."""
    ids = set(listed_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None)))
    if tokenizer is None:
        return ids or set(listed_ids(getattr(getattr(model, "config", None), "eos_token_id", None)))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def listed_ids(configured) -> list[int]:
    """A config's token id field (None, one id, or a list of them) as a list."""
    if configured is None:
        return []
    return [configured] if isinstance(configured, int) else list(configured)
