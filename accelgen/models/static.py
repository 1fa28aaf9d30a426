"""A static KV cache indexed by position, and a runner whose small forwards replay CUDA graphs (gpt-fast's design).

On a GPU a small model's decoding step is bound by kernel launches and host stalls, not arithmetic. This runner
removes both from the target's forward:

- **Static cache.** Keys and values of every layer live in one preallocated tensor (layers, 2, 1, kv_heads,
  capacity, head_dim). A forward writes its m new tokens at positions [length, length + m); roll-back after a
  rejected draft moves `length` back, and an accepted tree path is gathered to the front once, on the device.
  Entries past `length` are stale and every query's attention mask hides them.
- **Buckets.** A forward over m ≤ 64 new tokens is padded to the next bucket (1, 2, 4, 8, 16, 32, 64): padding
  tokens sit after the real ones, see only themselves, and write to positions the mask hides, so the real rows
  are exactly what an unpadded forward gives. So few shapes exist, and on CUDA each (bucket, kept states) is
  captured once as a CUDA graph over static input buffers and replayed: one launch per forward. Longer forwards
  (a prompt) run eagerly on the same cache.
- **Compiled.** With compile (by default on CUDA) the bucketed forwards run through torch.compile (inductor)
  and the graphs capture the compiled kernels: norms, rotary embeddings, activations and residuals fused. If
  compiling fails the slot warns once and runs its forwards eagerly.

The cache the model's attention modules see is `StaticCache`, which implements the one method they call,
`update(key_states, value_states, layer_idx, ...)`; the 4-D mask makes the model build no mask of its own.
Capacity grows (doubling, the cache copied once) when a sequence outgrows it.

Capturing graphs costs far more than a sequence's decoding, so a cache and its graphs form a `Slot` that outlives
its runner: a runner takes a free slot of its model (and capacity) and gives it back when closed or collected,
and the next sequence replays the same graphs (a stale cache needs no clearing: the masks hide it).
"""

from __future__ import annotations

import warnings
import weakref

import torch

from accelgen import cache as kv
from accelgen.draft import causal, to_device
from accelgen.errors import InputError
from accelgen.models.block import Block
from accelgen.models.layouts import alibi_layout
from accelgen.models.runner import ModelRunner

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
FIRST_CAPACITY = 1024  # positions; doubled when a sequence needs more (up to the model's context)
CACHED_PATTERNS = 256  # device copies of attention patterns kept per slot (a static tree's repeats every step)
RECOMPILE_LIMIT = 64  # compiled variants of the forward: 2 per model and set of kept states (compiled_forward)


def bucket_for(m: int) -> int | None:
    """The smallest bucket holding m new tokens, None when m is wider than the widest (an eager forward)."""
    return next((bucket for bucket in BUCKETS if bucket >= m), None)


def static_cache_refusal(model) -> str | None:
    """Why `model` cannot decode on a static cache (None when it can): every layer must attend fully over one KV
    cache with rotary or learned positions (sliding windows and ALiBi keep the dynamic runner)."""
    if any(window is not None for window in kv.layer_windows(model.config)):
        return f"{model.config.model_type} has sliding-window layers"
    if alibi_layout(model.config) is not None or getattr(model.config, "alibi", False):
        return f"{model.config.model_type} uses ALiBi positions"
    return None


