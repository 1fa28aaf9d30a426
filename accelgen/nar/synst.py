"""SynST, the syntactically supervised Transformer (Akoury, Krishna & Iyyer 2019, "Syntactically Supervised
Transformers for Faster Neural Machine Translation", ACL): a short autoregressive plan of chunks, then every target
token in one parallel pass.

The paper's algorithm. Each training target is parsed (CoreNLP constituency parses) and cut into chunks by a
top-down walk with a maximum span size k: a subtree with at most k leaves (or a single word, however many BPE
pieces it has) becomes one chunk, any other subtree is replaced by its children. A chunk's identifier is its
constituent label and its size, e.g. "NP3" for a noun phrase of 3 tokens. The decoder works in two stages:

1. a parse decoder (one layer in their best model) predicts the chunk identifiers c_1 .. c_m autoregressively,
   then an end-of-chunks identifier: m + 1 sequential steps, m about N / k for a target of N tokens;
2. a token decoder reads the chunk sequence with each identifier followed by as many placeholders as its size
   ("NP3 _ _ _ PP2 _ _ ...") and predicts every target token at once (no mask among the tokens): one pass. The
   sizes decide the target's length, so no length predictor or EOS is needed.

Training is teacher-forced on the gold chunks for both stages and minimises the sum of the chunks' and the
tokens' negative log-likelihoods. At inference the token decoder reads the chunks the parse decoder predicted.

Where this implementation differs, and why:

- No parser. Our targets are one-line English summaries of Python functions and no constituency parser is
  available offline, so the chunks come from a deterministic shallow chunker (`chunk_tokens`) over the compact
  target ids: the tokenizer's pieces are grouped into whitespace-delimited words (a piece whose text starts with
  whitespace, e.g. SmolLM2's 'Ġthe', starts a word); each word is typed as code (a piece holding one of
  _ ` [ ] { } = < > ..., a dotted name such as self.cache, or a call such as join()), a function word (the, of,
  is, ...), a content word, or punctuation (a word's leading and trailing punctuation pieces are split off;
  code keeps all but its closing sentence punctuation); function words open a chunk and the content words that
  follow join it, adjacent words of one type merge (a rough stand-in for the paper's NP / PP / VP constituents:
  "of the cache" is one chunk); chunks longer than k tokens are split into pieces of at most k from the left.
  The chunk types are P (punctuation), F (function words alone), W (words) and C (code), so identifiers read
  "W3", "C2". (The issue suggested Python's ast for the chunks, but ast parses the code, which is the input; the
  outputs are English, with code only as names inside them.) The rules are shallow: an abbreviation such as
  "e.g." or a number such as 3.5 reads as a dotted name (code), and no verb or noun phrase is told apart from
  another. Unlike the paper, a single word longer than k is split too, so no chunk exceeds k.
- One decoder for both stages: the backbone's decoder that every method shares, so that a comparison with the
  other methods measures the decoding algorithm, not an extra parse decoder. Its positions are laid out as
  [chunk inputs (START, c_1 .. c_m) | token placeholders]: the chunk part is causal and blind to the token part
  (so stage 1 is exactly an autoregressive decoder over chunk identifiers), the token part sees every chunk
  position and every token position. A placeholder is its chunk identifier's embedding plus an embedding of its
  offset within the chunk (plus the backbone's position of the token), where the paper puts a shared placeholder
  after each identifier: the same information, without interleaving the identifiers into the token positions.
  The chunk identifiers have their own embedding table, positions and output head; the token vocabulary and its
  tied output are the backbone's, unchanged.
- Chunks are decoded greedily, as the AR student decodes its tokens (the paper's code can also beam-search
  them); the first step may not end the plan (every target has a token), and a chunk that would take the total
  past max_target_len is never chosen (the decoder has no positions beyond it); a plan that reaches
  max_target_len tokens ends there.
- No label smoothing, no distillation from an autoregressive teacher: the same losses every method here uses.

The chunker reads two tables over the compact vocabulary (`piece_tables`: which pieces start a word, and each
piece's class), built from a Vocabulary's tokenizer (`SynSTModel.from_vocabulary` or `use_vocabulary`) and kept
as buffers, so that a saved model loads and chunks without the tokenizer.
"""

