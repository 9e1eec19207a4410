"""An LLM as judge of saved samples: G-Eval-style fluency (1-3) and coherence (1-5), over an OpenAI-compatible
server that you run (vLLM, llama.cpp's server, any local one). Never inside training.

  python -m jaxlm.tools.judge --samples=runs/x/generations/step_1000.jsonl --url=http://127.0.0.1:8000/v1 \
      --model=NAME [--max_samples=100] [--json]

Each sample (a line of `jaxlm.tools.eval --generate`'s samples file: prompt, completion, human) is asked once per
criterion at temperature 0 for one token, with the top log-probabilities; the score is the probability-weighted
mean of the allowed digits among them (G-Eval, Liu et al. 2023: the weighting spreads ties a bare argmax would
make), renormalised over the digits seen. The human continuation gets the same questions: the human row.
"""

import json
import math
import os
import urllib.error
import urllib.parse
import urllib.request

from absl import flags

from jaxlm import cli
from jaxlm import errors
from jaxlm import metrics

# (name, lowest, highest, question). Scores are read from the digit tokens of the judge's first reply token.
CRITERIA = (
    ('fluency', 1, 3, 'Rate the fluency of the continuation: is it well-formed text (or code) that reads '
     'naturally, free of garbled tokens and of loops? 1 = not fluent, 2 = somewhat fluent, 3 = fluent.'),
    ('coherence', 1, 5, 'Rate the coherence of the continuation with its prompt: does it follow on from the prompt '
     'and hold together as one piece? 1 = incoherent ... 5 = fully coherent.'),
)


LOOPBACK = ('127.0.0.1', 'localhost', '::1')


class JudgeError(errors.JaxlmError, ValueError):
  """A samples file or settings the judge cannot use."""
  exit_code = 2


class EndpointError(errors.StorageError):
  """The judge's server cannot be reached or answers something that is not a chat completion."""
  exit_code = 3


def messages(criterion: tuple, prompt: str, continuation: str) -> list[dict]:
  """The chat asking one criterion about one (prompt, continuation)."""
  name, lo, hi, question = criterion
  return [{'role': 'system', 'content': 'You evaluate text written by a language model. Answer with one digit.'},
          {'role': 'user', 'content': f'{question}\n\nPrompt:\n{prompt}\n\nContinuation:\n{continuation}\n\n'
                                      f'{name.capitalize()} ({lo}-{hi}):'}]


def weighted_score(top_logprobs: list[dict], lo: int, hi: int) -> float | None:
  """Sum of s * p(s) over the digits lo..hi among the top tokens, divided by their total probability; None when
  none of them is an allowed digit."""
  probs = {}
  for entry in top_logprobs:
    token = str(entry.get('token', '')).strip()
    if token.isdigit() and lo <= int(token) <= hi:
      probs[int(token)] = probs.get(int(token), 0.0) + math.exp(float(entry['logprob']))
  total = sum(probs.values())
  return sum(s * p for s, p in sorted(probs.items())) / total if total > 0 else None


def ask(url: str, model: str, chat: list[dict], *, top_logprobs: int = 20, timeout: float = 60.0) -> list[dict]:
  """The top log-probabilities of the judge's first reply token (temperature 0, one token)."""
  body = {'model': model, 'messages': chat, 'temperature': 0, 'max_tokens': 1, 'logprobs': True,
          'top_logprobs': top_logprobs}
  request = urllib.request.Request(url.rstrip('/') + '/chat/completions', data=json.dumps(body).encode(),
                                   headers={'Content-Type': 'application/json'})
  host = urllib.parse.urlparse(url).hostname
  # A server on this machine is reached directly, whatever proxy the environment names.
  opener = urllib.request.build_opener(*([urllib.request.ProxyHandler({})] if host in LOOPBACK else []))
  try:
    with opener.open(request, timeout=timeout) as response:
      reply = json.loads(response.read())
    return reply['choices'][0]['logprobs']['content'][0]['top_logprobs']
  except (urllib.error.URLError, OSError) as e:
    raise EndpointError(f'the judge at {url} did not answer ({getattr(e, "reason", e)}); start the server, or fix '
                        f'--url (the OpenAI-compatible base, e.g. http://127.0.0.1:8000/v1)') from e
  except (KeyError, IndexError, TypeError, json.JSONDecodeError) as e:
    raise EndpointError(f'the judge at {url} answered without log-probabilities ({type(e).__name__}: {e}); use a '
                        f'server that returns chat logprobs (vLLM: any model)') from e


