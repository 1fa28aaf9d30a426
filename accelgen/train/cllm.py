"""Consistency LLMs (CLLM, Kou et al. 2024, arXiv:2403.00835): fine-tune a model so that Jacobi decoding of it
converges in fewer iterations.

Training data is the model's own Jacobi trajectories (train/trajectories.py): blocks of n tokens iterated from a
random start to their fixed point y*, the greedy continuation. Two losses:

- **Global consistency loss.** Fed a noisy state y of a trajectory after its context, the model should predict
  what it predicts when fed the fixed point: KL(p(· | context, y*_<i) ‖ p_θ(· | context, y_<i)) at every block
  position i, the target distribution detached (stop-gradient), as in the paper. A model that predicts the fixed
  point's tokens from a wrong prefix fixes many tokens per Jacobi iteration. Positions whose prefix is already
  the fixed point's see identical inputs and are left out (the paper masks them too). The paper writes the loss
  as a soft cross-entropy; the KL differs by the target's entropy, which has no gradient, and reads 0 when the
  model is consistent.
- **AR loss.** Cross-entropy of the fixed point's tokens given the context and the fixed prefix (teacher forcing
  on the model's own greedy output), which keeps the tuned model close to the original.

Positions after the first EOS of a fixed point count in neither loss. For speed on a CPU, gradients flow through the
block positions only: the context's KV cache is computed by the current weights without gradients, and cut to its
last `context_len` tokens (the trajectories were collected with the whole context; the held-out Jacobi iterations
use the whole context, as decoding does).

Decoding the tuned model with `jacobi` or `lookahead-decoding` is exact with respect to the *tuned* model, whose
greedy output may drift from the original's: `evaluate_cllm` measures the share of the original's greedy tokens
the tuned model still predicts (teacher-forced agreement), and the CLI's runs record it before and after training.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from accelgen.atomic import save_pretrained_atomically, write_json_atomically
from accelgen.errors import InputError
from accelgen.train.checkpoints import run_settings
from accelgen.train.loop import Checkpointing, ScaleOut, is_main_process, run_training, step_generator
from accelgen.train.trajectories import (
    CollectionSettings,
    Trajectory,
    collect_trajectories,
)

TRAINER_FILE = "trainer.pt"  # weights, optimizer state and step: what a rerun resumes from
CLLM_FILE = "cllm.json"  # beside the tuned model: what it was tuned from, and how


@dataclass
class CllmConfig:
    steps: int = 200
    batch_size: int = 4
    context_len: int = field(default=128, metadata={"help": "Context tokens before each block kept while training."})
    learning_rate: float = 2e-5
    ar_weight: float = field(default=1.0, metadata={"help": "Weight of the AR loss against the consistency loss."})
    checkpoint_every: int = 50
    seed: int = 0

    def __post_init__(self):
        if min(self.steps, self.batch_size, self.context_len, self.checkpoint_every) < 1:
            raise InputError("steps, batch size, context length and checkpoint interval must be positive")
        if self.ar_weight < 0 or self.learning_rate <= 0:
            raise InputError("the AR weight must be >= 0 and the learning rate positive")


# --- the identity of what a run tunes --------------------------------------------------------------------------


def base_identity(model, name: str) -> dict:
    """What the tuned model was tuned from: a run resumed or continued in the same folder must start from it."""
    from accelgen.drafters.distillspec import model_fingerprint

    return {"base_model": name, "base_fingerprint": model_fingerprint(model), "vocab_size": model.config.vocab_size,
            "hidden_size": model.config.hidden_size, "layers": model.config.num_hidden_layers}


def check_base(out_dir: Path, identity: dict) -> None:
    """A ValueError if out_dir already holds a CLLM run tuned from another model."""
    path = Path(out_dir) / CLLM_FILE
    if not path.exists():
        return
    try:
        saved = json.loads(path.read_text())
    except (ValueError, OSError) as error:
        raise InputError(f"{path} is unreadable ({error}); delete it or use another --out") from None
    if saved.get("base_fingerprint") != identity["base_fingerprint"]:
        raise InputError(f"{out_dir} holds a CLLM run tuned from {saved.get('base_model')!r} (fingerprint "
                         f"{saved.get('base_fingerprint')}), not from {identity['base_model']!r} (fingerprint "
                         f"{identity['base_fingerprint']}); use another --out")


def record_run(out_dir: Path, identity: dict, details: dict) -> None:
    """cllm.json: the base model's identity, with what the run adds (settings, evaluation)."""
    write_json_atomically(Path(out_dir) / CLLM_FILE, {**identity, **details})