class StaticCache:
    """Every layer's keys and values at fixed addresses; what HF's attention modules write to and read from."""

    def __init__(self, config, capacity: int, dtype: torch.dtype, device: torch.device):
        text = config.get_text_config(decoder=True)
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.capacity = capacity
        # (layers, keys|values, batch 1, kv_heads, capacity, head_dim): one tensor, so one gather compacts a tree
        self.states = torch.zeros(text.num_hidden_layers, 2, 1, kv_heads, capacity, head_dim, dtype=dtype,
                                  device=device)
        self.write_positions: torch.Tensor | None = None  # (m,) long on the device, set before every forward

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states, value_states: (1, kv_heads, m, head_dim) of the forward's new tokens; written at
        write_positions, then the layer's whole cache is attended to (the mask hides what is not the sequence's)."""
        keys, values = self.states[layer_idx]
        keys.index_copy_(2, self.write_positions, key_states.to(keys.dtype))
        values.index_copy_(2, self.write_positions, value_states.to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError("accelgen's static cache is given positions and masks by its runner; nothing should ask "
                           "it for a length")


class Graphed:
    """One bucket's captured forward: its static inputs, the graph, and the outputs its replays overwrite."""

    def __init__(self, bucket: int, capacity: int, dtype: torch.dtype, device: torch.device):
        self.input_ids = torch.zeros(1, bucket, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(1, bucket, dtype=torch.long, device=device)
        self.offsets = torch.arange(bucket, device=device)  # each row's place in the bucket
        self.write_positions = torch.arange(bucket, device=device)  # the cache positions this forward writes
        self.mask = torch.zeros(1, 1, bucket, capacity, dtype=dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple | None = None  # (logits (1, bucket, vocab), final hidden or None, layer states or None)


class Slot:
    """A static cache with the graphs captured over its buffers, per (bucket, kept states)."""

    def __init__(self, model, capacity: int):
        self.cache = StaticCache(model.config, capacity, model.dtype, model.device)
        self.graphed: dict[tuple, Graphed] = {}
        self.graphs_failed: str | None = None  # why capturing failed here: the slot's forwards then run eagerly
        self.compile_failed: str | None = None  # why torch.compile failed here: the slot's forwards then run eager
        self.patterns: dict[tuple, torch.Tensor] = {}  # (rows, pattern bytes) -> (rows, width) additive mask


# per model, per capacity: the slots no runner holds (weak: a model's slots go with it)
_FREE_SLOTS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[int, list[Slot]]]" = weakref.WeakKeyDictionary()


def take_slot(model, capacity: int) -> Slot:
    free = _FREE_SLOTS.setdefault(model, {}).setdefault(capacity, [])
    return free.pop() if free else Slot(model, capacity)


class StaticRunner(ModelRunner):
    """A ModelRunner over a StaticCache (see the module's docstring); graphs=True replays CUDA graphs (CUDA only)."""

    def __init__(self, model, graphs: bool | None = None, capacity: int = FIRST_CAPACITY, compile: bool | str = "auto"):
        refusal = static_cache_refusal(model)
        if refusal:
            raise InputError(f"{refusal}: decode it with cache='dynamic'")
        super().__init__(model)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise InputError("CUDA graphs need the model on a CUDA device")
        self.compile = compile_choice(compile, self.device)
        self.largest = self.max_positions + BUCKETS[-1]  # the context, and room for the widest bucket's padding
        self._length = 0
        self._take(min(capacity, self.largest))

    def _take(self, capacity: int) -> None:
        """Hold a free slot of this capacity; it goes back to the free ones when closed or collected."""
        self.slot = take_slot(self.model, capacity)
        self.cache = self.slot.cache
        self._give_back = weakref.finalize(self, _FREE_SLOTS[self.model][capacity].append, self.slot)

    def close(self) -> None:
        """Give the slot back for the next sequence (this runner is not used again)."""
        self._give_back()

    @property
    def length(self) -> int:
        return self._length

    @property
    def batches(self) -> bool:
        return False  # each sequence replays its own graphs over its own cache

    def reset(self) -> None:
        self._length = 0
        self.hidden = None
        self.layer_hidden = None

    def describe(self) -> dict:
        return {"cache": "static", "cuda_graphs": self.graphs and not self.slot.graphs_failed,
                "compiled": self.compile and not self.slot.compile_failed}

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, tree: torch.Tensor | None = None, logits_for_last: int = 0,
                appended: torch.Tensor | None = None) -> torch.Tensor:
        """As ModelRunner.forward: token_ids (m,) after the cached positions -> (logits_for_last or m, vocab)
        float32 logits. Tokens may live on the host or the device."""
        m = token_ids.shape[0] + (0 if appended is None else appended.shape[0])
        if appended is not None and tree is not None and tree.shape[0] != m:
            raise InputError("appended embeddings follow a chain, not a tree over the tokens alone: a tree with "
                             "appended embeddings covers both, (m + a, m + a)")
        block = Block(self._length, causal(m) if tree is None else tree)
        bucket = bucket_for(m) if appended is None else None
        self._make_room(self._length + (bucket or m))
        if bucket is None:
            logits, hidden, layers = self._eager(token_ids, block, logits_for_last or m, appended)
        else:
            logits, hidden, layers = self._bucketed(token_ids, block, bucket)
            # the graph's outputs are overwritten by its next replay: keep copies
            logits = logits[0, m - (logits_for_last or m) : m].to(torch.float32, copy=True)
            hidden = None if hidden is None else hidden[0, :m].clone()
            layers = None if layers is None else layers[:m].clone()
        self._length += m
        if hidden is not None:
            self._keep_hidden(hidden)
        if layers is not None:
            self.layer_hidden = layers if self.layer_hidden is None else torch.cat([self.layer_hidden, layers])
        return logits

    def keep(self, prefix: int, rows: list[int]) -> None:
        """Keep the first `prefix` positions, then the rows `rows` (increasing) of the last forward: a chain's
        roll-back only moves the length back; a tree path is gathered to follow the prefix."""
        if rows != list(range(len(rows))):
            source = to_device([prefix + row for row in rows], self.device)
            target = torch.arange(prefix, prefix + len(rows), device=self.device)
            states = self.cache.states
            states.index_copy_(4, target, states.index_select(4, source))
        self._length = prefix + len(rows)
        keep = slice(0, self._length) if rows == list(range(len(rows))) else \
            to_device(torch.cat([torch.arange(prefix), prefix + torch.tensor(rows, dtype=torch.long)]), self.device)
        if self.hidden is not None:
            self.hidden = self.hidden[keep]
        if self.layer_hidden is not None:
            self.layer_hidden = self.layer_hidden[keep]

    def _make_room(self, needed: int) -> None:
        """Grow the cache (doubling, within the model's context) so that `needed` positions fit."""
        if needed <= self.cache.capacity:
            return
        if needed > self.largest:
            raise InputError(f"{needed} positions do not fit the model's context of {self.max_positions}")
        capacity = self.cache.capacity
        while capacity < needed:
            capacity = min(2 * capacity, self.largest)
        held = self.cache
        self._give_back()
        self._take(capacity)
        self.cache.states[..., : self._length, :] = held.states[..., : self._length, :]

    def _inputs(self, input_ids, position_ids, mask, appended=None, logits_to_keep: int = 0) -> dict:
        inputs = dict(position_ids=position_ids, attention_mask=mask, use_cache=True, logits_to_keep=logits_to_keep,
                      **{kv.cache_keyword(self.model): self.cache})
        if appended is None:
            inputs["input_ids"] = input_ids
        else:
            embedded = self.model.get_input_embeddings()(input_ids[0])
            inputs["inputs_embeds"] = torch.cat([embedded, appended.to(self.device, embedded.dtype)])[None]
        if self.keep_layers:
            inputs["output_hidden_states"] = True
        return inputs

    def _call(self, inputs: dict, compiled: bool = False) -> tuple:
        """The model's forward (compiled: through torch.compile, else eager): (logits (1, m, vocab), final hidden
        (1, m, d) if kept, kept layers' inputs (m, k*d))."""
        if compiled and self.compile and not self.slot.compile_failed:
            output = self._compiled(inputs)
            if output is not None:
                return self._outputs(output, output.hidden_states[-1] if self.keep_hidden else None)
        decoded = []
        hook = self.model.base_model.register_forward_hook(lambda module, args, output: decoded.append(output[0])) \
            if self.keep_hidden else None
        try:
            output = self.model(**inputs)
        finally:
            if hook is not None:
                hook.remove()
        return self._outputs(output, decoded[0] if decoded else None)

    def _compiled(self, inputs: dict):
        """The model's output through its compiled forward; None (and a warning, once per slot) if torch.compile
        cannot build it, after which the slot's forwards run eagerly. The final hidden state comes from
        output_hidden_states (transformers records the final norm's output last): a hook would be traced as a
        guard that changes every call."""
        if self.keep_hidden:
            inputs = {**inputs, "output_hidden_states": True}
        try:
            # every model, bucket and set of kept states is a cache entry of the one compiled function: more than
            # torch's default limit of 8 per function, past which it would run the rest eagerly without a word
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return compiled_forward()(self.model, inputs)
        except Exception as error:  # whatever dynamo or inductor raise, the eager forward still runs
            self.slot.compile_failed = f"{type(error).__name__}: {first_line(error)}"
            warnings.warn(f"accelgen: torch.compile of {type(self.model).__name__}'s forward failed "
                          f"({self.slot.compile_failed}); its forwards run eagerly on the static cache")
            return None

    def _outputs(self, output, hidden) -> tuple:
        layers = None
        if self.keep_layers:
            states = output.hidden_states
            if states is None or max(self.keep_layers) >= len(states):
                raise InputError(f"{type(self.model).__name__} returned too few hidden states for the layers "
                                 f"{list(self.keep_layers)} the drafter reads")
            layers = torch.cat([states[index][0] for index in self.keep_layers], dim=-1)
        return output.logits, hidden, layers

    def _eager(self, token_ids, block: Block, logits_for_last: int, appended) -> tuple:
        m = block.pattern.shape[0]
        ids = token_ids.to(self.device, non_blocking=True)[None]
        positions = block.positions.to(self.device, non_blocking=True)[None]
        mask = self._fill_mask(torch.empty(1, 1, m, self.cache.capacity, dtype=self.dtype, device=self.device), block)
        self.cache.write_positions = torch.arange(self._length, self._length + m, device=self.device)
        logits, hidden, layers = self._call(self._inputs(ids, positions, mask, appended, logits_for_last))
        return logits[0].float(), None if hidden is None else hidden[0], layers

    def _bucketed(self, token_ids, block: Block, bucket: int) -> tuple:
        """The block padded to `bucket` tokens through that bucket's buffers (and graph, on CUDA)."""
        key = (bucket, self.keep_hidden, tuple(self.keep_layers))
        graphed = self.slot.graphed.get(key)
        if graphed is None:
            graphed = self.slot.graphed[key] = Graphed(bucket, self.cache.capacity, self.dtype, self.device)
        m = token_ids.shape[0]
        graphed.input_ids[0, :m].copy_(token_ids, non_blocking=True)
        graphed.position_ids[0, :m].copy_(block.positions, non_blocking=True)
        graphed.position_ids[0, m:].fill_(self._length)  # padding: any position (it is masked off)
        torch.add(graphed.offsets, self._length, out=graphed.write_positions)
        self._fill_mask(graphed.mask, block)
        self.cache.write_positions = graphed.write_positions
        inputs = self._inputs(graphed.input_ids, graphed.position_ids, graphed.mask)
        if not self.graphs or self.slot.graphs_failed:
            return self._call(inputs, compiled=True)
        if graphed.graph is None:
            try:  # (the compiled forward is built in the capture's warm-up, before capturing)
                graphed.graph, graphed.outputs = capture(lambda: self._call(inputs, compiled=True), self.device)
            except RuntimeError as error:  # an operation that cannot be captured (a host sync in the model's code)
                self.slot.graphs_failed = str(error).splitlines()[0]
                warnings.warn(f"accelgen: capturing a CUDA graph of {type(self.model).__name__} failed "
                              f"({self.slot.graphs_failed}); its forwards run eagerly on the static cache")
                torch.cuda.synchronize(self.device)
                return self._call(inputs, compiled=True)
        graphed.graph.replay()
        return graphed.outputs

    def _fill_mask(self, mask: torch.Tensor, block: Block) -> torch.Tensor:
        """Fill `mask` (1, 1, rows, capacity), the additive mask of the block padded to `rows`: a real row sees the
        cache before the block's pattern and the pattern's columns it allows; padding rows (r >= m) see only
        themselves; stale entries past the block are hidden. Three launches, no host read."""
        pattern = self._pattern(block.pattern, mask.shape[2])  # (rows, width + rows - m) on the device
        mask.fill_(torch.finfo(self.dtype).min)
        mask[..., : block.first] = 0
        mask[0, 0, :, block.first : block.first + pattern.shape[1]] = pattern
        return mask

    def _pattern(self, pattern: torch.Tensor, rows: int) -> torch.Tensor:
        """The block's pattern (m, width) padded to `rows` rows (padding rows see themselves), as an additive mask
        on the device, cached in the slot: a chain's or a static tree's pattern repeats every step."""
        key = (rows, tuple(pattern.shape), bytes(pattern.cpu().numpy().tobytes()))
        cached = self.slot.patterns.get(key)
        if cached is None:
            m, width = pattern.shape
            padded = torch.zeros(rows, width + rows - m, dtype=torch.bool)
            padded[:m, :width] = pattern.cpu()
            padded[m:, width:] = torch.eye(rows - m, dtype=torch.bool)
            additive = torch.zeros(padded.shape, dtype=self.dtype).masked_fill_(~padded, torch.finfo(self.dtype).min)
            if len(self.slot.patterns) >= CACHED_PATTERNS:
                self.slot.patterns.pop(next(iter(self.slot.patterns)))  # the oldest
            cached = self.slot.patterns[key] = additive.to(self.device, non_blocking=True)
        return cached


