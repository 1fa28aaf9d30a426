"""Drafters, one file per method; importing this package registers them all."""

from accelgen.drafters import autoregressive, draft_model, jacobi, llma, lookahead_decoding, lookahead_trie, prompt_lookup, rest, specinfer, mcsd, block_verify  # noqa: F401
from accelgen.drafters import cascade, staged, triforce  # noqa: F401
from accelgen.drafters import universal  # noqa: F401
from accelgen.drafters import self_speculative, layerskip  # noqa: F401
from accelgen.drafters import spectr, specdec, contrastive, bild  # noqa: F401
from accelgen.drafters import auto  # noqa: F401
from accelgen.drafters import medusa, eagle, pass_embeddings  # noqa: F401
from accelgen.drafters import distillspec, online  # noqa: F401
