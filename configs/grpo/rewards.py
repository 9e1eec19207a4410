"""Example reward functions for `python -m jaxlm.rl --rewards=configs/grpo/rewards.py:correct,formatted`.

TRL's convention: each gets the batch's prompts, completions (text), completion_ids, finish_reasons and every other
field of the prompts file as a keyword (a list, one entry per completion), and returns one float per completion,
or None where it cannot judge (left out of the group's statistics).
"""

import re

_ANSWER = re.compile(r'<answer>\s*(-?[\d,]*\.?\d+)\s*</answer>')
_FORMAT = re.compile(r'^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$', re.DOTALL)


def correct(prompts, completions, completion_ids, finish_reasons, answer, **fields):
  """1 when the number inside <answer>...</answer> equals the record's `answer`, else 0 (exact match)."""
  out = []
  for text, want in zip(completions, answer):
    found = _ANSWER.search(text)
    if want is None:
      out.append(None)  # a prompt without an answer cannot be judged
    elif found is None:
      out.append(0.0)
    else:
      out.append(float(float(found.group(1).replace(',', '')) == float(want)))
  return out


def formatted(prompts, completions, completion_ids, finish_reasons, **fields):
  """1 for '<think>...</think> <answer>...</answer>' and nothing else, else 0 (a format reward)."""
  return [float(bool(_FORMAT.match(text))) for text in completions]
