"""Stop strings: the same cut and the same held-back text as a naive search, in time linear in the text; text\ndecoded incrementally, the same as decoding the whole output."""

import random
import time

import pytest

from accelgen.stopping import IncrementalText, Output, prefix_function


class VocabTokenizer:
    """Token i decodes to vocab[i]; a vocab of bytes decodes as UTF-8, as byte-level BPE tokenizers do."""

    def __init__(self, vocab):
        self.vocab = vocab

    def decode(self, ids, skip_special_tokens=True):
        if isinstance(self.vocab[0], bytes):
            return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")
        return "".join(self.vocab[i] for i in ids)


def naive_stop_at(text: str, stops: list[str]) -> int | None:
    """The reference: where the earliest stop string begins."""
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None


def naive_held_back(text: str, stops: list[str]) -> int:
    """The reference: the longest end of text that begins some stop string (quadratic in its length)."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def test_prefix_function():
    assert prefix_function("aabaaab") == [0, 1, 0, 1, 2, 2, 3]
    assert prefix_function("abcd") == [0, 0, 0, 0]
    assert prefix_function("") == []


def test_matches_the_naive_search_on_random_texts():
    rng = random.Random(0)
    vocab = ["a", "b", "ab", "ba", "aab", "c", "abab"]
    tokenizer = VocabTokenizer(vocab)
    for _ in range(300):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        output = Output(tokenizer, eos_token_ids=set(), stop=stops, max_new_tokens=40)
        streamed = ""
        while not output.done:
            output.add(rng.randrange(len(vocab)))
            text = tokenizer.decode(output.token_ids)
            streamed += output.stream_delta()
            if not output.done:
                assert naive_stop_at(text, stops) is None
                assert output.stop.held_back == naive_held_back(text, stops), (text, stops)
                assert text.startswith(streamed) and len(text) - len(streamed) == naive_held_back(text, stops)
        cut = naive_stop_at(tokenizer.decode(output.token_ids), stops)
        assert output.finish_reason == ("length" if cut is None else "stop")
        assert output.text == streamed == tokenizer.decode(output.token_ids)[:cut]
        if cut is not None:  # generation ended with the token that completed the stop string
            assert naive_stop_at(tokenizer.decode(output.token_ids[:-1]), stops) is None


def test_incomplete_utf8_is_held_back_and_a_stop_string_across_bytes_is_found():
    tokenizer = VocabTokenizer([b"x", "é".encode()[:1], "é".encode()[1:], b"y"])
    output = Output(tokenizer, eos_token_ids=set(), stop=["éy"], max_new_tokens=10)
    deltas = []
    for token in [0, 1, 2, 0, 1]:
        output.add(token)
        deltas.append(output.stream_delta())
    assert deltas == ["x", "", "", "éx", ""]  # "é" is held back while it could begin "éy"
    output.add(2)
    assert output.stream_delta() == "" and not output.done
    output.add(3)
    assert output.finish_reason == "stop" and output.text == "xéx"


def test_a_rewritten_end_of_text_is_matched_again():
    class Rewriting(VocabTokenizer):  # like clean_up_tokenization_spaces: " ." becomes "."
        def decode(self, ids, skip_special_tokens=True):
            return super().decode(ids).replace(" .", ".")

    output = Output(Rewriting(["a", " ", ".", "b"]), eos_token_ids=set(), stop=["a.b"], max_new_tokens=10)
    for token in [0, 1, 2]:
        assert not output.add(token)
    assert output.add(3) and output.text == ""


def seconds_per_token(stop: str, token_text: str, tokens: int = 10) -> float:
    output = Output(VocabTokenizer([token_text]), eos_token_ids=set(), stop=[stop], max_new_tokens=tokens + 1)
    started = time.perf_counter()
    for _ in range(tokens):
        output.add(0)
        output.stream_delta()
    return (time.perf_counter() - started) / tokens


def test_a_long_stop_string_costs_milliseconds_per_token():
    # 200,000 characters that the text keeps matching: trying every prefix took ~0.8 s per token
    for stop, token_text in [("z" * 200_000, "zz"), ("ab" * 100_000, "ab")]:
        baseline = seconds_per_token(stop[:4] + "!", token_text)
        assert seconds_per_token(stop, token_text) < 0.02 + 20 * baseline


def random_ids(tokenizer, rng: random.Random, count: int) -> list[int]:
    """Token ids a model might emit: mostly ordinary ones, with byte tokens that split UTF-8 characters (the first
    ids of a byte-level vocabulary), special tokens and multi-byte text among them."""
    special = sorted(tokenizer.all_special_ids)
    emoji = tokenizer.encode("é ✓ 🎉 日本語 \n\t  spaces", add_special_tokens=False)
    pools = [range(len(tokenizer)), range(256), special, emoji]
    return [rng.choice(rng.choices(pools, weights=[6, 2, 1, 2])[0]) for _ in range(count)]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_is_the_whole_decode(tokenizer, skip_special_tokens):
    """Settled a token at a time (and a few at a time), the text is what decoding every token at once gives,
    on SmolLM2's byte-level tokenizer; every settled piece is final."""
    rng = random.Random(1)
    options = {"skip_special_tokens": skip_special_tokens}
    for trial in range(30):
        ids = random_ids(tokenizer, rng, rng.randint(1, 120))
        text = IncrementalText(tokenizer, options)
        settled, start = [], 0
        while start < len(ids):
            step = rng.choice([1, 1, 1, 2, 5])  # a step commits one token or several
            for token in ids[start : start + step]:
                text.append(token)
            start += step
            new_text, rewritten = text.settle()
            assert not rewritten
            settled.append(new_text)
            assert text.text() == tokenizer.decode(ids[:start], **options)
            assert "".join(settled) == text.tail(0) and text.length == len(text.tail(0))
        settled.append(text.settle(final=True)[0])
        assert "".join(settled) == tokenizer.decode(ids, **options), trial


def test_streamed_text_is_the_whole_decode_with_stop_strings(tokenizer):
    """Output streams exactly the text of the whole decode, cut at the stop string, held back where it may begin."""
    rng = random.Random(2)
    for trial in range(20):
        ids = random_ids(tokenizer, rng, 80)
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        stop = whole[len(whole) // 2 : len(whole) // 2 + 3] if trial % 2 else "\u2603"  # found, or never
        output = Output(tokenizer, eos_token_ids=set(), stop=[stop] if stop.strip() else [], max_new_tokens=80)
        streamed = []
        for token in ids:
            done = output.add(token)
            streamed.append(output.stream_delta())
            if done:
                break
        assert "".join(streamed) == output.text, trial
        cut = whole.find(stop) if stop.strip() and stop in whole else len(whole)
        assert output.text == whole[:cut], trial


def test_a_stop_token_text_is_left_out_unless_kept(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hello world", add_special_tokens=False) + [eos]
    for keep, expected in [(False, "Hello world"), (True, "Hello world" + tokenizer.decode([eos]))]:
        output = Output(tokenizer, eos_token_ids={eos}, stop=[], max_new_tokens=10)
        output.set_text_options(skip_special_tokens=False, include_stop=keep)
        streamed = []
        for token in ids:
            output.add(token)
            streamed.append(output.stream_delta())
        assert output.finish_reason == "stop" and output.text == expected == "".join(streamed)
