"""Every architecture HF decodes with a KV cache, against every core method: HF greedy's tokens, or a clear refusal.

Tiny random models (fp32, 2 layers, hidden size 64, seeded) of each architecture; each core method must give
exactly `model.generate(do_sample=False)`'s tokens, or refuse with a ValueError naming the architecture or
the feature it lacks. Sliding-window models come twice: with their default window, larger than the context,
and with a window of a few positions, which every draft tree then crosses.

`python tests/models/test_architectures.py` prints the table (architecture × method) as Markdown, as it
appears in docs/architectures.md.
"""

from __future__ import annotations

import sys
import tempfile

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import accelgen
from accelgen.models.early_exit import EarlyExitRunner
from accelgen.drafters.self_speculative import skipping_runner
from accelgen.models.layouts import DECODER_LAYOUTS
from accelgen.models.runner import ModelRunner
from accelgen.heads.medusa import MedusaHeads

pytestmark = pytest.mark.usefixtures("one_thread")  # these tiny models run fastest on one thread

VOCAB = 1024
PROMPT = [5, 17, 923, 410, 77, 12, 5, 17, 923]  # repeats itself, so that n-gram drafts find matches
NEW_TOKENS = 16
SPECIAL = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=2)
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, **SPECIAL)
GPT2_LIKE = dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, initializer_range=0.2, **SPECIAL)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
TWO_LAYER_TYPES = ["sliding_attention", "full_attention"]

# name -> (HF model_type, config options)
ARCHITECTURES = {
    "Llama": ("llama", LLAMA_LIKE),
    "Mistral": ("mistral", LLAMA_LIKE),  # its default sliding window, 4096, covers the context
    "Mistral, window 8": ("mistral", {**LLAMA_LIKE, "sliding_window": 8}),
    "Qwen2": ("qwen2", LLAMA_LIKE),
    "Qwen3": ("qwen3", {**LLAMA_LIKE, "head_dim": 16}),
    "Gemma": ("gemma", {**LLAMA_LIKE, "head_dim": 16}),
    "Gemma 2": ("gemma2", {**LLAMA_LIKE, "head_dim": 16}),
    "Gemma 2, window 4": ("gemma2", {**LLAMA_LIKE, "head_dim": 16, "sliding_window": 4}),
    "Gemma 3 (text), window 4": ("gemma3_text", {**LLAMA_LIKE, "head_dim": 16, "sliding_window": 4,
                                                 "layer_types": TWO_LAYER_TYPES}),
    "Phi-3": ("phi3", LLAMA_LIKE),
    "Phi-3, window 2047": ("phi3", {**LLAMA_LIKE, "sliding_window": 2047}),  # Phi-3-mini-4k's
    "Phi-3, window 8": ("phi3", {**LLAMA_LIKE, "sliding_window": 8}),
    "GPT-2": ("gpt2", GPT2_LIKE),
    "GPT-NeoX": ("gpt_neox", {**LLAMA_LIKE, "num_key_value_heads": 4}),
    "GPT-NeoX, sequential residual": ("gpt_neox", {**LLAMA_LIKE, "num_key_value_heads": 4,
                                                   "use_parallel_residual": False}),
    "OPT": ("opt", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                        word_embed_proj_dim=64, max_position_embeddings=256, init_std=0.2, **SPECIAL)),
    "Falcon": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.2,
                              **SPECIAL)),
    "Falcon, new decoder architecture": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                        num_kv_heads=2, new_decoder_architecture=True,
                                                        initializer_range=0.2, **SPECIAL)),
    "Falcon, sequential": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          parallel_attn=False, initializer_range=0.2, **SPECIAL)),
    "Falcon, ALiBi": ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                                     initializer_range=0.2, **SPECIAL)),
    "GPTBigCode": ("gpt_bigcode", GPT2_LIKE),
    "GPT-J": ("gptj", {**GPT2_LIKE, "rotary_dim": 8}),
    "OLMo": ("olmo", LLAMA_LIKE),
    "OLMo 2": ("olmo2", LLAMA_LIKE),
    "Cohere": ("cohere", LLAMA_LIKE),
    "StableLM": ("stablelm", LLAMA_LIKE),
    "StableLM, parallel residual": ("stablelm", {**LLAMA_LIKE, "use_parallel_residual": True}),
    "Granite": ("granite", LLAMA_LIKE),
    "Mixtral": ("mixtral", {**LLAMA_LIKE, **MOE}),
    "Qwen3-MoE": ("qwen3_moe", {**LLAMA_LIKE, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 64}),
    "Bloom (ALiBi)": ("bloom", dict(hidden_size=64, n_layer=2, n_head=4, initializer_range=0.2, **SPECIAL)),
    "MPT (ALiBi)": ("mpt", dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=256, **SPECIAL)),
    "Mamba (recurrent)": ("mamba", dict(hidden_size=64, num_hidden_layers=2, state_size=4, **SPECIAL)),
}

