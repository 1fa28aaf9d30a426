"""`accelgen train consistent-ee`: ConsistentEE's exit policy, by policy gradient (accelgen/train/consistent_ee.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from accelgen.atomic import write_json_atomically
from accelgen.cli.common import FILE_ERRORS, console, reported_errors
from accelgen.cli.flags import Flags, command, flag
from accelgen.cli.train.common import WindowsRun, hidden_states_for, out_flag, progress_bar
from accelgen.train.loop import ScaleOut, is_main_process


@dataclass
class ConsistentEERun(WindowsRun):
    out: Path = out_flag("Folder for the policy (then: consistent-ee -o heads=OUT).")
    heads: Optional[Path] = flag(None, "Trained exit heads to build on (their layers and adapters).")
    layers: Optional[str] = flag(None, "Comma-separated exit layers, without --heads (default: calm's).")
    speed_weight: float = flag(1.0, "How much depth costs against accuracy.")
    steps: int = flag(300)
    batch_size: int = flag(512, "Positions (episodes) per step.")
    learning_rate: float = flag(1e-2)


def consistent_ee(run: ConsistentEERun, scale: ScaleOut) -> None:
    """ConsistentEE: an exit policy trained with policy gradient, rewarded by accuracy or depth by token hardness."""
    from accelgen.heads.exit_heads import ExitHeads
    from accelgen.train.consistent_ee import evaluate_exit_policy, train_exit_policy

    with reported_errors(FILE_ERRORS):
        base = None if run.heads is None else ExitHeads.load(run.heads)
        layers = run.layers if base is None else ",".join(map(str, base.layers))
        target_model, chosen, hidden, unseen = hidden_states_for(run.model, run.dataset, layers, run.windows,
                                                                 run.held_out, run.seq_len, run.threads)
        if base is not None:
            base.check_fits(target_model)
        with progress_bar(run.steps) as show:
            policy = train_exit_policy(target_model, hidden, chosen, heads=base, steps=run.steps,
                                       batch_size=run.batch_size, learning_rate=run.learning_rate,
                                       speed_weight=run.speed_weight,
                                       progress=lambda row: show(row, "reward {reward:.3f}, depth {mean_depth:.0%}, "
                                                                      "agrees {agreement:.0%}"), scale=scale)
        if not is_main_process():
            return  # the first process evaluates and saves
        policy.base_model = run.model
        policy.save(run.out)
        evaluation = evaluate_exit_policy(target_model, policy, unseen)
    write_json_atomically(Path(run.out) / "evaluation.json",
                          {"held_out_windows": run.held_out, "speed_weight": run.speed_weight, **evaluation})
    console.print(f"held out: mean depth {evaluation['mean_depth']:.0%} of the layers, exits agree with the full "
                  f"model on {evaluation['agreement']:.1%} of positions")
    console.print(f"exit policy for layers {chosen} → {run.out}; use: --method consistent-ee -o heads={run.out}")


consistent_ee_command = command(consistent_ee, Flags(ConsistentEERun), Flags(ScaleOut))