from __future__ import annotations

import torch
from torch import nn

from accelgen.errors import InputError
from accelgen.nar.ar import until_eos
from accelgen.nar.backbone import BackboneConfig, MethodModel, causal_mask, masked_cross_entropy
from accelgen.nar.nat import copy_positions
from accelgen.nar.tokens import BOS, EOS, NEVER_GENERATED, PAD, SPECIALS, Vocabulary, append_eos, pad_sequences

# --- chunk identifiers -------------------------------------------------------------------------------------------

CHUNK_TYPES = ("P", "F", "W", "C")  # punctuation, function words alone, words (led by any function words), code
PUNCT_CHUNK, FUNCTION_CHUNK, WORD_CHUNK, CODE_CHUNK = range(len(CHUNK_TYPES))
# The chunk stream borrows the token stream's padding, start and end ids, so that append_eos, pad_sequences and
# until_eos apply to it as they are; the (type, size) identifiers follow them.
CHUNK_START, CHUNK_END = BOS, EOS
FIRST_CHUNK_ID = max(PAD, BOS, EOS) + 1


def chunk_id(chunk_type: int, size: int, max_chunk_size: int) -> int:
    """The identifier of a chunk of chunk_type (an index into CHUNK_TYPES) and size 1..max_chunk_size."""
    if not 0 <= chunk_type < len(CHUNK_TYPES) or not 1 <= size <= max_chunk_size:
        raise InputError(f"no chunk identifier for type {chunk_type} and size {size} (types 0..{len(CHUNK_TYPES) - 1}"
                         f", sizes 1..{max_chunk_size})")
    return FIRST_CHUNK_ID + chunk_type * max_chunk_size + size - 1


def chunk_vocabulary_size(max_chunk_size: int) -> int:
    """How many chunk identifiers there are: padding, start, end, then every (type, size)."""
    return FIRST_CHUNK_ID + len(CHUNK_TYPES) * max_chunk_size


def chunk_sizes(chunk_ids: torch.Tensor, max_chunk_size: int) -> torch.Tensor:
    """chunk_ids (...) -> the number of tokens of each (...): 0 for padding, start and end."""
    real = chunk_ids >= FIRST_CHUNK_ID
    return torch.where(real, (chunk_ids - FIRST_CHUNK_ID) % max_chunk_size + 1, 0)


def chunk_name(identifier: int, max_chunk_size: int) -> str:
    """A readable identifier: "W3" (words, 3 tokens), "C2" (code, 2 tokens), or "<pad>", "<start>", "<end>"."""
    names = {PAD: "<pad>", CHUNK_START: "<start>", CHUNK_END: "<end>"}
    if identifier in names:
        return names[identifier]
    chunk_type, size = divmod(identifier - FIRST_CHUNK_ID, max_chunk_size)
    if not 0 <= chunk_type < len(CHUNK_TYPES):
        raise InputError(f"{identifier} is not a chunk identifier for max_chunk_size {max_chunk_size}")
    return f"{CHUNK_TYPES[chunk_type]}{size + 1}"


# --- the shallow chunker (pure functions over one target's pieces) -----------------------------------------------

