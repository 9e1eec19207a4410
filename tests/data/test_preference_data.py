"""prepare --format=preference: TRL's two pair shapes, the final completion weighted, pairs packed whole."""

import subprocess
import sys

import numpy as np
import pytest

from jaxlm.data import chat as chat_lib
from jaxlm.data import pipeline as data_lib
from jaxlm.data import prepare as prepare_lib
from jaxlm.data import tokenizer as tokenizer_lib
from tests.conftest import ROOT
from tests.data import chat_fixtures
from tests.helpers import load_config


@pytest.fixture(scope='module')
def tok_dir(tmp_path_factory) -> str:
  return chat_fixtures.make_tokenizer(str(tmp_path_factory.mktemp('tok')))


def _records(n: int):
  out = []
  for i in range(n):
    q = f'Add {i % 7} and {i % 5}.'
    good, bad = f'{i % 7} plus {i % 5} is {i % 7 + i % 5}.', f'I do not know {i}.'
    if i % 2:  # explicit prompt, strings
      out.append({'prompt': q, 'chosen': good, 'rejected': bad})
    else:  # implicit prompt: the common prefix of two conversations
      prefix = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': q}]
      out.append({'chosen': prefix + [{'role': 'assistant', 'content': good}],
                  'rejected': prefix + [{'role': 'assistant', 'content': bad}]})
  return out


def test_pairs_are_rendered_whole_weighted_on_the_completion_and_packed_as_units(tmp_path, tok_dir):
  records = _records(24) + [
      {'prompt': 'x', 'chosen': [{'role': 'user', 'content': 'no answer'}], 'rejected': 'y'},  # no final answer
      {'chosen': [{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'b'}],
       'rejected': [{'role': 'user', 'content': 'c'}, {'role': 'assistant', 'content': 'd'}]},  # prompts differ
      {'prompt': 'long ' * 300, 'chosen': 'a', 'rejected': 'b'}]  # does not fit seq_len
  path = chat_fixtures.write_jsonl(tmp_path / 'pairs.jsonl', records)
  out = str(tmp_path / 'out')
  meta = prepare_lib.prepare(prepare_lib.expand_inputs([str(path)]), out, workers=1, shard_docs=8, eval_fraction=0.2,
                             progress=False, data_format='preference', tokenizer=tok_dir, seq_len=128)
  c = meta['chat']
  assert meta['content'] == 'preference' and c['conversations'] == 24 and c['dropped_too_long'] == 1
  assert c['skipped'] == {'no_assistant_turn': 1, 'prompts_differ': 1}
  tok = tokenizer_lib.load(out)
  # What each pair must become: both sides rendered through the template whole; weight on the final answer only.
  expected = {}
  for r in _records(24):
    chosen, rejected = chat_lib.pair_of(r)
    sides = []
    for messages in (chosen, rejected):
      ids, w, _ = chat_lib.encode(tok, chat_lib.LLAMA3, messages)
      text = chat_lib.render(messages, chat_lib.LLAMA3, special_tokens=tok.special_tokens)
      assert tok.decode([int(i) for i, x in zip(ids, w) if x]).strip().startswith(messages[-1]['content'])
      sides.append((tuple(ids.tolist()), w, text))
    expected[sides[0][0]] = sides
  cfg = load_config('base').data
  cfg.update(source='prepared', paths=out, seq_len=128)
  rows, _ = data_lib.make_train_rows(cfg, seed=0, vocab_size=tok.vocab_size, num_epochs=1)
  seen = 0
  for k in range(rows.rows):
    row = rows[k]
    for p in range(1, row['pairs'].max() + 1):
      chosen, rejected = row['pairs'] == p, row['pairs'] == -p
      # adjacent segments of one row: the rejected side starts where the chosen side ends
      assert np.nonzero(rejected)[0][0] == np.nonzero(chosen)[0][-1] + 1
      ids = tuple(row['inputs'][chosen].tolist()) + (int(row['targets'][chosen][-1]),)
      (_, w_c, _), (r_ids, w_r, _) = expected[ids]
      assert tuple(row['inputs'][rejected].tolist()) + (int(row['targets'][rejected][-1]),) == r_ids
      np.testing.assert_array_equal(row['weights'][chosen], w_c[1:])
      np.testing.assert_array_equal(row['weights'][rejected], w_r[1:])
      assert len(np.unique(row['segment_ids'][chosen])) == 1 and len(np.unique(row['segment_ids'][rejected])) == 1
      seen += 1
  assert seen == meta['splits']['train']['documents']
  ev = data_lib.eval_batches(cfg, batch_size=2, num_batches=1, vocab_size=tok.vocab_size, process_index=0,
                             process_count=1)
  assert 'pairs' in ev[0] and ev[0]['pairs'].max() > 0


def test_all_bad_pairs_is_one_line_and_exit_2(tmp_path, tok_dir):
  bad = chat_fixtures.write_jsonl(tmp_path / 'bad.jsonl', [{'text': 'x'}, {'chosen': 'a', 'rejected': 'b'}])
  out = subprocess.run([sys.executable, '-m', 'jaxlm.data.prepare', '--format=preference', f'--tokenizer={tok_dir}',
                        f'--inputs={bad}', f'--out={tmp_path / "o"}'], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 2 and 'Traceback' not in out.stderr, out.stderr[-2000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith('jaxlm: none of the 2 preference records could be used'), last


def test_only_the_final_completion_is_weighted_in_a_multi_turn_pair(tok_dir):
  tok = tokenizer_lib.load(tok_dir)
  prompt = [{'role': 'user', 'content': 'Spell cloud.'}, {'role': 'assistant', 'content': 'c l o u d'},
            {'role': 'user', 'content': 'Now river.'}]
  (c_ids, c_w), (r_ids, r_w) = chat_lib.encode_pair(tok, chat_lib.LLAMA3, {'prompt': prompt, 'chosen': 'r i v e r',
                                                                          'rejected': 'no'})
  assert tok.decode([int(i) for i, w in zip(c_ids, c_w) if w]).strip() == 'r i v e r<|eot_id|>'
  assert tok.decode([int(i) for i, w in zip(r_ids, r_w) if w]).strip() == 'no<|eot_id|>'
  n = np.argmax(c_w)  # the rendered prompts (earlier answer included) are the same tokens on both sides
  assert np.array_equal(c_ids[:n], r_ids[:n]) and not c_w[:n].any()
