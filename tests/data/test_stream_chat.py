"""data.source=stream with data.stream_format=chat: jsonl conversations tokenized on the fly, with the loss weights
and the whole-conversation packing that `prepare --format=chat` gives (jaxlm/data/lanes.py)."""

import collections

import numpy as np
import pytest

from jaxlm.data import chat as chat_lib
from jaxlm.data import prepare as prepare_lib
from tests.data import chat_fixtures
from tests.data import test_stream_lanes as lanes_test
from tests.helpers import load_config

LANES, SEQ = lanes_test.BATCH, lanes_test.SEQ  # the lanes test helpers: batches of 8 rows of 48


@pytest.fixture(scope='module')
def chat_stream(tmp_path_factory):
  """(stream data config, the prepared records of the same conversations): 8 jsonl files, one over-long record,
  one that is not a conversation, a blank line."""
  d = tmp_path_factory.mktemp('stream_chat')
  tok = chat_fixtures.make_tokenizer(str(d / 'tok'))
  records = chat_fixtures.conversations(96, seed=2)
  records[7] = {'messages': [{'role': 'user', 'content': 'Count. ' * 80},
                             {'role': 'assistant', 'content': 'one ' * 80}]}  # no turn end within SEQ + 1
  (d / 'chat').mkdir()
  for f in range(8):
    extra = ['{"no": "messages"}', ''] if f == 3 else []
    chat_fixtures.write_jsonl(str(d / 'chat' / f'{f}.jsonl'), records[f * 12:(f + 1) * 12] + extra)
  prepare_lib.prepare(prepare_lib.expand_inputs([str(d / 'chat')]), str(d / 'prepared'), tokenizer=tok, workers=1,
                      data_format='chat', seq_len=SEQ, eval_fraction=0.0, progress=False)
  from tests.data.test_prepare import _records  # pylint: disable=import-outside-toplevel
  from jaxlm.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  dtype = prepare_lib.token_dtype(tokenizer_lib.load(tok).vocab_size).name
  import json  # pylint: disable=import-outside-toplevel
  meta = json.loads((d / 'prepared' / 'metadata.json').read_text())
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  stored = []
  for shard in meta['splits']['train']['shards']:
    reader = array_record_module.ArrayRecordReader(str(d / 'prepared' / shard['file']))
    stored += [chat_lib.from_record(r, dtype) for r in reader.read_all()]
    reader.close()
  cfg = load_config().data
  cfg.update(source='stream', stream_format='chat', paths=str(d / 'chat'), tokenizer=tok, seq_len=SEQ,
             stream_lanes=LANES)
  return cfg, stored


def _conversations(rows: list[dict]) -> list[tuple]:
  """The conversations of packed rows, as (ids, weights) bytes: inputs + the last target, weights of the targets."""
  out = []
  for r in rows:
    for s in range(1, int(r['segment_ids'].max()) + 1):
      at = r['segment_ids'] == s
      assert (r['positions'][at] == np.arange(at.sum())).all()
      ids = np.concatenate([r['inputs'][at], r['targets'][at][-1:]]).astype(np.int32)
      out.append((ids.tobytes(), r['weights'][at].astype(np.float32).tobytes()))
    assert not r['weights'][r['segment_ids'] == 0].any()  # padding never counts
  return out


def test_one_lane_epoch_holds_each_prepared_conversation_once_with_its_weights(chat_stream):
  cfg, stored = chat_stream
  from jaxlm.data import lanes as lanes_lib  # pylint: disable=import-outside-toplevel
  lanes, _ = lanes_lib.open_lanes(cfg, seed=0, lanes=LANES, vocab_size=512)
  rows, last = [], []
  for j in range(LANES):  # every lane until its second epoch begins
    it = lanes_lib.LaneIterator(lanes, j)
    while it.cursor['epoch'] == 0:
      rows.append(next(it))
    last.append(rows[-1])
  got = collections.Counter(_conversations(rows))
  want = collections.Counter((ids.astype(np.int32).tobytes(), w[1:].astype(np.float32).tobytes()) for ids, w in stored)
  assert len(stored) > 60  # prepare drops what cannot be cut to fit; the stream drops the same
  assert not want - got, 'a prepared conversation is missing from the stream'
  # Each once: what is left over is the next epoch's start, packed into each lane's last row of this epoch.
  assert sum((got - want).values()) <= len(_conversations(last)) - LANES


def test_chat_rows_are_the_same_on_any_process_count_and_resume_across_counts(chat_stream, tmp_path):
  cfg, _ = chat_stream
  one = lanes_test._global_rows(lanes_test._iterators(cfg, 1), 10)  # pylint: disable=protected-access
  assert lanes_test._global_rows(lanes_test._iterators(cfg, 2), 10) == one  # pylint: disable=protected-access
  its = lanes_test._iterators(cfg, 2)  # pylint: disable=protected-access
  first = lanes_test._global_rows(its, 4)  # pylint: disable=protected-access
  position = lanes_test._checkpointed([it.get_state() for it in its], tmp_path)  # pylint: disable=protected-access
  resumed = lanes_test._iterators(cfg, 1)  # pylint: disable=protected-access
  resumed[0].set_state(position)
  assert first + lanes_test._global_rows(resumed, 6) == one  # pylint: disable=protected-access
