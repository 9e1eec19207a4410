"""show_batch: the first training rows decoded, loss-masked tokens marked, segments apart; --json per row."""

import json

import numpy as np
import pytest

from jaxlm.data import pipeline as data_lib
from jaxlm.data import prepare as prepare_lib
from jaxlm.data import tokenizer as tokenizer_lib
from jaxlm.tools import show_batch
from tests.data import chat_fixtures
from tests.helpers import load_config, run_cli


@pytest.fixture(scope='module')
def chat_data(tmp_path_factory) -> str:
  d = tmp_path_factory.mktemp('show')
  tok_dir = chat_fixtures.make_tokenizer(str(d / 'tok'))
  chat_fixtures.write_jsonl(d / 'chat.jsonl', chat_fixtures.conversations(24))
  out = str(d / 'chat')
  prepare_lib.prepare(prepare_lib.expand_inputs([str(d / 'chat.jsonl')]), out, tokenizer=tok_dir, workers=1,
                      data_format='chat', seq_len=128, eval_fraction=0.2, progress=False)
  return out


def _cfg(path, cache_dir):
  c = load_config('sft_example')
  c.data.update(paths=path, seq_len=128, cache_dir=str(cache_dir))
  c.model.vocab_size = 400
  c.train.batch_size = 2
  return c


def test_rows_show_masked_prompts_and_trained_answers(chat_data, tmp_path):
  cfg = _cfg(chat_data, tmp_path)
  tok = tokenizer_lib.load(chat_data)
  (batch,) = show_batch.batches(cfg, 1)
  row = {k: v[0] for k, v in batch.items()}
  text = show_batch.render_row(row, tok.decode)
  assert len(show_batch.segments(row)) == row['segment_ids'].max()
  assert text.count('── segment') == row['segment_ids'].max()
  # Every user turn is inside a masked run, every assistant answer outside one.
  masked = ''.join(part.split(show_batch.MASK_CLOSE)[0] for part in text.split(show_batch.MASK_OPEN)[1:])
  trained = ''.join(part.split(show_batch.MASK_OPEN)[0] for part in text.split(show_batch.MASK_CLOSE))
  assert '<|start_header_id|>user<|end_header_id|>' in masked and 'user' not in trained
  assert '<|eot_id|>' in trained  # the assistant's end-of-turn token is trained on


def test_command_line_json_matches_the_training_rows(chat_data, tmp_path):
  out = run_cli('jaxlm.tools.show_batch', '--config=configs/sft_example.py', f'--config.data.paths={chat_data}',
                '--config.data.seq_len=128', '--config.model.vocab_size=400', '--config.train.batch_size=2',
                f'--config.data.cache_dir={tmp_path}', '--batches=2', '--json', devices=1, timeout=300)
  assert out.returncode == 0, out.stderr
  records = [json.loads(line) for line in out.stdout.splitlines()]
  assert len(records) == 4 and {'ids', 'weights', 'segment_ids', 'text'} <= set(records[0])
  rows, _ = data_lib.make_train_rows(_cfg(chat_data, tmp_path).data, seed=0, vocab_size=400)
  for k, r in enumerate(records):
    assert r['ids'] == rows[k]['inputs'].tolist() and np.array_equal(r['weights'], rows[k]['weights'])
  text = run_cli('jaxlm.tools.show_batch', '--config=configs/sft_example.py', f'--config.data.paths={chat_data}',
                 '--config.data.seq_len=128', '--config.model.vocab_size=400', '--config.train.batch_size=2',
                 f'--config.data.cache_dir={tmp_path}', devices=1, timeout=300)
  assert text.returncode == 0 and '=== batch 0 row 1' in text.stdout and show_batch.MASK_OPEN in text.stdout
