"""Universal assisted decoding: the alignment helpers on hand-made tokenizers, the drafter on a scripted draft
model, and lossless generation with SmolLM2 as target and drafts through a different tokenizer."""

from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

import accelgen
from accelgen.drafters.universal import (
    UniversalDrafter,
    complete_prefix_length,
    continuation_ids,
    leading_special_ids,
    new_text,
    special_token_map,
    strip_incomplete_character,
    translate_special_tokens,
)
from accelgen.models.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")

CORPUS = [
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "The quick brown fox jumps over the lazy dog. I like 😀 and cake. 日本語のテキスト。 naïve café\n",
    "Hello world! Hello there, how are you? print('hello world')\n",
]


@pytest.fixture(scope="module")
def other_tokenizer():
    """A byte-level BPE of 320 tokens trained here, unlike SmolLM2's: '<s>' (BOS, added to every encoding) and
    '</s>' (EOS) are its special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


class TextOracle:
    """A scripted draft model that knows the text to come: after any prefix of `text` (compared as bytes, so
    partial characters are fine) it predicts the longest token of its byte-level tokenizer that continues the
    text, and EOS at the end of the text or off it. With alignment right, the target accepts almost everything."""

    def __init__(self, tokenizer, text: str):
        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        special = set(tokenizer.all_special_ids)
        self.token_bytes = {token_id: bytes(byte_of[char] for char in token)
                            for token, token_id in tokenizer.get_vocab().items() if token_id not in special}
        self.eos, self.text = tokenizer.eos_token_id, text.encode()
        self.config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, max_position_embeddings=4096)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.ids: list[int] = []  # the sequence its (dummy) KV cache stands for

    def __call__(self, input_ids, past_key_values, logits_to_keep=0, **_):
        new = input_ids[0].tolist()
        self.ids = self.ids[: past_key_values.get_seq_length()] + new
        past_key_values.update(torch.zeros(1, 1, len(new), 1), torch.zeros(1, 1, len(new), 1), 0)
        start = len(self.ids) - len(new)
        rows = [self.next_logits(self.ids[: start + i + 1]) for i in range(len(new))]
        return SimpleNamespace(logits=torch.stack(rows[-logits_to_keep:] if logits_to_keep else rows)[None])

    def next_logits(self, ids: list[int]) -> torch.Tensor:
        seen = b"".join(self.token_bytes.get(token_id, b"") for token_id in ids)  # special tokens add no text
        rest = self.text[len(seen) :] if self.text.startswith(seen) else b""
        continuing = [token_id for token_id, piece in self.token_bytes.items() if piece and rest.startswith(piece)]
        logits = torch.zeros(self.config.vocab_size)
        logits[max(continuing, key=lambda token_id: len(self.token_bytes[token_id]), default=self.eos)] = 1
        return logits


# --- alignment helpers on hand-made tokenizers --------------------------------------------------------------


def byte_decode(ids):
    """A byte-level tokenizer whose ids are the bytes themselves."""
    return bytes(ids).decode("utf-8", errors="replace")


class GreedyVocab:
    """A toy tokenizer: longest vocabulary match from the left; ids are indices into the vocabulary."""

    def __init__(self, pieces):
        self.pieces = pieces

    def encode(self, text):
        ids = []
        while text:
            piece = max((p for p in self.pieces if text.startswith(p)), key=len)
            ids.append(self.pieces.index(piece))
            text = text[len(piece) :]
        return ids

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)

    def ids(self, *pieces):
        return [self.pieces.index(p) for p in pieces]


TOY = GreedyVocab([" hello", " hel", "lo", " world", " ", "h", "e", "l", "o", "w", "r", "d"])


def test_complete_prefix_length_holds_back_a_partial_character():
    emoji = list("😀".encode())  # four bytes
    assert complete_prefix_length(byte_decode, list(b"ok ") + emoji[:2]) == 3
    assert complete_prefix_length(byte_decode, list(b"ok ") + emoji[:1]) == 3
    assert complete_prefix_length(byte_decode, list(b"ok ") + emoji) == 7
    assert complete_prefix_length(byte_decode, list(b"ok")) == 2
    assert complete_prefix_length(byte_decode, []) == 0


def test_complete_prefix_length_on_smollm_byte_tokens(tokenizer):
    ids = tokenizer.encode("I like 😀")  # 'I', ' like', then ' 😀' over two byte-level tokens
    cut = ids[:-1]
    assert tokenizer.decode(cut).endswith("\ufffd")
    assert complete_prefix_length(tokenizer.decode, cut) == len(ids) - 2
    assert complete_prefix_length(tokenizer.decode, ids) == len(ids)


def test_continuation_starts_at_the_token_boundary_after_the_window():
    assert continuation_ids(TOY.encode, TOY.decode, TOY.ids(" hello"), " world") == TOY.ids(" world")
    # the window re-encodes differently (' hello' in letters), but a boundary still falls at its end
    window = TOY.ids(" ", "h", "e", "l", "l", "o")
    assert continuation_ids(TOY.encode, TOY.decode, window, " world") == TOY.ids(" world")
    assert continuation_ids(TOY.encode, TOY.decode, [], " hello") == TOY.ids(" hello")
    assert continuation_ids(TOY.encode, TOY.decode, TOY.ids(" hello"), "") == []


def test_continuation_across_a_merge_encodes_the_new_text_alone():
    # ' hel' + 'lo world' encodes as ' hello', ' world': no boundary after ' hel', so 'lo world' stands alone
    assert TOY.encode(" hello world") == TOY.ids(" hello", " world")
    assert continuation_ids(TOY.encode, TOY.decode, TOY.ids(" hel"), "lo world") == TOY.ids("lo", " world")


def test_new_text_keeps_a_leading_space_that_a_lone_decode_drops():
    decode = lambda pieces: "".join(pieces).replace("▁", " ").lstrip(" ")  # noqa: E731  (SentencePiece-like)
    assert decode(["▁cat"]) == "cat"
    assert new_text(decode, ["▁the"], ["▁cat", "s"]) == " cats"
    assert new_text(byte_decode, list(b"ok"), list(" 😀".encode())[:3]) == " \ufffd"
    assert strip_incomplete_character(" \ufffd") == " "
    assert strip_incomplete_character("ok") == "ok"


def test_special_tokens_are_kept_when_shared_else_eos_maps_to_eos(tokenizer, other_tokenizer):
    to_other = special_token_map(tokenizer, other_tokenizer)
    assert to_other["<|im_end|>"] == "</s>"  # SmolLM2's EOS
    assert to_other["<|im_start|>"] == ""
    assert translate_special_tokens("<|im_start|>user\nhi<|im_end|>", to_other) == "user\nhi</s>"
    assert special_token_map(other_tokenizer, tokenizer) == {"</s>": "<|im_end|>", "<s>": ""}
    assert special_token_map(tokenizer, tokenizer) == {}  # the same tokenizer knows all its special tokens


def test_leading_special_ids_find_a_bos(tokenizer, other_tokenizer):
    assert leading_special_ids(other_tokenizer) == [other_tokenizer.bos_token_id]
    assert leading_special_ids(tokenizer) == []  # SmolLM2 adds no BOS


# --- the drafter on a scripted draft model ---------------------------------------------------------------------


def test_draft_text_becomes_target_tokens_and_draft_eos_becomes_target_eos(tokenizer, other_tokenizer):
    drafter = UniversalDrafter(TextOracle(other_tokenizer, "Hello world!"), tokenizer, other_tokenizer, gamma=8)
    proposal = drafter.propose(torch.tensor(tokenizer.encode("Hello")), max_nodes=16)
    assert proposal.is_chain
    assert proposal.tokens.tolist() == tokenizer.encode(" world!") + [tokenizer.eos_token_id]


def test_a_pending_partial_character_is_completed_by_the_proposal(tokenizer, other_tokenizer):
    text = "I like 😀 and cake."
    ids = tokenizer.encode(text)
    cut = next(i for i in range(len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))  # inside the emoji
    drafter = UniversalDrafter(TextOracle(other_tokenizer, text), tokenizer, other_tokenizer, gamma=12)
    proposal = drafter.propose(torch.tensor(ids[:cut]), max_nodes=32).tokens.tolist()
    assert proposal == ids[cut:] + [tokenizer.eos_token_id]


def test_draft_cache_follows_the_committed_text(tokenizer, other_tokenizer, make_tiny_model, assert_reordered):
    """After a correction the draft cache is rolled back to what still matches the re-encoded committed text:
    the next proposal and the cache equal a fresh drafter's."""
    draft = make_tiny_model("llama", seed=1, vocab_size=len(other_tokenizer))
    drafter = UniversalDrafter(draft, tokenizer, other_tokenizer, gamma=4)
    context = tokenizer.encode("The quick brown")
    first = drafter.propose(torch.tensor(context), max_nodes=16).tokens.tolist()
    committed = context + first[:1] + tokenizer.encode(" fox")  # one accepted, then a correction
    second = drafter.propose(torch.tensor(committed), max_nodes=16).tokens.tolist()
    fresh = UniversalDrafter(draft, tokenizer, other_tokenizer, gamma=4)
    assert second == fresh.propose(torch.tensor(committed), max_nodes=16).tokens.tolist()
    draft_context = drafter.draft_context(committed)
    assert drafter.cached_tokens[: len(draft_context)] == draft_context
    reference = ModelRunner(draft)
    reference.forward(torch.tensor(drafter.cached_tokens))
    for ours, theirs in zip(drafter.runner.cache.layers, reference.cache.layers):
        assert_reordered(ours.keys, theirs.keys)


