"""Answer extraction, answer matching and the 0/1 outcome reward."""

import threading

import pytest

from rhyme_jax.data import Problem, answers_match, extract_answer, reward


def _prob(answer: str) -> Problem:
    return Problem(id=0, question="q", solution=f"#### {answer}", answer=answer)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5 + 3 = 8\n8 - 2 = 6\n#### 6", "6"),
        ("#### 1,234", "1234"),
        ("#### $1,234,567.50 dollars", "1234567.50"),
        ("first #### 3 then #### 42 apples", "42"),
        ("#### -7.", "-7"),
        ("#### 3/4 cup", "3/4"),
        ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} no wait \\boxed{\\frac{a}{b+{c}}}", "\\frac{a}{b+{c}}"),
        ("#### \\frac{1}{2}", "\\frac{1}{2}"),
        ("\\boxed{3} but finally #### 4", "4"),
        ("\\boxed 7", "7"),
        ("The answer is 12.", None),
        ("unbalanced \\boxed{12", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "pred, gold, same",
    [
        ("1,234", "1234", True),
        ("1234.0", "1234", True),
        ("0.5", "1/2", True),
        ("$18", "18", True),
        ("-3", "3", False),
        ("17", "18", False),
        ("\\frac{1}{2}", "0.5", True),
        ("\\frac{1}{3}", "0.5", False),
        ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
        ("x^2 + 2x + 1", "(x+1)^2", True),
        ("banana", "12", False),
        ("", "12", False),
        ("12", "", False),
    ],
)
def test_answers_match(pred, gold, same):
    assert answers_match(pred, gold) is same


def test_reward_values():
    assert reward("1000 + 234 = 1234\n#### 1,234", _prob("1234")) == 1.0
    assert reward("blah \\boxed{\\frac{1}{2}}", _prob("0.5")) == 1.0
    assert reward("blah \\boxed{\\frac{1}{3}}", _prob("0.5")) == 0.0
    assert reward("#### 1233", _prob("1234")) == 0.0
    assert reward("I think it is 1234", _prob("1234")) == 0.0  # no final-answer marker
    assert reward("", _prob("5")) == 0.0


@pytest.mark.parametrize(
    "garbage",
    ["\x00\xff####\\boxed{{{{", "#### \\frac{", "\\boxed{\\frac{1}{0}}", "####" * 50, "#### ∞∞∞",
     "#### 1/0", "\\boxed{" + "}" * 10, "#### 9" * 3000, None, 123],
)
def test_garbage_never_raises(garbage):
    r = reward(garbage, _prob("9"))
    assert r in (0.0, 1.0)
    assert r == (1.0 if isinstance(garbage, str) and garbage.startswith("#### 9") else 0.0)


def test_reward_in_worker_thread():
    """Math-Verify's signal-based timeout only works in the main thread; rewards must work anyway."""
    out = []
    t = threading.Thread(target=lambda: out.append(
        (reward("\\boxed{\\frac{1}{2}}", _prob("0.5")), reward("#### 12", _prob("12")))))
    t.start()
    t.join()
    assert out == [(1.0, 1.0)]
