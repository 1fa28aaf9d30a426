"""Skeleton-of-Thought's prompts and the parsing of a skeleton into its points (Ning et al. 2023,
arXiv:2307.15337, "Skeleton-of-Thought: Prompting LLMs for Efficient Parallel Generation").

The skeleton and point-expanding prompts are the paper's (its Prompts 1 and 2, the skeleton prompt with its two
demonstrations), with the assistant's answer started for the model ("1." for the skeleton, "3. <point>:" for
point 3), as the paper does. The router prompt is
the paper's prompting router (SoT-R, its Prompt 4), and the judge prompt a short form of FastChat's pairwise
judge that the paper evaluates with, asking for the verdict letter only (a 1.5B model cannot reason at length).
"""

from __future__ import annotations

import re

from accelgen.errors import InputError

# the paper asks for 3-10 points; a list of one point has nothing to expand in parallel
MIN_POINTS, MAX_POINTS = 2, 10

SKELETON_PROMPT = (
    "You're an organizer responsible for only giving the skeleton (not the full content) for answering the "
    "question. Provide the skeleton in a list of points (numbered 1., 2., 3., etc.) to answer the question. "
    "Instead of writing a full sentence, each skeleton point should be very short with only 3~5 words. "
    "Generally, the skeleton should have 3~10 points.\n\n"
    "Question:\nWhat are the typical types of Chinese dishes?\nSkeleton:\n1. Dumplings.\n2. Noodles.\n3. Dim Sum.\n"
    "4. Hot Pot.\n5. Wonton.\n6. Ma Po Tofu.\n7. Char Siu.\n8. Fried Rice.\n\n"
    "Question:\nWhat are some practical tips for individuals to reduce their carbon emissions?\nSkeleton:\n"
    "1. Energy conservation.\n2. Efficient transportation.\n3. Home energy efficiency.\n4. Reduce water "
    "consumption.\n5. Sustainable diet.\n6. Sustainable travel.\n\n"
    "Now, please provide the skeleton for the following question.\n{question}\nSkeleton:"
)
SKELETON_START = "1."

POINT_PROMPT = (
    "You're responsible for continuing the writing of one and only one point in the overall answer to the "
    "following question.\n\n{question}\n\nThe skeleton of the answer is\n\n{skeleton}\n\n"
    "Continue and only continue the writing of point {index}. Write it **very shortly** in 1~2 sentence and do "
    "not continue with other points!"
)
# the paper starts the answer with "{index}. {point}"; the colon makes a small model continue the point: without
# it, Qwen2.5-Coder-0.5B tended to end its answer at once, or to write the next points' titles
POINT_START = "{index}. {point}:"

ROUTER_PROMPT = (
    "Question: {question}\n\nHow would you like to answer the question?\n"
    "A. Organize the answer as a list of points or perspectives (in the format of '1., 2., 3.' etc.), and the "
    "points or perspectives can be answered independently without referring to the contents of the previous "
    "points.\n"
    "B. Organize the answer as a list of points or perspectives (in the format of '1., 2., 3.' etc.), and the "
    "contents of later points or perspectives cannot be answered independently without referring to the contents "
    "of the previous points.\n"
    "C. Do not organize the answer as a list of points or perspectives.\n\n"
    "Just say A, B, or C. Do not explain. Do not output other things."
)
ROUTER_LETTERS = ("A", "B", "C")  # "A": suits SoT

JUDGE_PROMPT = (
    "Please act as an impartial judge and evaluate the quality of the responses provided by two AI assistants to "
    "the user question displayed below. Choose the assistant that follows the user's instructions and answers "
    "the user's question better, considering helpfulness, relevance, accuracy, depth and level of detail. Avoid "
    "any position biases and do not let the length of the responses influence your evaluation.\n\n"
    "[User Question]\n{question}\n\n[The Start of Assistant A's Answer]\n{first}\n[The End of Assistant A's "
    "Answer]\n\n[The Start of Assistant B's Answer]\n{second}\n[The End of Assistant B's Answer]\n\n"
    "Output your final verdict only, strictly in this format: \"[[A]]\" if assistant A is better, \"[[B]]\" if "
    "assistant B is better, and \"[[C]]\" for a tie."
)
JUDGE_START = "[["
JUDGE_LETTERS = ("A", "B", "C")  # C: a tie

