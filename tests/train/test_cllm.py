"""CLLM: Jacobi trajectories collected in batches reach greedy decoding's tokens; the losses; training lowers the
consistency loss and resumes exactly; artifacts of another model are refused; and the tuned model, decoded with
jacobi and lookahead-decoding, gives its own greedy output."""

import json

import pytest
import torch
from typer.testing import CliRunner

import accelgen
from accelgen.models.runner import ModelRunner
from accelgen.train.cllm import (
    CLLM_FILE,
    CllmConfig,
    base_identity,
    block_logits,
    check_base,
    cllm_losses,
    encode_contexts,
    evaluate_cllm,
    train_cllm,
    unsettled_positions,
    valid_positions,
)
from accelgen.train.loop import ScaleOut
from accelgen.train.trajectories import (
    CollectionSettings,
    cached_trajectories,
    collect_trajectories,
    jacobi_iterate,
)

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = {2}
PROMPTS = [[5, 17, 923, 4410, 77, 12], [40, 41, 42], [300, 301, 302, 303, 304, 305, 306, 307, 308], [7, 8]]


def collect(model, prompts=PROMPTS, block_size=6, blocks=3, seed=0, eos=frozenset()):
    settings = CollectionSettings(block_size=block_size, blocks_per_prompt=blocks)
    return collect_trajectories(model, prompts, settings, set(eos), torch.Generator().manual_seed(seed))


def test_fixed_points_are_greedy_decoding_and_each_state_is_a_jacobi_iteration(tiny_target, tokenizer, greedy):
    trajectories = collect(tiny_target)
    assert len(trajectories) == 3 * len(PROMPTS)
    for index, prompt in enumerate(PROMPTS):
        mine = [t for t in trajectories if t.prompt == index]
        mine.sort(key=lambda t: len(t.context))
        expected = greedy(tiny_target, tokenizer, prompt, 18).token_ids
        assert torch.cat([t.fixed_point for t in mine]).tolist() == expected
        for t in mine:
            assert t.iterations <= 6 + 1  # n iterations at most, up to ties
            for state, following in zip(t.states[:-1], t.states[1:]):  # one unbatched Jacobi step each
                runner = ModelRunner(tiny_target)
                runner.forward(t.context[:-1], logits_for_last=1)
                assert jacobi_iterate([runner], [int(t.context[-1])], [state])[0].tolist() == following.tolist()


def test_collection_stops_a_prompt_at_an_eos_fixed_point(tiny_target):
    free = collect(tiny_target, prompts=PROMPTS[:1], blocks=2)
    first = min(free, key=lambda t: len(t.context))
    eos_token = int(first.fixed_point[2])  # pretend a token of the first block is EOS
    stopped = collect(tiny_target, prompts=PROMPTS[:1], blocks=2, eos={eos_token})
    assert len(stopped) == 1 and torch.equal(stopped[0].fixed_point, first.fixed_point)


def test_shards_are_reused_and_refused_for_another_model(tiny_target, tiny_draft, tmp_path, monkeypatch):
    settings = CollectionSettings(block_size=4, blocks_per_prompt=2, prompts_per_shard=3)
    done = []
    first = cached_trajectories(tiny_target, PROMPTS, settings, EOS, tmp_path, progress=done.append)
    assert done == [3, 4] and sorted({t.prompt for t in first}) == [0, 1, 2, 3]
    assert len(list((tmp_path / "trajectories").glob("shard-*.pt"))) == 2
    from accelgen.train import trajectories

    monkeypatch.setattr(trajectories, "collect_trajectories", lambda *a, **k: pytest.fail("collected again"))
    again = cached_trajectories(tiny_target, PROMPTS, settings, EOS, tmp_path)
    assert [(t.prompt, t.states.tolist()) for t in again] == [(t.prompt, t.states.tolist()) for t in first]
    with pytest.raises(ValueError, match="collected by another model"):
        cached_trajectories(tiny_draft, PROMPTS, settings, EOS, tmp_path)
    with pytest.raises(ValueError, match="other settings"):
        cached_trajectories(tiny_target, PROMPTS, CollectionSettings(block_size=5, blocks_per_prompt=2,
                                                                     prompts_per_shard=3), EOS, tmp_path)


def test_masks_of_eos_and_settled_prefixes():
    fixed = torch.tensor([[5, 2, 7, 8], [5, 6, 7, 8]])
    assert valid_positions(fixed, {2}).tolist() == [[True, True, False, False], [True] * 4]
    states = torch.tensor([[5, 9, 7, 8], [5, 6, 7, 8]])
    # position i counts when a token before it is wrong: row 0 is wrong at 1, so positions 2 and 3
    assert unsettled_positions(states, fixed).tolist() == [[False, False, True, True], [False] * 4]


