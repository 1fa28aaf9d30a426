"""`accelgen tune`: choose, by measurement on this machine, the layers `self-speculative` skips when the target
drafts for itself (below), and the method `auto` delegates to (`tune_auto`).

Draft & Verify (Zhang et al. 2024) picks the skip set by Bayesian optimisation: each trial generates from a
few calibration prompts with one skip set (attention and MLP of every layer chosen separately) and
scores it by measured seconds per token; optuna's TPE sampler proposes the next set from the scores so far.
The first trial is the default skip set, so tuning never ends worse than where it started. The result is
saved beside the model's weights and `self-speculative` uses it from then on (skip="tuned").
"""

from __future__ import annotations

from typing import Callable

from accelgen.atomic import write_json_atomically
from accelgen.hardware import timed
from accelgen.drafters.self_speculative import SKIP_FILE, default_skip
from accelgen.errors import InputError
from accelgen.loop import generate
from accelgen.models.loading import beside_weights

CONTENDER_MARGIN = 1.25  # auto's second calibration round: candidates within 25% of the fastest


def seconds_per_token(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, **method) -> tuple[float, float]:
    """(seconds per new token, tokens per target forward) over the calibration prompts."""
    seconds = tokens = forwards = 0
    for prompt_ids in prompts:
        result, elapsed = timed(model.device, lambda: generate(model, tokenizer, prompt_ids,
                                                               max_new_tokens=max_new_tokens, temperature=0.0, **method))
        seconds += elapsed
        tokens += len(result.token_ids)
        forwards += result.stats["target_forwards"]
    return seconds / max(tokens, 1), tokens / max(forwards, 1)


def tune_self_speculative(model, tokenizer, prompts: list[list[int]], *, trials: int = 40, max_new_tokens: int = 32,
                          gamma: int = 4, seed: int = 0, progress: Callable[[int, dict], None] | None = None) -> dict:
    """Search skip sets; returns the best with its measured seconds per token, τ, and autoregressive's."""
    try:
        import optuna
    except ImportError:
        raise InputError("tuning needs optuna: pip install 'accelgen[tune]' (or pip install optuna)") from None
    if trials < 1 or not prompts:
        raise InputError("tuning needs at least one trial and one calibration prompt")
    layers = model.config.num_hidden_layers
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    generate(model, tokenizer, prompts[0], max_new_tokens=2, temperature=0.0)  # warm-up
    plain, _ = seconds_per_token(model, tokenizer, prompts, max_new_tokens, method="autoregressive")

    def skip_of(params: dict) -> dict[str, list[int]]:
        return {"skip_attention": [i for i in range(layers) if params[f"attention_{i}"]],
                "skip_mlp": [i for i in range(layers) if params[f"mlp_{i}"]]}

    def objective(trial) -> float:
        params = {f"{part}_{i}": trial.suggest_categorical(f"{part}_{i}", [False, True])
                  for i in range(layers) for part in ("attention", "mlp")}
        skip = skip_of(params)
        if len(skip["skip_attention"]) == layers:
            raise optuna.TrialPruned()  # a draft that sees no context
        cost, tau = seconds_per_token(model, tokenizer, prompts, max_new_tokens, method="self-speculative",
                                      skip=skip, gamma=gamma)
        trial.set_user_attr("tau", tau)
        if progress:
            progress(trial.number, {"seconds_per_token": cost, "tau": tau, "speedup": plain / cost})
        return cost

    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed))
    start = default_skip(layers)
    study.enqueue_trial({f"{part}_{i}": i in start[f"skip_{part}"] for i in range(layers) for part in ("attention", "mlp")})
    study.optimize(objective, n_trials=trials)
    best = study.best_trial
    return {"skip": skip_of(best.params), "seconds_per_token": best.value, "tau": best.user_attrs["tau"],
            "autoregressive_seconds_per_token": plain, "speedup": plain / best.value, "gamma": gamma,
            "trials": trials, "prompts": len(prompts), "max_new_tokens": max_new_tokens}


def tune_auto(model, tokenizer, prompts: list[list[int]], *, draft_model=None, max_new_tokens: int = 48,
              progress: Callable[[int, int, dict], None] | None = None) -> dict:
    """Time every `auto` candidate on the calibration prompts (greedy); returns the fastest and the table.

    A second round, in the opposite order, times again the candidates within CONTENDER_MARGIN of the fastest,
    each keeping its better round, so that a slow moment of the machine does not decide the choice; the
    clearly slower ones are not worth the time twice."""
    from accelgen.drafters.auto import candidates, shipped_eagle

    if not prompts:
        raise InputError("calibration needs at least one prompt")
    options = candidates(draft_model is not None, shipped_eagle(model) is not None)
    generate(model, tokenizer, prompts[0], max_new_tokens=2, temperature=0.0)  # warm-up
    measured: dict[int, tuple[float, float]] = {}
    timed = 0

    def time_candidates(indices: list[int], total: int) -> None:
        nonlocal timed
        for index in indices:
            method, method_options = options[index]
            cost, tau = seconds_per_token(model, tokenizer, prompts, max_new_tokens, method=method,
                                          draft_model=draft_model, **method_options)
            best = measured.get(index)
            measured[index] = (cost, tau) if best is None or cost < best[0] else best
            if progress:
                progress(timed, total, {"method": method, "options": method_options, "seconds_per_token": cost,
                                        "tau": tau})
            timed += 1

    time_candidates(list(range(len(options))), 2 * len(options))
    fastest = min(cost for cost, _ in measured.values())
    contenders = [index for index in reversed(range(len(options))) if measured[index][0] <= CONTENDER_MARGIN * fastest]
    time_candidates(contenders, len(options) + len(contenders))
    plain = measured[0][0]  # candidates()[0] is autoregressive
    table = [{"method": method, "options": method_options, "seconds_per_token": measured[i][0], "tau": measured[i][1],
              "speedup": plain / measured[i][0]} for i, (method, method_options) in enumerate(options)]
    best = max(table, key=lambda row: row["speedup"])  # autoregressive (first, 1.0×) unless another beats it
    reason = (f"fastest of {len(table)} candidates on {len(prompts)} calibration prompts: {best['speedup']:.2f}× "
              f"autoregressive, τ {best['tau']:.2f}")
    if best is table[0]:
        runner_up = max(table[1:], key=lambda row: row["speedup"], default=None)
        reason = (f"no candidate beat plain decoding on {len(prompts)} calibration prompts"
                  + (f" (the fastest, {runner_up['method']}, ran at {runner_up['speedup']:.2f}×)" if runner_up else ""))
    return {"method": best["method"], "options": best["options"], "reason": reason, "table": table,
            "prompts": len(prompts), "max_new_tokens": max_new_tokens}


def save_tuned_skip(model, result: dict):
    """Write the result beside the model's weights; returns the path."""
    path = beside_weights(model, SKIP_FILE, saving="the skip set")
    write_json_atomically(path, result)
    return path