# --- lossless generation with SmolLM2 as the target ------------------------------------------------------------


def test_same_tokenizer_through_text_accepts_every_draft(smollm, assert_lossless):
    """SmolLM2 drafting for itself through the text path: every draft token survives the round trip. The draft
    tokenizer is loaded from the draft model's name_or_path."""
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, "def fibonacci(n):", "universal", 24, draft_model=model)
    assert result.stats["acceptance_rate"] > 0.9
    assert result.stats["mean_accepted_tokens"] > 4


def test_eos_inside_a_draft_ends_generation(smollm, greedy):
    model, tokenizer = smollm
    prompt = [{"role": "user", "content": "Say hi."}]
    expected = greedy(model, tokenizer, prompt, 40)
    # every draft is accepted (the draft is the target), so a step commits gamma + 1 tokens: pick a gamma that
    # puts the EOS inside a draft rather than at a step's bonus position
    gamma = next(g for g in range(4, 12) if len(expected.token_ids) % (g + 1))
    stream = accelgen.generate(model, tokenizer, prompt, method="universal", draft_model=model, gamma=gamma,
                               draft_tokenizer="smollm2-135m", max_new_tokens=40, stream=True)
    last_chunk = list(stream)[-1]
    assert stream.result.token_ids == expected.token_ids
    assert stream.result.finish_reason == "stop" and last_chunk.token_ids[-1] == tokenizer.eos_token_id
    assert stream.result.stats["accepted_per_step"][-1] == len(last_chunk.token_ids)  # EOS came from the draft