PIECE_CLASSES = ("space", "punct", "dot", "open", "close", "function", "word", "code")
SPACE, PUNCT, DOT, OPEN, CLOSE, FUNCTION, WORD, CODE = range(len(PIECE_CLASSES))
NOT_BUILT = -1  # the class table of a model whose tables were never built from a vocabulary
CODE_CHARACTERS = frozenset("_`[]{}=<>*/\\#@|~^%$+&")  # never in plain English, common in names and expressions
FUNCTION_WORDS = frozenset("""
    a an the this that these those its their his her our your my each every some any no
    of to in on at by for from with without within into onto over under about after before between through
    during against via per than as
    and or but nor if else then so whether while when where unless until because
    it they them we you he she which who whom whose what
    is are was were be been being has have had do does did can could will would should may might must shall not
""".split())
WORD_START_MARKS = ("▁",)  # SentencePiece marks a word start in the piece, and may drop the space when decoding


def piece_class(text: str) -> int:
    """The class of one piece's text: code characters make code (and letters glued to '.', '(' or ')', as in
    '.join' or 'f('); letters or digits make a function word or a word; punctuation alone is a dot, an opening
    bracket, a closing bracket or other punctuation; whitespace alone is space."""
    text = text.strip()
    if not text:
        return SPACE
    if any(character in CODE_CHARACTERS for character in text):
        return CODE
    if any(character.isalnum() for character in text):
        if any(character in "()." for character in text):
            return CODE
        return FUNCTION if text.lower() in FUNCTION_WORDS else WORD
    if text == ".":
        return DOT
    return OPEN if "(" in text else CLOSE if ")" in text else PUNCT


def starts_word(piece: str, text: str) -> bool:
    """Whether a piece begins a new word: its text starts with whitespace (byte-level BPE's 'Ġ' and 'Ċ' decode
    to a space and a newline) or it carries SentencePiece's word mark."""
    return text[:1].isspace() or piece.startswith(WORD_START_MARKS)


def piece_tables(vocabulary: Vocabulary) -> tuple[list[bool], list[int]]:
    """(word_start, piece class) of every compact id of vocabulary. The specials never occur inside a target;
    unk (a piece outside the vocabulary) counts as a word glued to the one before."""
    tokenizer = vocabulary.tokenizer
    pieces = tokenizer.convert_ids_to_tokens(vocabulary.tokenizer_ids)
    texts = [tokenizer.convert_tokens_to_string([piece]) for piece in pieces]
    word_start = [False] * len(SPECIALS) + [starts_word(piece, text) for piece, text in zip(pieces, texts)]
    classes = [WORD] * len(SPECIALS) + [piece_class(text) for text in texts]
    return word_start, classes


def word_parts(classes: list[int]) -> list[tuple[int, int]]:
    """One whitespace-delimited word (its pieces' classes) -> (chunk type, size) of its parts. Code (a code piece,
    a dot or bracket between its letters, a bracket opened right after them) stays whole but for the sentence
    punctuation that ends it ("self.cache.": C3 P1); any other word splits into its leading punctuation, its core
    (one function word, or words) and its trailing punctuation."""
    content = [index for index, piece in enumerate(classes) if piece in (FUNCTION, WORD)]
    core = classes[content[0]:content[-1] + 1] if content else []
    called = bool(content) and content[-1] + 1 < len(classes) and classes[content[-1] + 1] == OPEN  # "join()"
    if CODE in classes or called or DOT in core or OPEN in core or CLOSE in core:
        ending = len(classes) - next(index for index in reversed(range(len(classes)))
                                     if classes[index] not in (PUNCT, DOT)) - 1
        return [(CODE_CHUNK, len(classes) - ending)] + ([(PUNCT_CHUNK, ending)] if ending else [])
    if not content:
        return [(PUNCT_CHUNK, len(classes))]
    first, last = content[0], content[-1]
    parts = [(PUNCT_CHUNK, first)] if first else []
    parts.append((FUNCTION_CHUNK if core == [FUNCTION] else WORD_CHUNK, len(core)))
    if last + 1 < len(classes):
        parts.append((PUNCT_CHUNK, len(classes) - last - 1))
    return parts


