"""`accelgen train ...`: what some methods need before they pay, trained on this CPU.

    layerskip      fine-tune so that early exits become accurate (train/layerskip.py)
    exit-heads     exit adapters and CALM's classifiers on a frozen model (train/exit_heads.py)
    consistent-ee  ConsistentEE's exit policy, by policy gradient (train/consistent_ee.py)
    medusa         Medusa / blockwise heads on the frozen target's last hidden states (train/medusa.py)
    eagle          an EAGLE head: one decoder layer over the frozen target's features (train/eagle.py)
    pass           PaSS look-ahead embeddings, so that the frozen target drafts for itself (train/pass_embeddings.py)
    distillspec    distil a draft model toward the target on the draft's own generations (train/distill.py)
    online         stream requests through `online` and watch the draft's acceptance rise (drafters/online.py)
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import fields
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from accelgen.atomic import save_pretrained_atomically, write_atomically, write_json_atomically

TARGET_WEIGHTS_HELP = ("Weight format of the frozen target: fp32, bf16, int8 or int4 (weight-only quantized). "
                       "What is trained learns the target as loaded: use it with the target in the same format.")


def register(app: typer.Typer) -> None:
    train_app = typer.Typer(no_args_is_help=True, help="Train what some methods need, on this CPU.")

    @train_app.command("layerskip")
    def layerskip(
        model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded name, HF id or local folder."),
        dataset: str = typer.Option("sharegpt", "--dataset", help="sharegpt (assistant turns, without the benchmark's "
                                                                 "sample) or jsonl:FILE."),
        out: Path = typer.Option(..., "--out", "-o", help="Folder for checkpoints and the trained model "
                                                          "(an existing checkpoint there is resumed)."),
        steps: int = typer.Option(200),
        batch_size: int = typer.Option(4, "--batch-size"),
        seq_len: int = typer.Option(128, "--seq-len"),
        learning_rate: float = typer.Option(2e-5, "--learning-rate"),
        p_max: float = typer.Option(0.1, "--p-max", help="Layer dropout of the last layer (lower layers less)."),
        exit_scale: float = typer.Option(1.0, "--exit-scale", help="Weight of the early-exit losses (e_scale)."),
        curriculum: str = typer.Option("rotational", help="rotational or gradual."),
        rotation: int = typer.Option(8, help="rotational: exits of every R-th layer per step."),
        checkpoint_every: int = typer.Option(25, "--checkpoint-every"),
        held_out: int = typer.Option(16, "--held-out", help="Windows kept out of training to measure exit accuracy."),
        threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads (default: torch's)."),
    ):
        """LayerSkip: layer dropout rising with depth + an early-exit loss; exit accuracy per layer before and after."""
        from rich.table import Table

        from accelgen.train.layerskip import LayerSkipConfig, exit_accuracy, train_layerskip

        with reported_errors():
            config = LayerSkipConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, learning_rate=learning_rate,
                                     p_max=p_max, exit_scale=exit_scale, curriculum=curriculum, rotation=rotation,
                                     checkpoint_every=checkpoint_every)
            target_model, tokenizer, windows = model_and_windows(model, "float32", dataset, seq_len,
                                                                 steps * batch_size, held_out, threads)
            held, training = windows[:held_out], windows[held_out:]
            with stderr.status("exit accuracy before training …"):
                before = exit_accuracy(target_model, held)
            with progress_bar(steps) as show:
                result = train_layerskip(target_model, tokenizer, training, config, out,
                                         progress=lambda row: show(row, "loss {loss:.3f}, {tokens_per_second:.0f} tokens/s"))
            after = exit_accuracy(target_model, held)
        table = Table("layer", "next token (before)", "next token (after)", "agrees with last (before)",
                      "agrees with last (after)")
        for old, new in zip(before, after):
            table.add_row(str(old["layer"]), f"{old['next_token']:.1%}", f"{new['next_token']:.1%}",
                          f"{old['agrees_with_last']:.1%}", f"{new['agrees_with_last']:.1%}")
        Console().print(table)
        write_json_atomically(Path(out) / "exit_accuracy.json", {
            "model": model, "dataset": dataset, "config": fields_of(config),
            "training_seconds": result["seconds"], "resumed_at": result["resumed_at"], "held_out_windows": held_out,
            "exit_accuracy_before": before, "exit_accuracy_after": after})
        plot_exit_accuracy(before, after, Path(out) / "exit_accuracy.png")
        stderr.print(f"trained {steps - result['resumed_at']} steps in {result['seconds']:.0f}s → {out} "
                      f"(use --model {out} --method layerskip); exit accuracy: {out}/exit_accuracy.json, .png")

    @train_app.command("exit-heads")
    def exit_heads(
        model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded name, HF id or local folder."),
        dataset: str = typer.Option("sharegpt", "--dataset", help="sharegpt or jsonl:FILE."),
        out: Path = typer.Option(..., "--out", "-o", help="Folder for the heads (then: calm -o heads=OUT)."),
        layers: Optional[str] = typer.Option(None, help="Comma-separated exit layers (default: calm's)."),
        windows: int = typer.Option(64, help="Windows of --seq-len tokens whose hidden states are kept."),
        held_out: int = typer.Option(8, "--held-out", help="Further windows kept out of training, to evaluate on."),
        seq_len: int = typer.Option(128, "--seq-len"),
        steps: int = typer.Option(300),
        batch_size: int = typer.Option(256, "--batch-size", help="Positions per step."),
        rank: int = typer.Option(64, help="Adapter width."),
        learning_rate: float = typer.Option(1e-3, "--learning-rate"),
        threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads (default: torch's)."),
    ):
        """Exit adapters (matched to the last layer) and CALM's early-exit classifiers, with the base model frozen."""
        from rich.table import Table

        from accelgen.train.exit_heads import evaluate_exit_heads, train_exit_heads

        with reported_errors():
            target_model, chosen, hidden, unseen = hidden_states_for(model, dataset, layers, windows, held_out,
                                                                     seq_len, threads)
            with progress_bar(steps) as show:
                heads = train_exit_heads(target_model, hidden, chosen, rank=rank, steps=steps, batch_size=batch_size,
                                         learning_rate=learning_rate, progress=lambda row: show(row, "loss {loss:.3f}"))
            heads.base_model = model
            heads.save(out)
            evaluation = evaluate_exit_heads(target_model, heads, unseen)
        table = Table("layer", "plain exit agrees with last", "adapted exit agrees", "classifier right")
        for row in evaluation:
            table.add_row(str(row["layer"]), f"{row['plain_agreement']:.1%}", f"{row['adapted_agreement']:.1%}",
                          f"{row['classifier_accuracy']:.1%}")
        Console().print(table)
        write_json_atomically(Path(out) / "evaluation.json", {"held_out_windows": held_out, "layers": evaluation})
        stderr.print(f"exit heads for layers {chosen} → {out}; use: --method calm -o heads={out} [-o measure=classifier]")

    @train_app.command("consistent-ee")
    def consistent_ee(
        model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded name, HF id or local folder."),
        dataset: str = typer.Option("sharegpt", "--dataset", help="sharegpt or jsonl:FILE."),
        out: Path = typer.Option(..., "--out", "-o", help="Folder for the policy (then: consistent-ee -o heads=OUT)."),
        heads: Optional[Path] = typer.Option(None, help="Trained exit heads to build on (their layers and adapters)."),
        layers: Optional[str] = typer.Option(None, help="Comma-separated exit layers, without --heads (default: calm's)."),
        speed_weight: float = typer.Option(1.0, "--speed-weight", help="How much depth costs against accuracy."),
        windows: int = typer.Option(64, help="Windows of --seq-len tokens whose hidden states are kept."),
        held_out: int = typer.Option(8, "--held-out", help="Further windows kept out of training, to evaluate on."),
        seq_len: int = typer.Option(128, "--seq-len"),
        steps: int = typer.Option(300),
        batch_size: int = typer.Option(512, "--batch-size", help="Positions (episodes) per step."),
        learning_rate: float = typer.Option(1e-2, "--learning-rate"),
        threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads (default: torch's)."),
    ):
        """ConsistentEE: an exit policy trained with policy gradient, rewarded by accuracy or depth by token hardness."""
        from accelgen.train.consistent_ee import evaluate_exit_policy, train_exit_policy
        from accelgen.train.exit_heads import ExitHeads

        with reported_errors():
            base = None
            if heads is not None:
                base = ExitHeads.load(heads)
                layers = ",".join(map(str, base.layers))
            target_model, chosen, hidden, unseen = hidden_states_for(model, dataset, layers, windows, held_out,
                                                                     seq_len, threads)
            if base is not None:
                base.check_fits(target_model)
            with progress_bar(steps) as show:
                policy = train_exit_policy(target_model, hidden, chosen, heads=base, steps=steps, batch_size=batch_size,
                                           learning_rate=learning_rate, speed_weight=speed_weight,
                                           progress=lambda row: show(row, "reward {reward:.3f}, depth {mean_depth:.0%}, "
                                                                          "agrees {agreement:.0%}"))
            policy.base_model = model
            policy.save(out)
            evaluation = evaluate_exit_policy(target_model, policy, unseen)
        write_json_atomically(Path(out) / "evaluation.json",
                              {"held_out_windows": held_out, "speed_weight": speed_weight, **evaluation})
        stderr.print(f"held out: mean depth {evaluation['mean_depth']:.0%} of the layers, exits agree with the full "
                     f"model on {evaluation['agreement']:.1%} of positions")
        stderr.print(f"exit policy for layers {chosen} → {out}; use: --method consistent-ee -o heads={out}")

    @train_app.command("medusa")
    def medusa(
        model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded name, HF id or local folder."),
        dataset: str = typer.Option("sharegpt", "--dataset", help="sharegpt or jsonl:FILE."),
        out: Path = typer.Option(..., "--out", "-o", help="Folder for the heads and checkpoints (resumed); "
                                                          "then: --method medusa -o heads=OUT."),
        heads: int = typer.Option(4, help="Number of heads: head k guesses the token k places after the next one."),
        features: Optional[Path] = typer.Option(None, "--features", help="Folder of the target's feature cache "
                                                "(default: --out); an EAGLE run's folder shares its cache."),
        windows: int = typer.Option(256, help="Windows of --seq-len tokens whose features are cached."),
        held_out: int = typer.Option(8, "--held-out", help="Further windows kept out of training, to evaluate on."),
        seq_len: int = typer.Option(256, "--seq-len"),
        steps: int = typer.Option(300),
        batch_size: int = typer.Option(256, "--batch-size", help="Positions per step."),
        learning_rate: float = typer.Option(1e-3, "--learning-rate"),
        draft_vocab: int = typer.Option(16384, "--draft-vocab", help="Tokens the heads draft from: the most frequent "
                                                                     "(0: the whole vocabulary)."),
        checkpoint_every: int = typer.Option(100, "--checkpoint-every"),
        dtype: Optional[str] = typer.Option(None, help="Dtype of the frozen model (default: its embedded one)."),
        weights: Optional[str] = typer.Option(None, "--weights", help=TARGET_WEIGHTS_HELP),
        threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads (default: torch's)."),
    ):
        """Medusa heads (also for blockwise) on the frozen target's features; top-1/top-5 per head held out."""
        from rich.table import Table

        from accelgen.train.eagle import cached_features
        from accelgen.train.medusa import MedusaConfig, evaluate_medusa, train_medusa

        with reported_errors():
            config = MedusaConfig(heads=heads, steps=steps, batch_size=batch_size, learning_rate=learning_rate,
                                  draft_vocab=draft_vocab, checkpoint_every=checkpoint_every)
            target_model, _, data = model_and_windows(model, dtype, dataset, seq_len, windows, held_out, threads, weights)
            with progress_bar(len(data), "target features of windows") as show:
                cached, choices = cached_features(target_model, data, features or out,
                                                  progress=lambda done: show({"step": done}, ""))
            with progress_bar(steps) as show:
                trained, run = train_medusa(
                    target_model, data[held_out:], cached[held_out:], choices[held_out:], config, out,
                    progress=lambda row: show(row, "loss {loss:.3f}, head 1 top-1 {accuracy[0]:.0%}, "
                                                   "{positions_per_second:.0f} positions/s"))
            trained.base_model = model
            trained.save(out)
            evaluation = evaluate_medusa(target_model, trained, cached[:held_out], choices[:held_out])
        table = Table("head", "guesses token", "top-1", "top-5")
        for row in evaluation:
            table.add_row(str(row["head"]), f"+{row['offset']}", f"{row['top1']:.1%}", f"{row['top5']:.1%}")
        Console().print(table)
        write_json_atomically(Path(out) / "evaluation.json", {
            "held_out_windows": held_out, "config": fields_of(config), "training_seconds": run["seconds"],
            "resumed_at": run["resumed_at"], "heads": evaluation})
        stderr.print(f"{heads} Medusa heads → {out} (trained {steps - run['resumed_at']} steps in {run['seconds']:.0f}s); "
                     f"use: --method medusa -o heads={out} (or --method blockwise)")

    @train_app.command("eagle")
    def eagle(
        model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded name, HF id or local folder."),
        dataset: str = typer.Option("sharegpt", "--dataset", help="sharegpt or jsonl:FILE."),
        out: Path = typer.Option(..., "--out", "-o", help="Folder for the head, the feature cache and checkpoints "
                                                          "(resumed); then: --method eagle --head OUT."),
        features: Optional[Path] = typer.Option(None, "--features", help="Folder of the target's feature cache "
                                                "(default: --out); a Medusa run's folder shares its cache."),
        windows: int = typer.Option(256, help="Windows of --seq-len tokens whose features are cached."),
        held_out: int = typer.Option(8, "--held-out", help="Further windows kept out of training, to evaluate on."),
        seq_len: int = typer.Option(256, "--seq-len"),
        steps: int = typer.Option(600),
        batch_size: int = typer.Option(4, "--batch-size", help="Windows per step."),
        learning_rate: float = typer.Option(5e-4, "--learning-rate"),
        ce_weight: float = typer.Option(0.1, "--ce-weight", help="Weight of the cross-entropy beside the feature loss."),
        ce_positions: int = typer.Option(256, "--ce-positions", help="Positions per step in the cross-entropy."),
        noise: float = typer.Option(0.1, help="Half-width of the uniform noise on the input features."),
        draft_vocab: int = typer.Option(16384, "--draft-vocab", help="Tokens the head drafts from: the most frequent "
                                                                     "(0: the whole vocabulary)."),
        checkpoint_every: int = typer.Option(100, "--checkpoint-every"),
        dtype: Optional[str] = typer.Option(None, help="Dtype of the frozen model (default: its embedded one)."),
        weights: Optional[str] = typer.Option(None, "--weights", help=TARGET_WEIGHTS_HELP),
        threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads (default: torch's)."),
    ):
        """EAGLE head: one decoder layer over the frozen target's features; top-1/top-5 held out."""
        from accelgen.train.eagle import EagleConfig, cached_features, evaluate_eagle, train_eagle

        with reported_errors():
            config = EagleConfig(steps=steps, batch_size=batch_size, learning_rate=learning_rate, ce_weight=ce_weight,
                                 ce_positions=ce_positions, noise=noise, checkpoint_every=checkpoint_every,
                                 draft_vocab=draft_vocab)
            target_model, _, data = model_and_windows(model, dtype, dataset, seq_len, windows, held_out, threads, weights)
            with progress_bar(len(data), "target features of windows") as show:
                cached, choices = cached_features(target_model, data, features or out,
                                                  progress=lambda done: show({"step": done}, ""))
            with progress_bar(steps) as show:
                head, run = train_eagle(target_model, data[held_out:], cached[held_out:], choices[held_out:], config,
                                        out, progress=lambda row: show(row, "loss {loss:.3f}, top-1 {accuracy:.0%}, "
                                                                            "{tokens_per_second:.0f} tokens/s"))
            head.base_model = model
            head.save(out)
            evaluation = evaluate_eagle(target_model, head, data[:held_out], cached[:held_out], choices[:held_out])
        write_json_atomically(Path(out) / "evaluation.json", {
            "held_out_windows": held_out, "config": fields_of(config), "training_seconds": run["seconds"],
            "resumed_at": run["resumed_at"], **evaluation})
        stderr.print(f"held out: the head's top-1 is the target's next choice at {evaluation['top1']:.1%} of "
                     f"positions, top-5 at {evaluation['top5']:.1%}; {evaluation['choices_in_draft_vocab']:.1%} of the "
                     f"choices are in the draft vocabulary (trained {steps - run['resumed_at']} steps in "
                     f"{run['seconds']:.0f}s)")
        stderr.print(f"EAGLE head → {out}; use: --method eagle --head {out}")

    @train_app.command("pass")
    def pass_(
        model: str = typer.Option("smollm2-135m", "--model", "-m", help="Embedded name, HF id or local folder."),
        dataset: str = typer.Option("sharegpt", "--dataset", help="sharegpt or jsonl:FILE."),
        out: Path = typer.Option(..., "--out", "-o", help="Folder for the embeddings (then: --method pass --head OUT)."),
        count: int = typer.Option(4, "--count", "-k", help="Look-ahead embeddings: slot i guesses the token i + 2 ahead."),
        windows: int = typer.Option(128, help="Windows of --seq-len tokens to train on."),
        held_out: int = typer.Option(8, "--held-out", help="Further windows kept out of training, to evaluate on."),
        seq_len: int = typer.Option(128, "--seq-len"),
        steps: int = typer.Option(200),
        batch_size: int = typer.Option(2, "--batch-size", help="Windows per step."),
        cuts: int = typer.Option(16, help="Positions per window the slots are appended at."),
        learning_rate: float = typer.Option(3e-3, "--learning-rate"),
        dtype: Optional[str] = typer.Option(None, help="Dtype of the frozen model (default: its embedded one)."),
        weights: Optional[str] = typer.Option(None, "--weights", help=TARGET_WEIGHTS_HELP),
        threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads (default: torch's)."),
    ):
        """PaSS look-ahead embeddings: the frozen target drafts k tokens for itself; per-slot top-1 held out."""
        from accelgen.train.pass_embeddings import PassConfig, evaluate_pass, train_pass

        with reported_errors():
            config = PassConfig(count=count, steps=steps, batch_size=batch_size, cuts=cuts, learning_rate=learning_rate)
            target_model, _, data = model_and_windows(model, dtype, dataset, seq_len, windows, held_out, threads, weights)
            started = time.perf_counter()
            with progress_bar(steps) as show:
                embeddings = train_pass(target_model, data[held_out:], config,
                                        progress=lambda row: show(row, "loss {loss:.3f}, {tokens_per_second:.0f} slots/s"))
            seconds = time.perf_counter() - started
            embeddings.base_model = model
            embeddings.save(out)
            evaluation = evaluate_pass(target_model, embeddings, data[:held_out], cuts=cuts)
        write_json_atomically(Path(out) / "evaluation.json", {
            "held_out_windows": held_out, "config": fields_of(config), "training_seconds": seconds, **evaluation})
        top1 = ", ".join(f"{accuracy:.0%}" for accuracy in evaluation["top1"])
        stderr.print(f"held out: slot top-1 {top1}; {evaluation['mean_slots_in_a_row']:.2f} slots right in a row "
                     f"on average (trained {steps} steps in {seconds:.0f}s)")
        stderr.print(f"look-ahead embeddings → {out}; use: --method pass --head {out}")

    @train_app.command("distillspec")
    def distillspec(
        model: str = typer.Option(..., "--model", "-m", help="Target: embedded name, HF id or local folder."),
        draft: str = typer.Option(..., "--draft", "-d", help="Draft model to distill (same tokenizer as the target)."),
        dataset: str = typer.Option("sharegpt", "--dataset", help="Prompts: humaneval, sharegpt or jsonl:FILE "
                                                                 "(benchmark prompts never train; see docs/distillation.md)."),
        out: Path = typer.Option(..., "--out", "-o", help="Folder for the distilled draft (then: --method distillspec "
                                                          "--draft OUT)."),
        divergence: str = typer.Option("fkl", help="fkl (KL(target ‖ draft)), rkl (KL(draft ‖ target)) or tvd (total variation)."),
        steps: int = typer.Option(40),
        prompts: int = typer.Option(64, help="Training prompts, cycled through."),
        held_out: int = typer.Option(8, "--held-out", help="Prompts kept out of training, to measure α on before and after."),
        max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens the draft generates per prompt, "
                                                                        "and per held-out prompt when measuring α."),
        batch_size: int = typer.Option(4, "--batch-size", help="Sequences per step."),
        learning_rate: float = typer.Option(5e-6, "--learning-rate"),
        train_layers: Optional[int] = typer.Option(None, "--train-layers", help="Train the draft's last N decoder layers "
                                                                              "(default: all); embeddings and LM head stay frozen."),
        gamma: int = typer.Option(5, help="Draft length when measuring α."),
        dtype: Optional[str] = typer.Option(None, help="Dtype of the target (default: its embedded one); the draft trains in float32."),
        seed: int = typer.Option(0),
        threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads (default: torch's)."),
    ):
        """DistillSpec: distill the draft toward the target on the draft's own generations; α before and after."""
        import torch

        from accelgen.drafters.draft_model import check_vocabularies
        from accelgen.models import load_model
        from accelgen.train.distill import (acceptance, check_divergence, distill, distillation_prompts, distilled_for,
                                            save_distilled)

        started = time.perf_counter()
        with reported_errors():
            check_divergence(divergence)  # before minutes of loading and measuring
            if threads:
                torch.set_num_threads(threads)
            with stderr.status(f"loading {model} and {draft} …"):
                target_model, tokenizer = load_model(model, dtype=dtype)
                draft_model, draft_tokenizer = load_model(draft)
            saved_dtype = draft_model.dtype  # the distilled draft is saved as the original was
            draft_model.float()
            check_vocabularies(target_model, draft_model)
            training, held = distillation_prompts(dataset, tokenizer, prompts, held_out)
            with stderr.status(f"α before, on {len(held)} held-out prompts …"):
                before = acceptance(target_model, draft_model, tokenizer, held, max_new_tokens=max_new_tokens, gamma=gamma)
            with progress_bar(steps) as show:
                run = distill(target_model, draft_model, tokenizer, training, steps=steps, batch_size=batch_size,
                              max_new_tokens=max_new_tokens, divergence_name=divergence, learning_rate=learning_rate,
                              train_layers=train_layers, seed=seed,
                              progress=lambda row: show(row, "loss {loss:.4f}, {tokens_per_second:.0f} tokens/s"))
            with stderr.status("α after …"):
                after = acceptance(target_model, draft_model, tokenizer, held, max_new_tokens=max_new_tokens, gamma=gamma)
            save_distilled(draft_model.to(saved_dtype), draft_tokenizer, out, {
                **distilled_for(target_model, model), "draft": draft, "dataset": dataset, "divergence": divergence,
                "steps": steps, "batch_size": batch_size, "max_new_tokens": max_new_tokens,
                "learning_rate": learning_rate, "train_layers": train_layers, "seed": seed,
                "training_prompts": len(training), "held_out_prompts": len(held), "taught_tokens": run["taught_tokens"],
                "losses": run["losses"], "training_seconds": run["seconds"],
                "wall_seconds": time.perf_counter() - started, "gamma": gamma, "before": before, "after": after})
        Console().print(f"α on {len(held)} held-out prompts: {before['acceptance_rate']:.1%} → {after['acceptance_rate']:.1%}"
                        f" (τ {before['mean_accepted_tokens']:.2f} → {after['mean_accepted_tokens']:.2f}), "
                        f"trained {steps} steps in {run['seconds']:.0f}s")
        stderr.print(f"distilled draft → {out}; use: --method distillspec --draft {out}")

    @train_app.command("online")
    def online(
        model: str = typer.Option(..., "--model", "-m", help="Target: embedded name, HF id or local folder."),
        draft: str = typer.Option(..., "--draft", "-d", help="Draft model, updated as the requests stream by."),
        dataset: str = typer.Option("humaneval", "--dataset", help="The stream of requests, in order: humaneval, "
                                                                  "sharegpt, specbench:FILE or jsonl:FILE."),
        out: Path = typer.Option(..., "--out", "-o", help="Folder for online.json, online.png (and --save-draft)."),
        requests: int = typer.Option(40, help="Requests in the stream."),
        interval: int = typer.Option(5, help="Update the draft after every N requests."),
        max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
        gamma: int = typer.Option(5),
        update_steps: int = typer.Option(4, "--update-steps", help="AdamW steps per update."),
        learning_rate: float = typer.Option(1e-5, "--learning-rate"),
        divergence: str = typer.Option("fkl", help="fkl, rkl or tvd."),
        buffer_size: int = typer.Option(512, "--buffer-size", help="Rejected positions kept between updates."),
        target_top_k: int = typer.Option(32, "--target-top-k", help="Tokens of the target's distribution kept per position."),
        train_layers: Optional[int] = typer.Option(None, "--train-layers", help="Train the draft's last N decoder layers "
                                                                              "(default: all)."),
        baseline: bool = typer.Option(False, "--baseline", help="Also run each request with an untouched copy of the "
                                                                "draft (speculative): α without learning (twice the time)."),
        save_draft: bool = typer.Option(False, "--save-draft", help="Save the updated draft into OUT/draft."),
        dtype: Optional[str] = typer.Option(None, help="Dtype of the target (default: its embedded one); the draft runs "
                                                       "and trains in float32."),
        threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads (default: torch's)."),
    ):
        """Online speculative decoding over a stream of requests: α per request as the draft learns (JSON + plot)."""
        import copy

        import torch

        from accelgen.datasets import load_dataset, prompt_token_ids
        from accelgen.drafters.online import OnlineLearner, moving_average, plot_acceptance, stream_requests
        from accelgen.models import load_model
        from accelgen.train.distill import check_divergence

        with reported_errors():
            check_divergence(divergence)
            if threads:
                torch.set_num_threads(threads)
            stream = load_dataset(dataset, limit=requests)
            if not stream:
                raise ValueError(f"dataset {dataset!r} has no prompts")
            with stderr.status(f"loading {model} and {draft} …"):
                target_model, tokenizer = load_model(model, dtype=dtype)
                draft_model, draft_tokenizer = load_model(draft)
            saved_dtype = draft_model.dtype
            draft_model.float()  # it trains in place: float32 keeps small updates
            baseline_draft = copy.deepcopy(draft_model) if baseline else None
            learner = OnlineLearner()
            learning = dict(interval=interval, update_steps=update_steps, learning_rate=learning_rate,
                            divergence=divergence, buffer_size=buffer_size, target_top_k=target_top_k,
                            train_layers=train_layers)
            with progress_bar(len(stream), "requests") as show:
                rows = stream_requests(target_model, draft_model, tokenizer,
                                       [prompt_token_ids(tokenizer, prompt) for prompt in stream], learner,
                                       max_new_tokens=max_new_tokens, gamma=gamma, baseline_draft=baseline_draft,
                                       progress=lambda row: show(row, "α {acceptance_rate:.0%}, {updates} updates"),
                                       **learning)
            for row, prompt in zip(rows, stream):
                row["id"] = prompt.id
            Path(out).mkdir(parents=True, exist_ok=True)
            average = moving_average([row["acceptance_rate"] for row in rows], interval)
            write_json_atomically(Path(out) / "online.json", {
                "model": model, "draft": draft, "dataset": dataset, "requests": len(rows), "max_new_tokens": max_new_tokens,
                "gamma": gamma, **learning, "first_requests_acceptance": average[min(interval, len(rows)) - 1],
                "last_requests_acceptance": average[-1], "updates": learner.updates, "rows": rows})
            plot_acceptance(rows, Path(out) / "online.png", interval)
            if save_draft:
                save_pretrained_atomically(Path(out) / "draft", draft_model.to(saved_dtype), draft_tokenizer)
        Console().print(f"α, mean of {interval} requests: first {average[min(interval, len(rows)) - 1]:.1%}, last "
                        f"{average[-1]:.1%} ({len(learner.updates)} updates over {len(rows)} requests)")
        stderr.print(f"→ {out}/online.json, {out}/online.png" + (f"; updated draft: {out}/draft" if save_draft else ""))

    app.add_typer(train_app, name="train")


def fields_of(config) -> dict:
    return {field.name: getattr(config, field.name) for field in fields(config)}


stderr = Console(stderr=True)


@contextlib.contextmanager
def reported_errors():
    """Bad input ends the command with its message and exit status 2."""
    try:
        yield
    except (ValueError, FileNotFoundError, OSError) as error:
        stderr.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2)


@contextlib.contextmanager
def progress_bar(steps: int, description: str = "training"):
    """Yields show(row, status_format): a progress bar fed by the trainers' progress rows; into a log file (not a
    terminal), a plain line every tenth of the run instead."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    if not stderr.is_terminal:
        every = max(1, steps // 10)

        def show(row: dict, status: str) -> None:
            if row["step"] % every == 0 or row["step"] == steps:
                stderr.print(f"{description} {row['step']}/{steps}: {status.format(**row)}")

        yield show
        return

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("{task.fields[status]}"), TimeRemainingColumn())
    with Progress(*columns, console=stderr) as bar:
        task = bar.add_task(description, total=steps, status="")
        yield lambda row, status: bar.update(task, completed=row["step"], status=status.format(**row))


def hidden_states_for(model: str, dataset: str, layers: str | None, windows: int, held_out: int, seq_len: int,
                      threads: int | None):
    """(model, exit layers, hidden states for training, hidden states held out) for the exit trainers."""
    from accelgen.exits.calm import check_exit_layers
    from accelgen.train.exit_heads import collect_hidden_states

    target_model, _, data = model_and_windows(model, "float32", dataset, seq_len, windows, held_out, threads)
    count = target_model.config.num_hidden_layers
    chosen = check_exit_layers(None if layers is None else layers.split(","), count)
    if count - 1 in chosen:
        raise ValueError(f"layer {count - 1} is the last layer: it needs no exit head")
    with stderr.status(f"hidden states of {data.numel():,} positions at layers {chosen} …"):
        return (target_model, chosen, collect_hidden_states(target_model, data[held_out:], chosen),
                collect_hidden_states(target_model, data[:held_out], chosen))


def model_and_windows(model: str, dtype: str | None, dataset: str, seq_len: int, windows: int, held_out: int,
                      threads: int | None, weights: str | None = None):
    """(model, tokenizer, windows + held_out packed windows of the dataset, the held-out ones first)."""
    import torch

    from accelgen.datastore_cli import dataset_texts
    from accelgen.models import load_model
    from accelgen.train.layerskip import packed_windows

    if weights not in (None, "fp32", "bf16", "int8", "int4"):
        raise ValueError(f"--weights {weights}: training needs the PyTorch model; choose fp32, bf16, int8 or int4")
    if threads:
        torch.set_num_threads(threads)
    with stderr.status(f"loading {model}{f' ({weights})' if weights else ''} …"):
        target_model, tokenizer = load_model(model, dtype=dtype, weights=weights)
    with stderr.status("tokenizing …"):
        data = packed_windows(tokenizer, dataset_texts(dataset), seq_len, windows + held_out)
    if len(data) <= held_out:
        raise ValueError(f"the dataset gave {len(data)} windows; more than --held-out {held_out} are needed")
    return target_model, tokenizer, data


def plot_exit_accuracy(before: list[dict], after: list[dict], path: Path) -> None:
    """Per layer, how often the exit agrees with the last layer, before and after training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for rows, label in ((before, "before"), (after, "after")):
        axes.plot([r["layer"] for r in rows], [100 * r["agrees_with_last"] for r in rows], marker="o", label=label)
    axes.set_xlabel("exit after layer")
    axes.set_ylabel("top-1 agrees with the last layer (%)")
    axes.set_title("LayerSkip training: early-exit accuracy")
    axes.legend()
    figure.tight_layout()
    write_atomically(path, lambda partial: figure.savefig(partial, format="png", dpi=120))
    plt.close(figure)
