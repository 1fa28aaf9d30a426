"""The NAR methods by name: each name's model class, its paper, and what its decoding costs, so that the CLI, the
benchmark and a saved model folder all find a method the same way. A class is imported only when its method is
used."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from accelgen.atomic import save_pretrained_atomically
from accelgen.errors import InputError
from accelgen.nar.backbone import MethodModel, read_saved_config
from accelgen.nar.tokens import Vocabulary

VOCAB_FILE, TOKENIZER_FOLDER = "vocab.json", "tokenizer"


@dataclass(frozen=True)
class NARMethod:
    name: str
    module: str  # accelgen.nar.<module>
    model_class: str
    paper: str
    decoding: str  # what one output costs, in decoder passes

    def load_class(self) -> type[MethodModel]:
        return getattr(importlib.import_module(f"accelgen.nar.{self.module}"), self.model_class)


NAR_METHODS = {method.name: method for method in (
    NARMethod("ar", "ar", "ARStudent", "Vaswani et al. 2017 (the AR student)", "one pass per token"),
    NARMethod("nat", "nat", "NATModel", "Gu et al. 2018, Non-Autoregressive Neural Machine Translation",
              "one pass (noisy parallel decoding: one pass over all candidates + one teacher pass)"),
    NARMethod("enat", "enat", "ENATModel", "Guo et al. 2019, NAT with Enhanced Decoder Input", "one pass"),
    NARMethod("refine", "refine", "RefineModel", "Lee, Mansimov & Cho 2018, Iterative Refinement",
              "one pass + one per refinement, until a fixed point"),
    NARMethod("mask-predict", "mask_predict", "CMLMModel", "Ghazvininejad et al. 2019, Mask-Predict",
              "one pass per iteration, all length candidates together"),
    NARMethod("nat-crf", "crf", "CRFModel", "Sun et al. 2019, Fast Structured Decoding for Sequence Models",
              "one pass + a Viterbi over the top-k tokens"),
    NARMethod("sat", "sat", "SATModel", "Wang, Zhang & Chen 2018, Semi-Autoregressive NMT",
              "one pass per K tokens"),
    NARMethod("synst", "synst", "SynSTModel", "Akoury, Krishna & Iyyer 2019, SynST",
              "one pass per chunk identifier + one pass for all tokens"),
    NARMethod("latent", "latent", "LatentTransformerModel", "Kaiser et al. 2018, Latent Transformer (DVQ)",
              "one pass per latent (T/c) + one pass for all tokens"),
    NARMethod("flowseq", "flowseq", "FlowSeqModel", "Ma et al. 2019, FlowSeq", "one flow + one pass"),
    NARMethod("bert-nar", "bert_nar", "BertNARModel", "Su et al. 2021, NAR generation with pre-trained LMs",
              "one pass"),
    NARMethod("curriculum", "curriculum", "CurriculumModel",
              "Guo et al. 2020, Fine-Tuning by Curriculum Learning for NAT", "one pass"),
)}


def nar_method(name: str) -> NARMethod:
    """The method called name; a ValueError listing the methods for any other name."""
    if name not in NAR_METHODS:
        raise InputError(f"unknown NAR method {name!r}; choose one of {', '.join(NAR_METHODS)}")
    return NAR_METHODS[name]


def load_nar_model(folder: Path) -> MethodModel:
    """The model saved in folder, whatever its method (config.json names it), in eval mode; a ValueError naming
    the problem for a folder of anything else."""
    saved_method = read_saved_config(folder).get("method")
    for method in NAR_METHODS.values():
        model_class = method.load_class()
        if model_class.method == saved_method:
            return model_class.load(folder)
    raise InputError(f"{folder} holds a model of method {saved_method!r}, which this version does not know")


def new_model(name: str, config, options: dict, rows: dict, vocabulary) -> MethodModel:
    """A new model of the method called name, with options, fitted to its training rows and vocabulary."""
    model = nar_method(name).load_class()(config, **options)
    model.fit_to_data(rows, vocabulary)
    return model


def save_trained(model: MethodModel, folder: Path, vocabulary) -> Path:
    """A trained model's folder: the model (config.json last), its vocabulary and the tokenizer the vocabulary
    spells with, so that `accelgen nar generate --model FOLDER` needs nothing else."""
    folder = Path(folder)
    vocabulary.save(folder / VOCAB_FILE)
    save_pretrained_atomically(folder / TOKENIZER_FOLDER, vocabulary.tokenizer)
    return model.save(folder)


def load_trained(folder: Path) -> tuple[MethodModel, Vocabulary]:
    """(model, vocabulary) of a folder written by save_trained."""
    from transformers import AutoTokenizer

    model = load_nar_model(folder)
    if not (Path(folder) / VOCAB_FILE).is_file():
        raise InputError(f"{folder} holds a model but no {VOCAB_FILE}: it was not saved by `accelgen train nar`")
    tokenizer = AutoTokenizer.from_pretrained(Path(folder) / TOKENIZER_FOLDER)
    vocabulary = Vocabulary.load(Path(folder) / VOCAB_FILE, tokenizer)
    if len(vocabulary) != model.config.vocab_size:
        raise InputError(f"{folder}: the vocabulary has {len(vocabulary)} ids, the model {model.config.vocab_size}")
    return model, vocabulary