def test_a_padded_batch_scores_each_block_as_alone(tiny_target, assert_reordered):
    contexts = [torch.tensor(p) for p in PROMPTS]
    blocks = torch.randint(3, 1000, (len(PROMPTS), 5), generator=torch.Generator().manual_seed(1))
    batched = block_logits(tiny_target, encode_contexts(tiny_target, contexts, 2), blocks)
    for row, (context, block) in enumerate(zip(contexts, blocks)):
        alone = tiny_target(torch.cat([context, block])[None]).logits[0, len(context) - 1 : -1].float()
        assert_reordered(batched[row], alone)


def test_losses_vanish_where_the_state_is_the_fixed_point(tiny_target):
    trajectories = [t for t in collect(tiny_target) if t.iterations >= 2]
    fixed = torch.stack([t.fixed_point for t in trajectories])
    consistency, ar, counts = cllm_losses(tiny_target, trajectories, fixed, 64, 2, set())
    assert counts["consistency_positions"] == 0 and float(consistency.detach()) == 0.0
    assert counts["agree"] == counts["ar_positions"]  # the model's own greedy tokens
    noisy = torch.stack([t.states[0] for t in trajectories])
    consistency, ar2, counts = cllm_losses(tiny_target, trajectories, noisy, 64, 2, set())
    assert counts["consistency_positions"] > 0 and float(consistency.detach()) > 0.01
    assert float(ar2.detach()) == pytest.approx(float(ar.detach()))


def small_config(**changes):
    settings = {"steps": 12, "batch_size": 4, "context_len": 64, "learning_rate": 3e-3, "checkpoint_every": 4}
    return CllmConfig(**{**settings, **changes})


def test_the_consistency_loss_alone_falls_on_a_toy_trajectory_set(make_tiny_model, tokenizer, tmp_path):
    model = make_tiny_model("qwen2", seed=5, layers=2)
    trajectories = collect(model, block_size=6, blocks=2)
    before = evaluate_cllm(model, trajectories, 64, 2, set())
    assert before["agreement"] == pytest.approx(1.0) and before["tokens_per_iteration"] < 1.1
    train_cllm(model, tokenizer, trajectories, small_config(steps=20, ar_weight=0.0), tmp_path / "out", set())
    after = evaluate_cllm(model, trajectories, 64, 2, set())
    assert after["consistency"] < 0.5 * before["consistency"]
    assert (tmp_path / "out" / "config.json").exists() and (tmp_path / "out" / "trainer.pt").exists()


def test_with_the_ar_loss_jacobi_converges_faster_to_the_same_tokens(make_tiny_model, tokenizer, tmp_path):
    """The AR loss keeps the fixed points (the original's greedy tokens), while the consistency loss makes Jacobi
    iteration fix more of them per iteration. (The KL itself may rise here: the AR loss sharpens a random model's
    flat distributions, the consistency loss's targets.)"""
    model = make_tiny_model("qwen2", seed=5, layers=2)
    trajectories = collect(model, block_size=6, blocks=2)
    before = evaluate_cllm(model, trajectories, 64, 2, set())
    train_cllm(model, tokenizer, trajectories, small_config(steps=20), tmp_path / "out", set())
    after = evaluate_cllm(model, trajectories, 64, 2, set())
    assert after["agreement"] == pytest.approx(1.0) and after["ar_loss"] < before["ar_loss"]
    assert after["tokens_per_iteration"] > before["tokens_per_iteration"] + 0.2


def test_a_resumed_run_ends_with_the_same_weights(make_tiny_model, tokenizer, tmp_path):
    trajectories = collect(make_tiny_model("qwen2", seed=6), block_size=4, blocks=2)
    straight = make_tiny_model("qwen2", seed=6)
    train_cllm(straight, tokenizer, trajectories, small_config(steps=6), tmp_path / "straight", EOS)
    interrupted = make_tiny_model("qwen2", seed=6)
    train_cllm(interrupted, tokenizer, trajectories, small_config(steps=4), tmp_path / "resumed", EOS)
    resumed = make_tiny_model("qwen2", seed=6)
    result = train_cllm(resumed, tokenizer, trajectories, small_config(steps=6), tmp_path / "resumed", EOS)
    assert result["resumed_at"] == 4
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    with pytest.raises(ValueError, match="other settings"):
        train_cllm(resumed, tokenizer, trajectories, small_config(steps=6, ar_weight=2.0), tmp_path / "resumed", EOS)


