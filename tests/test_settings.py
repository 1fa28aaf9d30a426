"""accelgen.settings: one call's arguments read as transformers reads them, into the loop's arguments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import GenerationConfig

from accelgen.settings import ACCELGEN_DEFAULTS, generation_settings


def model_with(**fields):
    return SimpleNamespace(generation_config=GenerationConfig(**fields))


def test_arguments_win_over_the_config_which_wins_over_the_models():
    model = model_with(max_new_tokens=5, top_k=3)
    settings = generation_settings(model, GenerationConfig(max_new_tokens=7), {"max_new_tokens": None, "top_k": None})
    assert settings.arguments["max_new_tokens"] == 7 and settings.arguments["top_k"] == 3
    given = generation_settings(model, GenerationConfig(max_new_tokens=7), {"max_new_tokens": 9})
    assert given.arguments["max_new_tokens"] == 9
    assert generation_settings(model_with(), None, {}).arguments == ACCELGEN_DEFAULTS


def test_hf_names_are_translated():
    settings = generation_settings(model_with(), GenerationConfig(do_sample=True, temperature=0.7, max_length=30,
                                                                  prompt_lookup_num_tokens=4), {})
    assert settings.arguments["method"] == "pld" and settings.arguments["draft_length"] == 4
    assert settings.arguments["temperature"] == 0.7
    assert settings.max_length == 30 and "max_new_tokens" not in settings.arguments


def test_what_cannot_be_honoured_is_refused_by_name():
    with pytest.raises(ValueError, match=r"cannot honour num_beams=4 \(from generation_config\): beam search"):
        generation_settings(model_with(), GenerationConfig(num_beams=4), {})
    with pytest.raises(ValueError, match="must be a transformers GenerationConfig, not dict"):
        generation_settings(model_with(), {"max_new_tokens": 3}, {})