# "3. point", "3) point", "**3.** point", "- 3. point"; the number is read to check the list runs 1, 2, 3, ...
POINT_LINE = re.compile(r"^\s*(?:[-*]\s*)?(?:\*\*)?(\d{1,2})\s*[.)](?:\*\*)?\s+(.*\S)\s*$")


def check_question(question) -> str:
    """The question, stripped; a clear error for an empty one or one that is not text."""
    if not isinstance(question, str):
        raise TypeError(f"the question must be text, not {type(question).__name__}")
    if not question.strip():
        raise InputError("the question is empty: Skeleton-of-Thought needs a question to outline")
    return question.strip()


def chat_prompt_ids(tokenizer, user_text: str, answer_start: str = "") -> list[int]:
    """Token ids of user_text as a user message in the tokenizer's chat template, with the assistant's answer
    started by answer_start (tokenized together, so the start merges into tokens as the model would write it).
    A tokenizer without a chat template gets the plain text, a newline, and the answer start."""
    if getattr(tokenizer, "chat_template", None) is None:
        return tokenizer(f"{user_text}\n{answer_start}").input_ids
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text + answer_start, add_special_tokens=False).input_ids


def skeleton_prompt_ids(tokenizer, question: str) -> list[int]:
    return chat_prompt_ids(tokenizer, SKELETON_PROMPT.format(question=question), SKELETON_START)


def point_prompt_ids(tokenizer, question: str, points: list[str], index: int) -> list[int]:
    """The prompt expanding point `index` (1-based): the question, the whole skeleton, and that point started."""
    text = POINT_PROMPT.format(question=question, skeleton=skeleton_text(points), index=index)
    return chat_prompt_ids(tokenizer, text, POINT_START.format(index=index, point=points[index - 1]))


def router_prompt_ids(tokenizer, question: str) -> list[int]:
    return chat_prompt_ids(tokenizer, ROUTER_PROMPT.format(question=question))


def judge_prompt_ids(tokenizer, question: str, first: str, second: str) -> list[int]:
    return chat_prompt_ids(tokenizer, JUDGE_PROMPT.format(question=question, first=first, second=second),
                           JUDGE_START)


def skeleton_text(points: list[str]) -> str:
    return "\n".join(f"{index}. {point}" for index, point in enumerate(points, start=1))


def parse_points(skeleton: str, complete: bool = True) -> list[str]:
    """The points of a skeleton: its leading numbered list, numbered 1, 2, 3, ... (at most MAX_POINTS).

    Lines before the list and blank lines are skipped; the list ends at the first line that is neither a blank
    line nor the next number; markdown bold around a point is removed. complete=False (the skeleton stage ran out
    of tokens) drops the last point, which may be cut off mid-phrase. Fewer than MIN_POINTS points: [] (the
    caller falls back to normal decoding).

    Example: "1. Plan.\n2) **Budget**\n\n3. Book early\nThat is all."  ->  ["Plan", "Budget", "Book early"]
    """
    points: list[str] = []
    for line in skeleton.splitlines():
        match = POINT_LINE.match(line)
        if match and int(match.group(1)) == len(points) + 1:
            point = match.group(2).strip().strip("*").strip().rstrip(".:;,").strip()  # a title, continued after ":"
            if point:
                points.append(point)
                continue
        if points and (line.strip() or len(points) >= MAX_POINTS):
            break
    if not complete and points and not skeleton.rstrip(" ").endswith("\n"):
        points = points[:-1]
    points = points[:MAX_POINTS]
    return points if len(points) >= MIN_POINTS else []


def assemble_answer(points: list[str], expansions: list[str]) -> str:
    """The full answer: each point's start ("2. Budget:") followed by its expansion, one point per line."""
    return "\n".join(POINT_START.format(index=index, point=point) + expansion.rstrip()
                     for index, (point, expansion) in enumerate(zip(points, expansions), start=1))