def test_gradient_accumulation_ends_with_the_weights_of_whole_batches(make_tiny_model, tokenizer, tmp_path):
    trajectories = collect(make_tiny_model("qwen2", seed=6), block_size=4, blocks=2)
    config = small_config(steps=2, batch_size=5)  # contexts of several lengths, left-padded in each micro-batch
    whole = make_tiny_model("qwen2", seed=6)
    train_cllm(whole, tokenizer, trajectories, config, tmp_path / "whole", EOS)
    for micro in (2, 3):
        accumulated = make_tiny_model("qwen2", seed=6)
        train_cllm(accumulated, tokenizer, trajectories, config, tmp_path / str(micro), EOS,
                   scale=ScaleOut(grad_accum=micro))
        for (name, expected), got in zip(whole.state_dict().items(), accumulated.state_dict().values()):
            # summing the gradient in parts (and padding each part's contexts to its own width) rounds differently,
            # which Adam turns into moves of up to ~1e-5 (0.3% of the learning rate); other batches move ~1e-2
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-4, msg=name)


def test_a_run_folder_of_another_base_model_is_refused(tiny_target, tiny_draft, tmp_path):
    (tmp_path / CLLM_FILE).write_text(json.dumps(base_identity(tiny_target, "tiny-target")))
    check_base(tmp_path, base_identity(tiny_target, "the same weights, named otherwise"))
    with pytest.raises(ValueError, match="tuned from 'tiny-target'.*use another --out"):
        check_base(tmp_path, base_identity(tiny_draft, "tiny-draft"))


def test_the_command_tunes_a_model_that_jacobi_decodes_exactly(command_inputs, tmp_path):
    from accelgen.cli import app

    folder, _ = command_inputs(seed=7)
    prompts = tmp_path / "prompts.jsonl"  # the benchmark's JSONL format
    prompts.write_text("".join(json.dumps({"prompt": f"line {i}: the quick brown fox"}) + "\n" for i in range(8)))
    dataset = f"jsonl:{prompts}"
    out = tmp_path / "tuned"
    arguments = ["train", "cllm", "--model", str(folder), "--out", str(out), "--sources", dataset, "--prompts", "6",
                 "--held-out", "2", "--block-size", "6", "--blocks-per-prompt", "2", "--prompts-per-shard", "3",
                 "--steps", "6", "--batch-size", "4", "--learning-rate", "3e-3", "--context-len", "32"]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 0, result.output
    record = json.loads((out / CLLM_FILE).read_text())
    assert record["base_model"] == str(folder) and record["held_out_after"]["blocks"] > 0
    assert record["training_blocks"] > 0 and record["training_seconds"] > 0

    tuned, tokenizer = accelgen.load_model(str(out), dtype="float32")
    original, _ = accelgen.load_model(str(folder), dtype="float32")
    assert any(not torch.equal(a, b) for a, b in zip(tuned.state_dict().values(), original.state_dict().values()))
    for prompt in ([5, 17, 923, 4410, 77, 12], [40, 41, 42, 43]):
        own = accelgen.generate(tuned, tokenizer, prompt, max_new_tokens=20).token_ids
        for method, options in (("jacobi", {"block_size": 6}), ("jacobi", {"block_size": 30}),
                                ("lookahead-decoding", {})):
            decoded = accelgen.generate(tuned, tokenizer, prompt, method=method, max_new_tokens=20, **options)
            assert decoded.token_ids == own, (method, options)

    command_inputs(seed=8)  # the same folder, other weights
    refused = CliRunner().invoke(app, arguments)
    assert refused.exit_code == 2 and "tuned from" in refused.output and "Traceback" not in refused.output


def test_drift_compares_the_two_models_greedy_rows(tmp_path):
    from accelgen.train.cllm import bench_drift

    def bench(name, rows, passed):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "records.jsonl").write_text("".join(
            json.dumps({"prompt_id": p, "method": m, "token_ids": t}) + "\n" for p, m, t in rows))
        (folder / "executions.jsonl").write_text("".join(
            json.dumps({"prompt_id": p, "method": "autoregressive", "passed": ok}) + "\n" for p, ok in passed.items()))
        return folder

    original = bench("original", [("a", "autoregressive", [1, 2, 3, 4]), ("b", "autoregressive", [5, 6]),
                                  ("a", "jacobi", [9])], {"a": True, "b": False})
    tuned = bench("tuned", [("a", "autoregressive", [1, 2, 7, 4]), ("b", "autoregressive", [5, 6])],
                  {"a": False, "b": False})
    drift = bench_drift(original, tuned)
    assert drift["prompts"] == 2 and drift["identical"] == 1
    assert drift["token_agreement"] == pytest.approx(5 / 6)
    assert [p["common_prefix"] for p in drift["per_prompt"]] == [2, 2]
    assert drift["pass_at_1"] == {"original": 0.5, "tuned": 0.0}
    with pytest.raises(ValueError, match="no 'jacobi' rows"):
        bench_drift(original, tuned, method="jacobi")