def judge(samples: list[dict], url: str, model: str, **kwargs) -> dict:
  """Mean fluency and coherence of the samples' completions ('model') and of their human continuations
  ('human', where given), with how many answers carried no allowed digit."""
  rows = {}
  for row, field in (('model', 'completion'), ('human', 'human')):
    if not all(isinstance(s.get(field), str) for s in samples):
      continue
    out = {}
    for criterion in CRITERIA:
      name, lo, hi, _ = criterion
      scores = [weighted_score(ask(url, model, messages(criterion, s['prompt'], s[field]), **kwargs), lo, hi)
                for s in samples]
      kept = [x for x in scores if x is not None]
      out[name] = sum(kept) / len(kept) if kept else None
      out[f'{name}_unanswered'] = len(scores) - len(kept)
    rows[row] = out
  rows['signature'] = {'judge_url': url, 'judge_model': model, 'samples': len(samples), 'temperature': 0,
                       'criteria': [c[0] for c in CRITERIA]}
  return rows


def read_samples(path: str, max_samples: int | None = None) -> list[dict]:
  """Records of a samples file (prompt and completion strings, human optional)."""
  try:
    with open(os.path.expanduser(path), encoding='utf-8') as f:
      lines = [line for line in f.read().splitlines() if line.strip()]
  except OSError as e:
    raise JudgeError(f'cannot read --samples={path} ({e.strerror or e}); give the samples file of '
                     f'`jaxlm.tools.eval --generate`') from e
  out = []
  for n, line in enumerate(lines, 1):
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise JudgeError(f'{path}:{n} is not JSON ({e.msg}); give the samples file of `jaxlm.tools.eval '
                       f'--generate`') from e
    if not (isinstance(record, dict) and isinstance(record.get('prompt'), str)
            and isinstance(record.get('completion'), str)):
      raise JudgeError(f'{path}:{n} needs "prompt" and "completion" strings; give the samples file of '
                       f'`jaxlm.tools.eval --generate`')
    out.append(record)
  if not out:
    raise JudgeError(f'{path} holds no samples; generate some with `jaxlm.tools.eval --generate`')
  return out[:max_samples] if max_samples else out


FLAGS = flags.FLAGS


def _define_flags() -> None:
  flags.DEFINE_string('samples', None, 'A samples file of `jaxlm.tools.eval --generate` (jsonl).')
  flags.DEFINE_string('url', None, 'The judge server\'s OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1.')
  flags.DEFINE_string('model', 'judge', 'The model name the server expects.')
  flags.DEFINE_integer('max_samples', None, 'Judge at most this many samples.')
  flags.DEFINE_bool('json', False, 'Print the result as one JSON line.')


def main(argv) -> None:
  del argv
  r = judge(read_samples(FLAGS.samples, FLAGS.max_samples), FLAGS.url, FLAGS.model)
  if FLAGS.json:
    print(json.dumps(r, sort_keys=True))
    return
  keys = [k for k in r['model'] if not k.endswith('_unanswered')]
  fmt = lambda v: '-' if v is None else f'{v:.3f}'  # noqa: E731
  print(metrics.format_table([(row, *(fmt(r[row][k]) for k in keys)) for row in ('model', 'human') if row in r],
                             header=('', *keys), rule=True))


def console() -> None:
  """The command line (also the console script in pyproject.toml)."""
  cli.run(main, define=_define_flags, required=('samples', 'url'))


if __name__ == '__main__':
  console()
