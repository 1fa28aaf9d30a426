"""What the operator decides when starting the server: the model, the methods requests may use and the limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from accelgen.errors import InputError


@dataclass
class ServerConfig:
    model_name: str
    model: object
    tokenizer: object
    draft_model: object | None = None
    method: str = "autoregressive"
    methods: dict[str, dict] = field(default_factory=dict)  # method -> operator's options; the methods requests may use
    api_key: str | None = None
    max_prompt_tokens: int = 4096
    max_tokens: int = 1024  # largest max_tokens a request may ask for
    max_body_bytes: int = 1 << 20
    max_concurrent: int = 64  # requests waiting or running; more get 429
    shutdown_grace_seconds: float = 30.0  # in-flight requests may finish within it; then they are aborted
    body_timeout_seconds: float = 10.0  # a POST body must arrive within it (408 otherwise)
    aliases: tuple[str, ...] = ()  # other names requests may give in `model` (vLLM's --served-model-name)
    allowed_origins: tuple[str, ...] = ()  # CORS: the browser origins allowed ("*": any; none: no CORS headers)

    @property
    def served_names(self) -> list[str]:
        """The names /v1/models lists and requests may use; replies carry the first."""
        return [self.model_name] + [name for name in self.aliases if name != self.model_name]

    def __post_init__(self):
        if self.api_key == "":
            raise InputError("an empty API key would turn authentication off: to serve without a key, give none")