# --- batches ---------------------------------------------------------------------------------------------------


def usable(trajectories: list[Trajectory]) -> list[Trajectory]:
    """Those with a noisy state to learn from (a start that was already the fixed point has none)."""
    return [t for t in trajectories if len(t.states) >= 2]


def step_examples(count: int, step: int, batch_size: int, seed: int) -> list[int]:
    """Indices of the trajectories of a step: each epoch a fresh permutation, a pure function of (seed, step) so
    that a resumed run sees the same batches."""
    picked = []
    for slot in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(slot, count)
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        picked.append(int(order[offset]))
    return picked


def noisy_states(trajectories: list[Trajectory], generator: torch.Generator) -> torch.Tensor:
    """(b, n) one state drawn from each trajectory's, the fixed point excluded."""
    return torch.stack([t.states[int(torch.randint(0, len(t.states) - 1, (1,), generator=generator))]
                        for t in trajectories])


def left_padded(contexts: list[torch.Tensor], pad_id: int) -> dict:
    """Model inputs for the contexts (L_i,) long, left-padded: input_ids, attention_mask, position_ids (b, L)."""
    width = max(len(c) for c in contexts)
    input_ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(contexts), width, dtype=torch.long)
    for row, context in enumerate(contexts):
        if len(context):
            input_ids[row, width - len(context):] = context
            mask[row, width - len(context):] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


@dataclass
class EncodedContexts:
    """The KV cache of a batch of contexts but their last tokens (left-padded), computed without gradients: the
    losses differentiate through the block positions only, which keeps a step's cost to a few block-sized passes
    after one inference forward of the contexts."""

    cache: object  # DynamicCache, batch b, or None for empty contexts
    mask: torch.Tensor  # (b, L) long: 1 at the cached positions of each row
    last_tokens: torch.Tensor  # (b,) long


@torch.no_grad()
def encode_contexts(model, contexts: list[torch.Tensor], pad_id: int) -> EncodedContexts:
    from accelgen import cache as kv

    heads, last = [c[:-1] for c in contexts], torch.stack([c[-1] for c in contexts])
    inputs = left_padded(heads, pad_id)
    if inputs["input_ids"].shape[1] == 0:
        return EncodedContexts(None, inputs["attention_mask"], last)
    cache = kv.new_cache(model.config)  # filled in place by the forward
    model(**{key: value.to(model.device) for key, value in inputs.items()}, use_cache=True, logits_to_keep=1,
          **{kv.cache_keyword(model): cache})
    return EncodedContexts(cache, inputs["attention_mask"], last)


def block_logits(model, encoded: EncodedContexts, blocks: torch.Tensor) -> torch.Tensor:
    """(b, n, vocab) float32: row i predicts block token i after the context and block[:i]. blocks: (b, n) long.
    Each call extends its own copy of the contexts' cache."""
    from accelgen import cache as kv

    size, width = blocks.shape[1], encoded.mask.shape[1]
    cache = kv.new_cache(model.config) if encoded.cache is None else kv.gather(
        encoded.cache, [torch.arange(width)] * len(encoded.cache.layers), model.config)
    inputs = torch.cat([encoded.last_tokens[:, None].to(model.device), blocks[:, :-1].to(model.device)], dim=1)
    mask = torch.cat([encoded.mask, torch.ones(blocks.shape, dtype=torch.long)], dim=1)  # (b, L + n) on the CPU
    positions = encoded.mask.sum(-1, keepdim=True) + torch.arange(size)
    output = model(input_ids=inputs, attention_mask=mask.to(model.device), position_ids=positions.to(model.device),
                   use_cache=True, **{kv.cache_keyword(model): cache})
    return output.logits.float()


