"""The teacher's answer becomes a docstring-style summary; its prompts hold each function whole."""

from __future__ import annotations

import pytest

from accelgen.nar.data import Example
from accelgen.nar.task import summary_prompts, teacher_line


@pytest.mark.parametrize("answer, summary", [
    ("The function `current` returns the token at the current position. If it is out of range, it returns None.",
     "Returns the token at the current position."),
    ("This function is designed to make an HTTP request using a client", "Make an HTTP request using a client"),
    ("The `get` function takes a URL and returns a Response.", "Takes a URL and returns a Response."),
    ("This method returns e.g. the value of x.", "Returns e.g. the value of x."),
    ("```\nSummary: Return x.\n", "Return x."),
    ('  "Parse the header."  ', "Parse the header."),
    ("Open the file. Then read it.", "Open the file."),
    ("```python\n```", ""),
    ("", ""),
])
def test_the_teacher_line_is_the_first_sentence_without_its_subject(answer, summary):
    assert teacher_line(answer) == summary


def test_each_prompt_holds_its_function_and_a_stable_id():
    examples = [Example("p", "p/m.py", f"f{index}", f"def f{index}():\n    return {index}\n", "Return it.")
                for index in range(3)]
    prompts = summary_prompts(examples, "test")
    assert [prompt.id for prompt in prompts] == ["test-0", "test-1", "test-2"]
    assert all(example.source in prompt.text and prompt.chat for example, prompt in zip(examples, prompts))