# method -> its options; the target drafts for itself where a method needs a draft model (the draft's quality
# does not matter for exactness), Medusa drafts from untrained heads
METHODS = {
    "autoregressive": {},
    "speculative": {"gamma": 4},
    "specinfer": {"draft_budget": "method"},  # the method's whole tree: trees scored on every architecture
    "pld": {"draft_length": 4},
    "trie-lookahead": {"max_nodes": 8},
    "lookahead-decoding": {"max_nodes": 8},
    "jacobi": {},
    "medusa": {"paths": [[0], [1], [0, 0]]},
    "self-speculative": {"skip": {"skip_attention": [1], "skip_mlp": [1]}, "draft_budget": "method"},
    "layerskip": {"exit_layer": 0, "draft_budget": "method"},
}
NEEDS_DRAFT_MODEL = ("speculative", "specinfer")
ALWAYS_TREES = ("specinfer", "lookahead-decoding", "medusa")  # (trie-lookahead drafts a chain where its trie has one branch)
LAYER_SKIPPING = ("self-speculative", "layerskip")


def build(name: str):
    """The tiny random model of an architecture, fp32, eval mode, seeded."""
    model_type, options = ARCHITECTURES[name]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **options)).eval()


def hf_greedy(model, eos: int) -> list[int]:
    """HF's own greedy continuation of PROMPT, new tokens only, stopping at `eos` as accelgen does."""
    output = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                            pad_token_id=eos)
    return output[0, len(PROMPT):].tolist()


def outcome(model, tokenizer, method: str, medusa_heads: str, reference: list[int] | None) -> str:
    """"identical" when the method's tokens are HF greedy's; "refused: <the ValueError's message>" when it
    refuses; "DIFFERENT: ..." otherwise. Any other exception propagates (a crash)."""
    options = dict(METHODS[method])
    if method in NEEDS_DRAFT_MODEL:
        options["draft_model"] = model
    if method == "medusa":
        options["heads"] = medusa_heads
    try:
        tokens = accelgen.generate(model, tokenizer, PROMPT, method=method, max_new_tokens=NEW_TOKENS,
                                   **options).token_ids
    except ValueError as refusal:
        return f"refused: {refusal}"
    return "identical" if tokens == reference else f"DIFFERENT: {tokens} instead of {reference}"


def save_random_medusa_heads(folder) -> str:
    """Untrained (random) Medusa heads for the tiny models, saved in folder: exactness must hold for any draft."""
    torch.manual_seed(0)
    MedusaHeads(2, 64, VOCAB).save(folder)
    return str(folder)


@pytest.fixture(scope="module")
def medusa_heads(tmp_path_factory):
    return save_random_medusa_heads(tmp_path_factory.mktemp("medusa") / "random")


@pytest.fixture(scope="module")
def built():
    """name -> what model_and_reference built."""
    return {}


def model_and_reference(built, name: str, eos: int):
    """(the architecture's tiny model, HF greedy's tokens; None for the recurrent model, which every method
    refuses), built once per module."""
    if name not in built:
        model = build(name)
        built[name] = (model, None if ARCHITECTURES[name][0] == "mamba" else hf_greedy(model, eos))
    return built[name]


# Medusa reads the final hidden states from the base model's output; OPT's causal LM never calls its base model
NO_BASE_MODEL_CALL = ("opt",)


