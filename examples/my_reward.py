"""An example reward for ``reward.fn: examples.my_reward:reward`` (docs/custom_reward.md).

rhyme-jax calls ``reward(response, problem, **reward.kwargs)`` once per sampled response:

* ``response`` (str): the decoded completion, without the prompt;
* ``problem`` (rhyme_jax.data.Problem): ``problem.question`` (the prompt field),
  ``problem.answer`` (the normalised gold answer, e.g. ``"7"``), ``problem.solution``,
  ``problem.id`` and ``problem.metadata`` (the record fields named in ``data.metadata_fields``);
* the keyword arguments are ``reward.kwargs`` from the YAML file.

It returns a float (here in [0, 1], so the held-out ``eval/accuracy`` reads as a score out of 1).
"""

from __future__ import annotations

from rhyme_jax.data.rewards import answers_match, extract_answer_lenient


def reward(response: str, problem, *, unit_bonus: float = 0.2) -> float:
    """1.0 for the right final answer that names the problem's unit (``metadata["unit"]``),
    ``1 - unit_bonus`` for the right answer without it, 0.0 for a wrong or missing answer.

    The final answer is the number after ``####``, else the last number of the response
    (the built-in ``data.answer_extraction: last_number``).
    """
    predicted = extract_answer_lenient(response)
    if predicted is None or not answers_match(predicted, problem.answer):
        return 0.0
    unit = str(problem.metadata.get("unit", ""))
    return 1.0 if unit and unit in response else 1.0 - unit_bonus
