"""`accelgen serve`: an OpenAI-compatible server with continuous batching and speculation policies."""

from __future__ import annotations

import os
from typing import Optional

import typer

from accelgen.cli.common import (DEVICE_OPTION, DTYPE_HELP, MODEL_HELP, console, load_target_and_draft,
                                 reported_errors, set_threads)
from accelgen.errors import InputError
from accelgen.method_options import parse_method_options, split_list
from accelgen.models.loading import DRAFT_WEIGHTS_HELP, WEIGHTS_HELP


DEFAULT_MODEL = "smollm2-135m"


def serve(
    model_argument: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False,
                                                   help=f"{MODEL_HELP} (or --model; default {DEFAULT_MODEL})"),
    model_option: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    served_model_name: list[str] = typer.Option(
        [], "--served-model-name", help="Name(s) requests give in `model` and /v1/models lists (repeatable or "
                                        "comma-separated; default: the model as given). Replies carry the first."),
    draft: Optional[str] = typer.Option(None, "--draft", "-d", help="Draft model, for methods that need one."),
    method: Optional[str] = typer.Option(None, "--method", help="Default method of requests (default: autoregressive)."),
    speculative_config: Optional[str] = typer.Option(
        None, "--speculative-config", "--speculative_config", help="vLLM's speculation JSON, e.g. '{\"method\": \"ngram\", "
                                           "\"num_speculative_tokens\": 5}': translated to --method, -d and -o "
                                           "(docs/server.md, \"For vLLM users\")."),
    allow_methods: str = typer.Option("", "--allow-methods",
                                      help="Other methods requests may pick with the body field `method`, comma-separated."),
    option: list[str] = typer.Option([], "--option", "-o", metavar="[METHOD.]NAME=VALUE",
                                     help="Method option method.name=value (repeatable), or name=value where one "
                                          "method is served."),
    host: str = typer.Option("127.0.0.1", help="Interface to bind (127.0.0.1: this machine only)."),
    port: int = typer.Option(8000, min=1, max=65535, help="Port to listen on."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="ACCELGEN_API_KEY",
                                          help="Require Authorization: Bearer <key> (or set ACCELGEN_API_KEY)."),
    max_batch: int = typer.Option(8, "--max-batch", "--max-num-seqs", help="Sequences per batched forward."),
    token_budget: Optional[int] = typer.Option(
        None, "--token-budget", help="Cap drafts at budget // batch size - 1 tokens (0: no cap) instead of choosing "
                                     "each step's draft length by measured goodput."),
    max_draft: int = typer.Option(8, "--max-draft", help="Longest draft the goodput policy may choose."),
    prefill_chunk: int = typer.Option(256, "--prefill-chunk", help="Prompt tokens fed per step (0: whole prompts)."),
    max_concurrent: int = typer.Option(64, "--max-concurrent", help="Requests waiting or running; more get 429."),
    max_prompt_tokens: int = typer.Option(4096, "--max-prompt-tokens", "--max-model-len",
                                          help="Longest prompt a request may send, in tokens."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template",
                                                help="Jinja chat template file (or the template inline) replacing "
                                                     "the tokenizer's."),
    allowed_origins: list[str] = typer.Option([], "--allowed-origins",
                                              help="CORS: browser origins allowed, as vLLM's JSON list ('[\"*\"]') "
                                                   "or comma-separated (default: no CORS headers)."),
    max_tokens: int = typer.Option(1024, "--max-tokens", help="Largest max_tokens a request may ask for."),
    shutdown_grace: float = typer.Option(30.0, "--shutdown-grace", min=0,
                                         help="Seconds requests in flight may take to finish on shutdown; then "
                                              "they are aborted and answered (finish_reason \"abort\")."),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    draft_dtype: Optional[str] = typer.Option(None, "--draft-dtype", help="Dtype of the draft model (as --dtype)."),
    weights: Optional[str] = typer.Option(None, "--weights", help=WEIGHTS_HELP),
    draft_weights: Optional[str] = typer.Option(None, "--draft-weights", help=DRAFT_WEIGHTS_HELP),
    device: Optional[str] = DEVICE_OPTION,
    threads: Optional[int] = typer.Option(None, min=1, help="torch CPU threads."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's: info logs every request, warning does not."),
):
    """Serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /metrics) with continuous batching."""
    # a batch's shapes change every step, and oneDNN keeps a compiled kernel per shape (1024 by default): cap
    # that cache, or a long-running server's memory creeps up (set before the first matmul to take effect)
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    if api_key == "":  # before the model loads
        console.print("[red]error:[/red] an empty --api-key would turn authentication off; to serve without a key, "
                      "leave out --api-key (and ACCELGEN_API_KEY)")
        raise typer.Exit(2)
    import accelgen
    from accelgen.drafters.draft_tree import draft_weights_for
    from accelgen.server import vllm_options
    from accelgen.server.app import ServerConfig, create_app, run
    from accelgen.server.engine import Engine
    from accelgen.server.speculation import Goodput, TokenBudget, policy_calibration

    set_threads(threads)
    with reported_errors():  # every check that needs no model, before one loads
        model = chosen_model(model_argument, model_option)
        method, draft, translated = speculation_options(speculative_config, method, draft)
        names = vllm_options.served_model_names(served_model_name) or [model]
        origins = vllm_options.allowed_origins(allowed_origins)
        template = vllm_options.chat_template(chat_template) if chat_template is not None else None
        methods = [method] + [name for name in split_list(allow_methods) or [] if name != method]
        options = parse_method_options(option, methods)
        options[method] = {**translated, **options.get(method, {})}  # -o refines what the JSON set
        unserved = sorted(set(options) - set(methods))
        if unserved:
            raise InputError(f"options given for {', '.join(unserved)}, which this server does not serve ({', '.join(methods)})")
        options = {name: accelgen.get_method(name).check_options(options.get(name, {})) for name in methods}
        for name in methods:  # before loading the target, which may take a while
            accelgen.get_method(name).check_needs(draft_model=draft, how="--draft (-d)")
        draft_weights = draft_weights_for(methods, draft, draft_weights, device=device, threads=threads)
        target_model, tokenizer, draft_model = load_target_and_draft(model, dtype, weights, draft, draft_dtype,
                                                                     draft_weights, device)
        if template is not None:
            tokenizer.chat_template = template
        config = ServerConfig(model_name=names[0], aliases=tuple(names[1:]), allowed_origins=origins,
                              model=target_model, tokenizer=tokenizer, draft_model=draft_model,
                              method=method, methods=options, api_key=api_key, max_prompt_tokens=max_prompt_tokens,
                              max_tokens=max_tokens, max_concurrent=max_concurrent, shutdown_grace_seconds=shutdown_grace)
        if token_budget is not None:
            speculation = TokenBudget(token_budget)
        else:
            if draft_model is None and "qspec" in methods:  # its drafts cost the target's quantized copy's forwards
                from accelgen.drafters.qspec import served_copy

                policy_draft = served_copy(target_model, tokenizer, options["qspec"])
            else:
                policy_draft = draft_model
            calibration = policy_calibration(target_model, policy_draft, max_batch, max_draft)
            speculation = Goodput(max_draft=max_draft, calibration=calibration)  # runs on the engine's thread
        engine = Engine(max_batch=max_batch, prefill_chunk=prefill_chunk, speculation=speculation,
                        device=target_model.device)
        server_app = create_app(config, engine)
    console.print(f"serving {model} as {', '.join(names)} ({target_model.device}) on http://{host}:{port}/v1 — methods: "
                  f"{', '.join(methods)}")
    run(server_app, host=host, port=port, log_level=log_level)  # on Ctrl-C or SIGTERM: see run()


def chosen_model(argument: Optional[str], option: Optional[str]) -> str:
    """The model, given as the argument (vLLM's `serve MODEL`) or --model."""
    if argument is not None and option is not None and argument != option:
        raise InputError(f"two models given, {argument!r} and --model {option!r}: give one")
    return argument or option or DEFAULT_MODEL


def speculation_options(speculative_config: Optional[str], method: Optional[str],
                        draft: Optional[str]) -> tuple[str, Optional[str], dict]:
    """(the method, the draft model, the method's options) from --method and -d, or from vLLM's
    --speculative-config (then neither may be given as well: two answers to one question)."""
    if speculative_config is None:
        return method or "autoregressive", draft, {}
    from accelgen.server.vllm_options import speculative_config as translated

    speculation = translated(speculative_config)
    if method is not None and method != speculation.method:
        raise InputError(f"--speculative-config means --method {speculation.method}, but --method {method} is given: "
                         "give one")
    if draft is not None and speculation.draft is not None and draft != speculation.draft:
        raise InputError(f"--speculative-config names the draft {speculation.draft!r}, but -d {draft!r} is given: "
                         "give one")
    return speculation.method, speculation.draft or draft, speculation.options
