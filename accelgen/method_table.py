"""Every built-in method: its name, family and the module that declares it. Start reading here.

A method is one `register(MethodSpec(...))` in its module (accelgen/registry.py): its drafter, and where it
has them its own verifier and target runner, each with the options dataclass it takes. The registry imports a
module the first time its method is asked for (`get_method`), and all of them to list them (`list_methods`).
Adding a method: one module with its parts and registration, one line here, and its tests.
"""

from __future__ import annotations

# family -> {method name: module that registers it}
FAMILIES: dict[str, dict[str, str]] = {
    # plain decoding, one target forward per token: the reference every method is checked against
    "baseline": {
        "autoregressive": "accelgen.drafters.autoregressive",
    },
    # a policy choosing another method and its options from measured costs
    "policy": {
        "auto": "accelgen.drafters.auto",
    },
    # propose a draft (chain or tree) cheaply, verify it in one target forward
    "speculative": {
        # a separate draft model drafts
        "speculative": "accelgen.drafters.draft_model",
        "distillspec": "accelgen.drafters.distillspec",
        # "online" (the draft keeps learning) trains, so it lives with the trainers and is declared from above them:
        # accelgen/__init__.py (registry.declare_method)
        "specinfer": "accelgen.drafters.specinfer",
        "mcsd": "accelgen.drafters.mcsd",
        "spectr": "accelgen.drafters.spectr",
        "block-verify": "accelgen.drafters.block_verify",
        "specdec": "accelgen.drafters.specdec",
        "contrastive": "accelgen.drafters.contrastive",
        "bild": "accelgen.drafters.bild",
        "staged": "accelgen.drafters.staged",
        "cascade": "accelgen.drafters.cascade",
        "triforce": "accelgen.drafters.triforce",
        "universal": "accelgen.drafters.universal",
        # the target drafts for itself: skipped layers, an early exit, trained heads or embeddings
        "qspec": "accelgen.drafters.qspec",  # its own quantized copy (GGUF on llama.cpp, int8/int4)
        "self-speculative": "accelgen.drafters.self_speculative",
        "layerskip": "accelgen.drafters.layerskip",
        "blockwise": "accelgen.drafters.medusa",
        "medusa": "accelgen.drafters.medusa",
        "medusa-typical": "accelgen.drafters.medusa",
        "eagle": "accelgen.drafters.eagle",
        "pass": "accelgen.drafters.pass_embeddings",
        "bita": "accelgen.drafters.bita",  # mask tokens in the verifying forward, like space
        "space": "accelgen.drafters.space",
        # no model drafts: n-grams of the context, reference documents, a corpus, a shared trie
        "pld": "accelgen.drafters.prompt_lookup",
        "llma": "accelgen.drafters.llma",
        "rest": "accelgen.drafters.rest",
        "trie-lookahead": "accelgen.drafters.lookahead_trie",
    },
    # several tokens per forward by fixed-point iteration, no drafter model
    "parallel": {
        "jacobi": "accelgen.drafters.jacobi",
        "lookahead-decoding": "accelgen.drafters.lookahead_decoding",
    },
    # the target's own forward leaves the layer stack early (a runner of its own), nothing is drafted
    "early-exit": {
        "calm": "accelgen.exits.calm",
        "ee-recompute": "accelgen.exits.ee_recompute",
        "consistent-ee": "accelgen.exits.consistent_ee",
        "free": "accelgen.exits.free",
        "hash-ee": "accelgen.exits.hash_ee",
        "mpee": "accelgen.exits.mpee",
        "skipdecode": "accelgen.exits.skipdecode",
        "ppd": "accelgen.exits.ppd",
        "speed": "accelgen.exits.speed",
    },
}

# method name -> module that registers it
METHODS: dict[str, str] = {name: module for methods in FAMILIES.values() for name, module in methods.items()}