@pytest.mark.parametrize("max_new_tokens", [1, 3])
def test_max_new_tokens_smaller_than_a_draft(smollm, assert_lossless, max_new_tokens):
    model, tokenizer = smollm
    result = assert_lossless(model, tokenizer, "def fibonacci(n):", "universal", max_new_tokens,
                             draft_model=model, gamma=6)
    assert len(result.token_ids) == max_new_tokens and result.finish_reason == "length"


def test_scripted_draft_with_another_tokenizer_is_mostly_accepted(smollm, other_tokenizer, greedy, assert_lossless):
    """The draft knows the target's own continuation but splits it into other tokens: whatever is lost to
    boundaries is what alignment gets wrong."""
    model, tokenizer = smollm
    prompt = "def fibonacci(n):"
    text = prompt + greedy(model, tokenizer, prompt, 24).text
    result = assert_lossless(model, tokenizer, prompt, "universal", 24, draft_model=TextOracle(other_tokenizer, text),
                             draft_tokenizer=other_tokenizer, gamma=6)
    assert result.stats["acceptance_rate"] > 0.6
    assert result.stats["mean_accepted_tokens"] > 3


@pytest.mark.parametrize("prompt", [
    "",
    "naïve café — 日本語 😀\n\t x = {'a': [1, 2]}",
    "<|im_start|>user\nhi<|im_end|>\n",
])
def test_random_draft_with_another_tokenizer_is_lossless(smollm, other_tokenizer, make_tiny_model, assert_lossless,
                                                         prompt):
    model, tokenizer = smollm
    draft = make_tiny_model("llama", seed=1, vocab_size=len(other_tokenizer))
    result = assert_lossless(model, tokenizer, prompt, "universal", 8, draft_model=draft,
                             draft_tokenizer=other_tokenizer)
    assert result.stats["draft_tokens"] > 0  # its junk text did reach the target as tokens


def test_a_missing_draft_tokenizer_is_a_clear_error(tiny_target, tokenizer, make_tiny_model, tmp_path):
    draft = make_tiny_model("llama", seed=1, vocab_size=320)  # built here: no name_or_path to load a tokenizer from
    with pytest.raises(ValueError, match="draft_tokenizer="):
        accelgen.generate(tiny_target, tokenizer, [5, 6], method="universal", draft_model=draft, max_new_tokens=2)
    with pytest.raises(ValueError, match="could not load the draft tokenizer"):
        accelgen.generate(tiny_target, tokenizer, [5, 6], method="universal", draft_model=draft, max_new_tokens=2,
                          draft_tokenizer=str(tmp_path / "missing"))


def test_sampling_is_refused(tiny_target, tokenizer, other_tokenizer, make_tiny_model):
    draft = make_tiny_model("llama", seed=1, vocab_size=len(other_tokenizer))
    with pytest.raises(ValueError, match="greedy"):
        accelgen.generate(tiny_target, tokenizer, [5, 6], method="universal", draft_model=draft, temperature=1.0,
                          draft_tokenizer=other_tokenizer)