def compile_choice(compile: bool | str, device: torch.device) -> bool:
    """Whether the bucketed forwards run compiled: compile "auto" on CUDA (on the CPU inductor's C++ kernels take
    longer to build than most generations take to run), or True / False anywhere."""
    if compile == "auto":
        return device.type == "cuda"
    if isinstance(compile, bool):
        return compile
    raise InputError(f"unknown compile {compile!r}; choose 'auto', True or False")


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else "no message"


def _forward(model, inputs: dict):
    return model(**inputs)


_COMPILED_FORWARD = []  # one compiled function for every model: dynamo keeps its code per shape and model, and a
# second torch.compile of the same function would compile it all again (its backend is another object)


def compiled_forward():
    """`model(**inputs)` compiled by inductor: per model and set of kept states, a graph for the one-token step and
    one for the wider buckets, whose number of tokens turns dynamic once a second bucket comes (torch's automatic
    dynamic shapes); measured on the CPU, 2 compiles per model (3 for the process's first)."""
    if not _COMPILED_FORWARD:
        _COMPILED_FORWARD.append(torch.compile(_forward, backend="inductor"))
    return _COMPILED_FORWARD[0]


def capture(call, device: torch.device) -> tuple:
    """(CUDA graph, its outputs) of `call()`, warmed up on a side stream first as CUDA graphs require."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call()
    return graph, outputs

