"""The LLM-judge client against a loopback stub of an OpenAI-compatible server (127.0.0.1, started here)."""

import http.server
import json
import math

import pytest

from jaxlm.tools import judge as judge_lib
from tests.helpers import loopback_server

# The stub's first-token top log-probabilities: digits the criteria allow, one they do not, and words.
TOP = [{'token': '2', 'logprob': math.log(0.5)}, {'token': ' 3', 'logprob': math.log(0.25)},
       {'token': '1', 'logprob': math.log(0.125)}, {'token': '7', 'logprob': math.log(0.05)},
       {'token': 'The', 'logprob': math.log(0.05)}]


@pytest.fixture
def stub():
  """(base URL, the JSON bodies it received): a chat-completions server answering TOP for every request."""
  received = []

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
      received.append((self.path, json.loads(self.rfile.read(int(self.headers['Content-Length'])))))
      body = json.dumps({'choices': [{'message': {'role': 'assistant', 'content': '2'},
                                      'logprobs': {'content': [{'token': '2', 'logprob': TOP[0]['logprob'],
                                                                'top_logprobs': TOP}]}}]}).encode()
      self.send_response(200)
      self.send_header('Content-Type', 'application/json')
      self.send_header('Content-Length', str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args):
      pass

  for url in loopback_server(Handler):
    yield f'{url}/v1', received


def test_judge_sends_temperature_0_and_weights_the_digits_by_probability(stub):
  url, received = stub
  samples = [{'prompt': 'def f(x):', 'completion': '\n    return x', 'human': '\n    return 2 * x'},
             {'prompt': 'import', 'completion': ' os os os'}]
  r = judge_lib.judge(samples[:1], url, 'tiny')
  # fluency 1..3: 1·0.125 + 2·0.5 + 3·0.25 over 0.875; coherence 1..5 also admits no more (7 is out of range).
  expected = (1 * 0.125 + 2 * 0.5 + 3 * 0.25) / (0.125 + 0.5 + 0.25)
  assert r['model']['fluency'] == pytest.approx(expected, rel=1e-12)
  assert r['model']['coherence'] == pytest.approx(expected, rel=1e-12)
  assert r['human']['fluency'] == pytest.approx(expected, rel=1e-12) and r['model']['fluency_unanswered'] == 0
  assert len(received) == 4  # two criteria × (completion, human)
  path, body = received[0]
  assert path == '/v1/chat/completions'
  assert body['temperature'] == 0 and body['max_tokens'] == 1 and body['logprobs'] is True and body['model'] == 'tiny'
  assert 'def f(x):' in body['messages'][-1]['content'] and 'return x' in body['messages'][-1]['content']
  assert 'human' not in judge_lib.judge(samples, url, 'tiny')  # the second sample has no human continuation
  assert judge_lib.weighted_score([{'token': 'no', 'logprob': 0.0}], 1, 3) is None


def test_judge_unreachable_is_an_endpoint_error():
  import socket
  with socket.socket() as s:  # a port nothing listens on
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  with pytest.raises(judge_lib.EndpointError, match='did not answer'):
    judge_lib.ask(f'http://127.0.0.1:{port}/v1', 'm', [], timeout=5)


def test_the_command_prints_what_judge_returns_and_refuses_a_bad_samples_file(stub, tmp_path):
  from tests.helpers import assert_fails_with, run_cli  # pylint: disable=import-outside-toplevel
  url, received = stub
  samples = [{'prompt': 'def f(x):', 'completion': '\n    return x', 'human': '\n    return 2 * x'},
             {'prompt': 'import', 'completion': ' os', 'human': ' sys'}]
  path = tmp_path / 'samples.jsonl'
  path.write_text(''.join(json.dumps(s) + '\n' for s in samples))
  want = judge_lib.judge(samples, url, 'tiny')
  out = run_cli('jaxlm.tools.judge', f'--samples={path}', f'--url={url}', '--model=tiny', '--json', timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert json.loads(out.stdout.strip().splitlines()[-1]) == want
  assert len(received) == 8 + 8  # the call's questions (2 criteria × 2 sides × 2 samples), then the command's
  table = run_cli('jaxlm.tools.judge', f'--samples={path}', f'--url={url}', '--model=tiny', timeout=120)
  rows = {line.split()[0]: line.split()[1:] for line in table.stdout.splitlines() if line.split()[:1] in
          (['model'], ['human'])}
  assert rows == {side: [f'{want[side]["fluency"]:.3f}', f'{want[side]["coherence"]:.3f}'] for side in
                  ('model', 'human')}, table.stdout
  path.write_text('{"prompt": "x"}\n')
  assert_fails_with(run_cli('jaxlm.tools.judge', f'--samples={path}', f'--url={url}', timeout=120), 2,
                    'samples.jsonl:1 needs "prompt" and "completion" strings')