def valid_positions(fixed: torch.Tensor, eos_ids: set[int]) -> torch.Tensor:
    """(b, n) bool: block positions up to and including the fixed point's first EOS. fixed: (b, n) long."""
    is_eos = torch.zeros_like(fixed, dtype=torch.bool)
    for eos in eos_ids:
        is_eos |= fixed == eos
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return ~after_eos


def unsettled_positions(states: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    """(b, n) bool: positions whose prefix in the state differs from the fixed point's (there the model's input
    differs). states, fixed: (b, n) long. Position i's prefix is tokens 0..i-1."""
    wrong = (states != fixed).long()
    wrong_before = wrong.cumsum(-1) - wrong
    return wrong_before > 0


def loss_positions(fixed: torch.Tensor, states: torch.Tensor, eos_ids: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid, counted) (b, n) bool: where the AR loss counts (up to the fixed point's first EOS), and where the
    consistency loss does (valid positions whose prefix in the state is not the fixed point's). fixed, states:
    (b, n) long."""
    valid = valid_positions(fixed, eos_ids)
    return valid, valid & unsettled_positions(states, fixed)


def position_losses(model, contexts: list[torch.Tensor], fixed: torch.Tensor, states: torch.Tensor,
                    pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(KL, AR cross-entropy, whether the model's top-1 is the fixed point's token) at each block position (b, n),
    after contexts[i] (L_i,) long: the KL of the block fed the noisy state states[i] from it fed the fixed point
    fixed[i], and the fixed point's tokens teacher-forced. fixed, states: (b, n) long."""
    encoded = encode_contexts(model, contexts, pad_id)
    fixed_logits = block_logits(model, encoded, fixed)
    state_logits = block_logits(model, encoded, states)
    fixed = fixed.to(model.device)
    ar = torch.nn.functional.cross_entropy(fixed_logits.transpose(1, 2), fixed, reduction="none")
    target = torch.log_softmax(fixed_logits.detach(), dim=-1)
    kl = torch.nn.functional.kl_div(torch.log_softmax(state_logits, dim=-1), target, log_target=True,
                                    reduction="none").sum(-1)
    return kl, ar, fixed_logits.detach().argmax(-1) == fixed


def cllm_losses(model, trajectories: list[Trajectory], states: torch.Tensor, context_len: int, pad_id: int,
                eos_ids: set[int]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(consistency loss, AR loss, counts) over a batch: each trajectory fed the noisy state states[i] (b, n)."""
    fixed = torch.stack([t.fixed_point for t in trajectories])
    valid, counted = (mask.to(model.device) for mask in loss_positions(fixed, states, eos_ids))
    kl, ar, agrees = position_losses(model, [t.context[-context_len:] for t in trajectories], fixed, states, pad_id)
    consistency = (kl * counted).sum() / counted.sum().clamp(min=1)
    ar_loss = (ar * valid).sum() / valid.sum().clamp(min=1)
    return consistency, ar_loss, {"consistency_positions": int(counted.sum()), "ar_positions": int(valid.sum()),
                                  "agree": int((agrees & valid).sum())}


# --- training --------------------------------------------------------------------------------------------------


def trajectories_digest(trajectories: list[Trajectory]) -> str:
    """A short hash of the training set: a resumed run must train on the same trajectories."""
    digest = hashlib.sha256()
    for t in trajectories:
        digest.update(t.context.numpy().tobytes())
        digest.update(t.states.numpy().tobytes())
    return digest.hexdigest()[:16]


def train_cllm(model, tokenizer, trajectories: list[Trajectory], config: CllmConfig, out_dir: Path, eos_ids: set[int],
               progress: Callable[[dict], None] | None = None, scale: ScaleOut | None = None) -> dict:
    """Fine-tune `model` in place (all its weights, AdamW) on the trajectories, resuming from out_dir's checkpoint
    if there is one; checkpointed every `checkpoint_every` steps, and the model and tokenizer saved to out_dir as
    an HF folder at the end. scale: processes, precision, accumulation (train/loop.py). Returns steps, resumed_at,
    seconds and processes."""
    out_dir = Path(out_dir)
    data = usable(trajectories)
    if not data:
        raise InputError("no trajectory has a noisy state to train on; collect more (more prompts or a larger block)")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids, default=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate)

    def draw(step: int) -> dict:
        picked = [data[i] for i in step_examples(len(data), step, config.batch_size, config.seed)]
        fixed = torch.stack([t.fixed_point for t in picked])
        states = noisy_states(picked, step_generator(config.seed, step))
        valid, counted = loss_positions(fixed, states, eos_ids)
        contexts = left_padded([t.context[-config.context_len:] for t in picked], pad_id)
        return {"contexts": contexts["input_ids"], "context_mask": contexts["attention_mask"].bool(),  # (b, L)
                "fixed": fixed, "states": states, "valid": valid, "counted": counted,  # (b, n)
                "valid_per_row": positions_per_row(valid), "counted_per_row": positions_per_row(counted)}  # (b,)

    def loss_of(batch: dict) -> tuple[torch.Tensor, dict]:
        contexts = [ids[kept] for ids, kept in zip(batch["contexts"], batch["context_mask"])]
        kl, cross_entropy, _ = position_losses(model, contexts, batch["fixed"], batch["states"], pad_id)
        # each row's sum over its positions, over the whole batch's positions per row: averaged over any share of
        # the rows and weighted by it (as the loop does), these give the batch's means over its positions
        consistency = ((kl * batch["counted"]).sum(-1) / batch["counted_per_row"]).mean()
        ar = ((cross_entropy * batch["valid"]).sum(-1) / batch["valid_per_row"]).mean()
        return consistency + config.ar_weight * ar, {"consistency": float(consistency.detach()),
                                                     "ar": float(ar.detach())}

    model.train()
    settings = run_settings(config) | {"trajectories": trajectories_digest(data)}
    checkpointing = Checkpointing(out_dir / TRAINER_FILE, settings, "CLLM", config.checkpoint_every)
    times = run_training(model, optimizer, config.steps, draw, loss_of, scale=scale, checkpointing=checkpointing,
                         max_grad_norm=1.0, tokens_per_row=data[0].states.shape[1], progress=progress)
    model.eval()
    if is_main_process():
        save_pretrained_atomically(out_dir, model, tokenizer)
    return {"steps": config.steps, **times}


def positions_per_row(positions: torch.Tensor) -> torch.Tensor:
    """(b,): the batch's count of positions (b, n) bool over its rows (at least 1 in all), in every row."""
    return positions.sum().clamp(min=1).div(len(positions)).expand(len(positions))


# --- held-out evaluation ---------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_cllm(model, trajectories: list[Trajectory], context_len: int, pad_id: int, eos_ids: set[int],
                  seed: int = 0, batch_size: int = 8) -> dict:
    """On held-out trajectories (collected with the original model):

    consistency: the consistency loss (KL) on one noisy state per block, the same states at every evaluation;
    ar_loss and agreement: the AR loss, and the share of the original's greedy tokens (the fixed points) that
    this model's top-1 reproduces, teacher-forced (1.0 for the original, up to ties);
    tokens_per_iteration: tokens fixed per Jacobi iteration when this model iterates the same blocks from the same
    starts with their whole contexts (1.0 is autoregressive decoding's rate; n at most).
    """
    was_training = model.training
    model.eval()
    data = usable(trajectories)
    states = noisy_states(data, torch.Generator().manual_seed(seed))
    totals = {"consistency": 0.0, "consistency_positions": 0, "ar": 0.0, "ar_positions": 0, "agree": 0}
    for first in range(0, len(data), batch_size):
        batch, batch_states = data[first : first + batch_size], states[first : first + batch_size]
        consistency, ar, counts = cllm_losses(model, batch, batch_states, context_len, pad_id, eos_ids)
        totals["consistency"] += float(consistency) * counts["consistency_positions"]
        totals["ar"] += float(ar) * counts["ar_positions"]
        totals["consistency_positions"] += counts["consistency_positions"]
        totals["ar_positions"] += counts["ar_positions"]
        totals["agree"] += counts["agree"]
    size = data[0].states.shape[1]
    rerun = collect_trajectories(model, [t.context.tolist() for t in data],
                                 CollectionSettings(block_size=size, blocks_per_prompt=1), set(),
                                 torch.Generator(), starts=[t.states[0] for t in data])
    model.train(was_training)
    iterations = sum(t.iterations for t in rerun)
    return {"blocks": len(data), "block_size": size,
            "consistency": totals["consistency"] / max(1, totals["consistency_positions"]),
            "ar_loss": totals["ar"] / max(1, totals["ar_positions"]),
            "agreement": totals["agree"] / max(1, totals["ar_positions"]),
            "settled_blocks": len(rerun),
            "tokens_per_iteration": size * len(rerun) / max(1, iterations),
            "iterations_saved": 1 - iterations / max(1, size * len(rerun))}


def config_record(config: CllmConfig, collection: CollectionSettings) -> dict:
    return {"config": asdict(config), "collection": asdict(collection)}


# --- drift of the tuned model's decoding, from two benchmark runs ------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def bench_drift(original_dir: Path, tuned_dir: Path, method: str = "autoregressive") -> dict:
    """How far the tuned model's greedy output drifts from the original's, from two `accelgen bench` folders over
    the same prompts: per prompt, whether the `method` rows' tokens are identical and the length of their common
    prefix; overall, the position-wise token agreement, and pass@1 of each (where the runs had --execute)."""
    rows = {}
    for side, folder in (("original", original_dir), ("tuned", tuned_dir)):
        records = [r for r in read_jsonl(Path(folder) / "records.jsonl") if r["method"] == method]
        if not records:
            raise InputError(f"{folder} has no {method!r} rows to compare")
        rows[side] = {r["prompt_id"]: r["token_ids"] for r in records}
    shared = [p for p in rows["original"] if p in rows["tuned"]]
    if not shared:
        raise InputError(f"{original_dir} and {tuned_dir} share no prompt")
    prompts, same, compared = [], 0, 0
    for prompt in shared:
        a, b = rows["original"][prompt], rows["tuned"][prompt]
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += sum(x == y for x, y in zip(a, b))
        compared += max(len(a), len(b))
        prompts.append({"prompt": prompt, "identical": a == b, "common_prefix": prefix,
                        "original_tokens": len(a), "tuned_tokens": len(b)})
    return {"method": method, "prompts": len(shared), "identical": sum(p["identical"] for p in prompts),
            "token_agreement": same / max(1, compared),
            "pass_at_1": {side: pass_at_1(Path(folder) / "executions.jsonl", method, shared)
                          for side, folder in (("original", original_dir), ("tuned", tuned_dir))},
            "per_prompt": prompts}


def pass_at_1(path: Path, method: str, prompts: list[str]) -> float | None:
    """Share of the prompts whose `method` completion passed its tests, from a bench's executions.jsonl."""
    if not path.exists():
        return None
    passed = {r["prompt_id"]: r["passed"] for r in read_jsonl(path) if r["method"] == method}
    return sum(bool(passed.get(p)) for p in prompts) / len(prompts)