def walks_layers(model_type: str, options: dict) -> bool:
    """Whether the layer-skipping runners have a description of this layout (models/layouts.py)."""
    return (model_type in DECODER_LAYOUTS or model_type == "falcon") and not options.get("alibi")


def expected_refusal(name: str, method: str) -> str | None:
    """What the refusal of this cell must say (the architecture or the feature missing), None where the method
    must give HF greedy's tokens."""
    model_type, options = ARCHITECTURES[name]
    window = options.get("sliding_window")
    if model_type == "mamba":
        return "recurrent"
    if method in ALWAYS_TREES and options.get("alibi"):  # an ALiBi model without a description (Falcon's option)
        return "alibi=True: accelgen cannot score token trees"
    if method == "medusa" and model_type in NO_BASE_MODEL_CALL:
        return "does not call its base model"
    if method in LAYER_SKIPPING and not walks_layers(model_type, options):
        return model_type
    if method in LAYER_SKIPPING and window is not None and window < len(PROMPT) + NEW_TOKENS:
        return f"sliding window of {window} positions"
    return None


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_each_method_is_hf_greedy_or_refuses_clearly(built, tokenizer, medusa_heads, name, method):
    refusal = expected_refusal(name, method)
    model, reference = model_and_reference(built, name, tokenizer.eos_token_id)
    result = outcome(model, tokenizer, method, medusa_heads, reference)
    if refusal is None:
        assert result == "identical", result
    else:
        assert result.startswith("refused: ") and refusal in result, result


@pytest.mark.parametrize("name", [name for name, (model_type, options) in ARCHITECTURES.items()
                                  if walks_layers(model_type, options)])
def test_described_layouts_walked_in_full_give_the_models_own_logits(built, tokenizer, name, assert_reordered):
    """The layer-walking runners (layer skipping, early exit), skipping nothing, compute what the model does."""
    model = build(name)
    reach = min(8, ARCHITECTURES[name][1].get("sliding_window", 8))  # positions 0..reach-1: inside the window
    tokens = torch.tensor(PROMPT[: reach // 2])
    reference = ModelRunner(model).forward(tokens)
    assert_reordered(skipping_runner(model, skip_attention=[], skip_mlp=[]).forward(tokens), reference)

    class NeverExit:
        def first_layer(self, position):
            return 0

        def should_exit(self, token, layer, hidden, previous, logits):
            return False

    early_exit, plain = EarlyExitRunner(model, NeverExit()), ModelRunner(model)
    early_exit.forward(tokens)
    plain.forward(tokens)
    for token in PROMPT[reach // 2 : reach]:  # one token at a time: the early-exit walk proper
        assert_reordered(early_exit.forward(torch.tensor([token])), plain.forward(torch.tensor([token])))


def markdown_table(results: dict[str, dict[str, str]]) -> str:
    """The architecture × method table: ✓ identical to HF greedy, ✗ a clear refusal, with its reason below."""
    lines = ["| architecture | " + " | ".join(f"`{method}`" for method in METHODS) + " |",
             "|---|" + "---|" * len(METHODS)]
    for name, row in results.items():
        cells = ["✓" if row[method] == "identical" else "✗" if row[method].startswith("refused") else "**wrong**"
                 for method in METHODS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    from accelgen.models.loading import load_model

    torch.set_num_threads(1)  # as the tests run them (see one_thread)
    tokenizer = load_model("smollm2-135m", dtype="float32")[1]
    folder = save_random_medusa_heads(tempfile.mkdtemp())
    results, cells_by_reason = {}, {}
    for name in ARCHITECTURES:
        model, reference = model_and_reference({}, name, tokenizer.eos_token_id)
        results[name] = {method: outcome(model, tokenizer, method, folder, reference) for method in METHODS}
        for method, result in results[name].items():
            if result != "identical":
                cells_by_reason.setdefault(result, []).append(f"{name} `{method}`")
    print(markdown_table(results))
    print()
    for reason, cells in cells_by_reason.items():
        print(f"- {', '.join(cells)}: {reason}")


if __name__ == "__main__":
    sys.exit(main())