def typed_words(word_start: list[bool], classes: list[int]) -> list[tuple[int, int]]:
    """(chunk type, size) of each word part of a target's pieces, in order; the first piece always starts a word."""
    starts = [index for index, start in enumerate(word_start) if start or index == 0] + [len(classes)]
    return [part for begin, end in zip(starts, starts[1:]) for part in word_parts(classes[begin:end])]


def merge_words(words: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent words of one type merge into a chunk; function words open a chunk that the words (or code) after
    them join, the chunk taking their type ("of the cache": W3); a function word after content starts anew."""
    chunks: list[tuple[int, int]] = []
    for word_type, size in words:
        if chunks and (chunks[-1][0] == word_type
                       or (chunks[-1][0] == FUNCTION_CHUNK and word_type in (WORD_CHUNK, CODE_CHUNK))):
            chunks[-1] = (word_type, chunks[-1][1] + size)
        else:
            chunks.append((word_type, size))
    return chunks


def split_long_chunks(chunks: list[tuple[int, int]], max_chunk_size: int) -> list[tuple[int, int]]:
    """Each chunk longer than max_chunk_size cut into pieces of max_chunk_size from the left, the rest last."""
    return [(chunk_type, min(max_chunk_size, size - start)) for chunk_type, size in chunks
            for start in range(0, size, max_chunk_size)]


def chunk_tokens(word_start: list[bool], classes: list[int], max_chunk_size: int) -> list[tuple[int, int]]:
    """The chunks (type, size) of a target given its pieces' word_start and classes: sizes sum to its length,
    none exceeds max_chunk_size."""
    if len(word_start) != len(classes):
        raise InputError(f"word_start has {len(word_start)} pieces but classes {len(classes)}")
    return split_long_chunks(merge_words(typed_words(word_start, classes)), max_chunk_size)


# --- layout of the decoder (pure functions) ----------------------------------------------------------------------


def layout_attention_mask(chunk_positions: int, token_positions: int, device=None) -> torch.Tensor:
    """(C + N, C + N) bool, True where position i must not see position j, for C chunk positions then N token
    placeholders: chunks see earlier chunks only (causal, never a token); tokens see every position."""
    length = chunk_positions + token_positions
    mask = torch.zeros(length, length, dtype=torch.bool, device=device)
    mask[:chunk_positions, :chunk_positions] = causal_mask(chunk_positions, device)
    mask[:chunk_positions, chunk_positions:] = True
    return mask


def placeholder_layout(chunks: torch.Tensor, chunk_mask: torch.Tensor, max_chunk_size: int,
                       width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunks (B, M) identifiers, chunk_mask (B, M) bool -> (token_chunks (B, N), offsets (B, N), token_mask
    (B, N)): token t belongs to chunk identifier token_chunks[:, t] at offset offsets[:, t] within it, its chunk's
    tokens following the earlier chunks' (N = width or the longest total; padding: PAD at offset 0)."""
    sizes = chunk_sizes(chunks, max_chunk_size) * chunk_mask
    positions, token_mask = copy_positions(sizes, width)  # the chunk of each token, as NAT's copy of each source
    starts = sizes.cumsum(dim=1) - sizes
    offsets = torch.arange(positions.shape[1], device=chunks.device) - starts.gather(1, positions)
    return (torch.where(token_mask, chunks.gather(1, positions), PAD), torch.where(token_mask, offsets, 0),
            token_mask)


def allowed_chunks(tokens_left: torch.Tensor, first_step: bool, max_chunk_size: int) -> torch.Tensor:
    """tokens_left (B,) -> (B, chunk identifiers) bool: the identifiers a decoding step may choose, chunks that fit
    in the tokens left and the end (never at the first step: every target has a token); never padding or start."""
    identifiers = torch.arange(chunk_vocabulary_size(max_chunk_size), device=tokens_left.device)
    sizes = chunk_sizes(identifiers, max_chunk_size)
    allowed = (sizes >= 1) & (sizes <= tokens_left.unsqueeze(1))
    allowed[:, CHUNK_END] = not first_step
    return allowed


# --- the model -----------------------------------------------------------------------------------------------


class SynSTModel(MethodModel):
    method = "synst"

    def __init__(self, config: BackboneConfig, max_chunk_size: int = 4):
        super().__init__(config)
        if not 1 <= max_chunk_size <= config.max_target_len:
            raise InputError(f"max_chunk_size must be in 1..{config.max_target_len} (max_target_len), "
                             f"got {max_chunk_size}")
        self.max_chunk_size = max_chunk_size
        identifiers = chunk_vocabulary_size(max_chunk_size)
        self.chunk_embed = nn.Embedding(identifiers, config.width, padding_idx=PAD)
        self.chunk_positions = nn.Embedding(config.max_target_len + 1, config.width)  # start + one per token, at most
        self.offset_embed = nn.Embedding(max_chunk_size, config.width)
        self.chunk_head = nn.Linear(config.width, identifiers)
        # the chunker's tables over the compact vocabulary: buffers, so that a saved model chunks without a tokenizer
        self.register_buffer("word_start", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.register_buffer("piece_class", torch.full((config.vocab_size,), NOT_BUILT, dtype=torch.int8))

    @classmethod
    def from_vocabulary(cls, config: BackboneConfig, vocabulary: Vocabulary, **options) -> SynSTModel:
        """A new model whose chunker reads vocabulary's pieces (the vocabulary the training rows are encoded in)."""
        return cls(config, **options).use_vocabulary(vocabulary)

    def fit_to_data(self, rows: dict[str, torch.Tensor], vocabulary: Vocabulary) -> None:
        self.use_vocabulary(vocabulary)

    def use_vocabulary(self, vocabulary: Vocabulary) -> SynSTModel:
        """Build the chunker's tables from vocabulary's tokenizer; returns the model."""
        if len(vocabulary) != self.config.vocab_size:
            raise InputError(f"the vocabulary has {len(vocabulary)} ids but the model {self.config.vocab_size} "
                             f"(vocab_size): build the model over this vocabulary")
        word_start, classes = piece_tables(vocabulary)
        self.word_start.copy_(torch.tensor(word_start))
        self.piece_class.copy_(torch.tensor(classes, dtype=torch.int8))
        return self

    def options(self) -> dict:
        return {"max_chunk_size": self.max_chunk_size}

    # --- chunks of the training targets ---

    def chunk_targets(self, tgt_ids: torch.Tensor, tgt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tgt_ids (B, T), tgt_mask (B, T) -> (chunks (B, M), chunk_mask (B, M)): each target's chunk identifiers
        from the shallow chunker, padded."""
        if bool((self.piece_class == NOT_BUILT).any()):
            raise InputError("this SynST model has no chunker tables: make it with SynSTModel.from_vocabulary(config, "
                             "vocabulary) or call use_vocabulary(vocabulary), or load a saved one")
        word_start, classes = self.word_start.cpu(), self.piece_class.cpu()
        rows = []
        for ids, mask in zip(tgt_ids.cpu(), tgt_mask.cpu()):
            pieces = ids[mask]
            chunks = chunk_tokens(word_start[pieces].tolist(), classes[pieces].tolist(), self.max_chunk_size)
            rows.append([chunk_id(chunk_type, size, self.max_chunk_size) for chunk_type, size in chunks])
        chunks, chunk_mask = pad_sequences(rows)
        return chunks.to(tgt_ids.device), chunk_mask.to(tgt_ids.device)

    def training_inputs(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The batch with "chunks" and "chunk_mask" (B, M), the gold chunks of each target (unless it brings its
        own). Deterministic: nothing is drawn from generator."""
        if "chunks" in batch:
            return batch
        chunks, chunk_mask = self.chunk_targets(batch["tgt"], batch["tgt_mask"])
        return {**batch, "chunks": chunks, "chunk_mask": chunk_mask}

    # --- the decoder over [chunk inputs | token placeholders] ---

    def layout_hidden(self, memory: torch.Tensor, src_mask: torch.Tensor, chunk_inputs: torch.Tensor,
                      chunk_input_mask: torch.Tensor, token_chunks: torch.Tensor, token_offsets: torch.Tensor,
                      token_mask: torch.Tensor) -> torch.Tensor:
        """One decoder pass: memory (B, S, width), src_mask (B, S); chunk_inputs (B, C) (START then chunk
        identifiers), chunk_input_mask (B, C) bool; token_chunks, token_offsets (B, N) (each placeholder's chunk
        identifier and offset in it), token_mask (B, N) bool -> hidden states (B, C + N, width)."""
        chunk_length, token_length = chunk_inputs.shape[1], token_chunks.shape[1]
        if chunk_length > self.config.max_target_len + 1 or token_length > self.config.max_target_len:
            raise InputError(f"the decoder has {self.config.max_target_len + 1} chunk positions and "
                             f"{self.config.max_target_len} token positions, asked for {chunk_length} and "
                             f"{token_length}")
        device = chunk_inputs.device
        chunk_part = self.chunk_embed(chunk_inputs) + self.chunk_positions(torch.arange(chunk_length, device=device))
        token_part = (self.chunk_embed(token_chunks) + self.offset_embed(token_offsets)
                      + self.backbone.target_positions(torch.arange(token_length, device=device)))
        # the backbone's decode() adds one position table over all its inputs; the two parts number their own
        # positions, so its decoder stack is called directly
        return self.backbone.decoder(torch.cat([chunk_part, token_part], dim=1), memory,
                                     tgt_mask=layout_attention_mask(chunk_length, token_length, device),
                                     tgt_key_padding_mask=~torch.cat([chunk_input_mask, token_mask], dim=1),
                                     memory_key_padding_mask=~src_mask)

    def layout_logits(self, memory: torch.Tensor, src_mask: torch.Tensor, chunks: torch.Tensor,
                      chunk_mask: torch.Tensor, width: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Both stages teacher-forced in one pass over chunks (B, M), chunk_mask (B, M): (chunk logits (B, M + 1,
        chunk identifiers), position i predicting chunk i, then the end; token logits (B, N, V); token_mask (B, N)),
        N = width or the longest total of chunk sizes."""
        chunk_inputs = torch.cat([torch.full_like(chunks[:, :1], CHUNK_START), chunks], dim=1)
        chunk_input_mask = torch.cat([torch.ones_like(chunk_mask[:, :1]), chunk_mask], dim=1)  # the end: no input
        token_chunks, offsets, token_mask = placeholder_layout(chunks, chunk_mask, self.max_chunk_size, width)
        hidden = self.layout_hidden(memory, src_mask, chunk_inputs, chunk_input_mask, token_chunks, offsets,
                                    token_mask)
        chunk_length = chunk_inputs.shape[1]
        return (self.chunk_head(hidden[:, :chunk_length]), self.backbone.logits(hidden[:, chunk_length:]),
                token_mask)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """The chunk identifiers' cross-entropy (each given the earlier ones, then the end) plus the tokens'
        (every token given all the gold chunks), as the paper sums the two negative log-likelihoods."""
        src, src_mask, tgt, tgt_mask = batch["src"], batch["src_mask"], batch["tgt"], batch["tgt_mask"]
        chunks, chunk_mask = batch["chunks"], batch["chunk_mask"]
        if not torch.equal((chunk_sizes(chunks, self.max_chunk_size) * chunk_mask).sum(dim=1), tgt_mask.sum(dim=1)):
            raise InputError("each row's chunk sizes must sum to its target's length")
        memory = self.backbone.encode(src, src_mask)
        chunk_logits, token_logits, _ = self.layout_logits(memory, src_mask, chunks, chunk_mask, width=tgt.shape[1])
        chunk_targets, chunk_target_mask = append_eos(chunks, chunk_mask)  # the chunks, then the end
        chunk_loss = masked_cross_entropy(chunk_logits, chunk_targets, chunk_target_mask)
        token_loss = masked_cross_entropy(token_logits, tgt, tgt_mask)
        return chunk_loss + token_loss, {"chunk_loss": float(chunk_loss.detach()),
                                         "token_loss": float(token_loss.detach())}

    # --- decoding ---

    @torch.no_grad()
    def decode_chunks(self, memory: torch.Tensor, src_mask: torch.Tensor) -> list[list[int]]:
        """Stage 1, memory (B, S, width), src_mask (B, S): greedy chunk identifiers, one per decoder pass over
        the chunk positions alone, until every row has chosen the end or filled max_target_len tokens. Returns
        each row's chunk identifiers, without the end."""
        rows, device = len(memory), memory.device
        chunks = torch.empty(rows, 0, dtype=torch.long, device=device)
        tokens_left = torch.full((rows,), self.config.max_target_len, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        no_tokens = torch.empty(rows, 0, dtype=torch.long, device=device)
        while not finished.all():  # each step spends a token or ends: at most max_target_len steps
            inputs = torch.cat([torch.full((rows, 1), CHUNK_START, device=device), chunks], dim=1)
            hidden = self.layout_hidden(memory, src_mask, inputs, torch.ones_like(inputs, dtype=torch.bool),
                                        no_tokens, no_tokens, no_tokens.bool())
            logits = self.chunk_head(hidden[:, -1])
            logits[~allowed_chunks(tokens_left, chunks.shape[1] == 0, self.max_chunk_size)] = float("-inf")
            chosen = torch.where(finished, PAD, logits.argmax(-1))  # a finished row only pads
            chunks = torch.cat([chunks, chosen.unsqueeze(1)], dim=1)
            tokens_left -= chunk_sizes(chosen, self.max_chunk_size)
            finished |= (chosen == CHUNK_END) | (tokens_left == 0)
        return [until_eos(row) for row in chunks.tolist()]

    @torch.no_grad()
    def fill_chunks(self, memory: torch.Tensor, src_mask: torch.Tensor, chunks: list[list[int]]) -> list[list[int]]:
        """Stage 2, memory (B, S, width), src_mask (B, S), each row's chunk identifiers: every token of every chunk
        in one decoder pass, the most likely at each placeholder (the sizes decide the length: no EOS)."""
        identifiers = chunk_vocabulary_size(self.max_chunk_size)
        for row in chunks:
            if not row:
                raise InputError("every row needs at least one chunk: a target has at least one token")
            if any(not FIRST_CHUNK_ID <= identifier < identifiers for identifier in row):
                raise InputError(f"{row} holds ids that are not chunks of size 1..{self.max_chunk_size}")
            total = sum(chunk_sizes(torch.tensor(row, dtype=torch.long), self.max_chunk_size).tolist())
            if total > self.config.max_target_len:
                raise InputError(f"chunks of {total} tokens do not fit the decoder's {self.config.max_target_len}")
        chunk_ids, chunk_mask = (tensor.to(memory.device) for tensor in pad_sequences(chunks))
        _, token_logits, token_mask = self.layout_logits(memory, src_mask, chunk_ids, chunk_mask)
        token_logits[..., list(NEVER_GENERATED) + [EOS]] = float("-inf")  # the length is decided
        tokens = token_logits.argmax(-1)
        return [row[mask].tolist() for row, mask in zip(tokens, token_mask)]

    @torch.no_grad()
    def generate(self, src_ids: torch.Tensor, src_mask: torch.Tensor) -> list[list[int]]:
        """The target ids of each source (B, S): its chunks autoregressively, then all its tokens in one pass."""
        memory = self.backbone.encode(src_ids, src_mask)
        return self.fill_chunks(memory, src_mask, self.decode_chunks(memory, src_mask))
