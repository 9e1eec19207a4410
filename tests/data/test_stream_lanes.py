"""data.source=stream: lanes over raw parquet / jsonl / txt units, tokenized on the fly (jaxlm/data/lanes.py).

In-process over the data pipeline: P "processes" are P iterators with process_index 0..P-1, and a global batch is
their blocks joined in order (as jax.make_array_from_process_local_data joins them)."""

import collections
import hashlib
import json

import numpy as np
import pytest

from jaxlm import checkpoint as checkpoint_lib
from jaxlm.data import lanes as lanes_lib
from jaxlm.data import pipeline as data_lib
from jaxlm.data import readers
from jaxlm.data import tokenizer as tokenizer_lib
from tests.data import scale_corpus
from tests.helpers import load_config

LANES, BATCH, SEQ, STEPS = 8, 8, 48, 50  # 50 rows of 48 tokens: every lane passes an epoch


@pytest.fixture(scope='session')
def stream_data(tmp_path_factory):
  """The corpus and a tokenizer trained on it: (data config, good documents)."""
  root = tmp_path_factory.mktemp('stream')
  corpus = scale_corpus.write(root / 'corpus')
  tokenizer_lib.train(iter(corpus['docs']), str(root / 'tok.model'), vocab_size=320)
  cfg = load_config().data
  cfg.update(source='stream', paths=str(root / 'corpus'), tokenizer=str(root / 'tok.model'), seq_len=SEQ,
             stream_lanes=LANES, eval_paths=str(root / 'corpus' / 'j0.jsonl'))
  return cfg, corpus['docs']


def _iterators(cfg, processes: int, seed: int = 3):
  return [data_lib.make_train_iterator(cfg, batch_size=BATCH, seed=seed, vocab_size=512, process_index=p,
                                       process_count=processes) for p in range(processes)]


def _global_rows(its, steps: int) -> list[str]:
  """A hash of each global row (inputs, targets, segments, positions, weights) over `steps` batches."""
  out = []
  for _ in range(steps):
    blocks = [it.take(BATCH) for it in its]
    batch = {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
    assert batch['inputs'].shape == (BATCH, SEQ)
    for r in range(BATCH):
      out.append(hashlib.sha256(b''.join(np.ascontiguousarray(batch[k][r]).tobytes() for k in sorted(batch)))
                 .hexdigest()[:16])
  return out


def _checkpointed(states, directory) -> dict:
  """The data position as the trainer reads it back: every process's file, joined by the checkpointer."""
  (directory / 'data').mkdir(parents=True)
  for p, s in enumerate(states):
    (directory / 'data' / f'process_{p}-of-{len(states)}.json').write_text(json.dumps(s))
  return checkpoint_lib.Checkpointer._read_data(str(directory))  # pylint: disable=protected-access


def test_rows_are_the_same_on_any_process_count_and_resume_across_counts(stream_data, tmp_path):
  cfg, _ = stream_data
  lanes_lib.UNITS_OPENED.clear()
  one = _iterators(cfg, 1)
  assert not lanes_lib.UNITS_OPENED  # the start-up reads no row group (nor any other unit)
  reference = _global_rows(one, STEPS)
  assert lanes_lib.UNITS_OPENED and len(set(reference)) > len(reference) // 2  # (short documents repeat words)
  for processes in (2, 4):
    assert _global_rows(_iterators(cfg, processes), STEPS) == reference, processes
  # A run on 2 processes stops after 20 steps (its saved position is all it keeps) ...
  two = _iterators(cfg, 2)
  assert _global_rows(two, 20) == reference[:20 * BATCH]
  state = _checkpointed([it.get_state() for it in two], tmp_path / 'ckpt')
  assert sorted(map(int, state['lanes'])) == list(range(LANES)) and state['rows'] == 20 * BATCH
  assert any(c['datasets'][0]['token'] for c in state['lanes'].values())  # some lane stopped inside a document
  # ... and fresh processes, 4 or 1, continue with the same rows.
  for processes in (4, 1):
    its = _iterators(cfg, processes)
    for it in its:
      it.set_state(json.loads(json.dumps(state)))
    assert _global_rows(its, STEPS - 20) == reference[20 * BATCH:], processes
  assert any(c['datasets'][0]['epoch'] >= 1 for c in its[0].get_state()['lanes'].values())  # past an epoch
  # A position saved before the first batch (a save at step 0) starts every lane at its beginning.
  fresh = _iterators(cfg, 1)
  fresh[0].set_state(_checkpointed([it.get_state() for it in _iterators(cfg, 2)], tmp_path / 'ckpt0'))
  assert _global_rows(fresh, 2) == reference[:2 * BATCH]
  # Another seed, another unit order.
  assert _global_rows(_iterators(cfg, 1, seed=4), 4) != reference[:4 * BATCH]


def test_one_lane_epoch_holds_every_document_once_packed_in_order(stream_data):
  cfg, docs = stream_data
  lanes, _ = lanes_lib.open_lanes(cfg, seed=3, lanes=LANES, vocab_size=512)
  per_lane = [[text for _, _, text in lanes.lane_documents(j, 0)] for j in range(LANES)]
  assert collections.Counter(t for lane in per_lane for t in lane) == collections.Counter(docs)
  assert all(per_lane)
  # A lane's rows are its documents packed end to end: [EOS] + ids in the inputs, ids + [EOS] in the targets.
  j = 5
  it = lanes_lib.LaneIterator(lanes, j)
  rows = [next(it) for _ in range(40)]
  inputs = np.concatenate([r['inputs'] for r in rows])
  targets = np.concatenate([r['targets'] for r in rows])
  ids = [lanes.example(t) for e in (0, 1) for _, _, t in lanes.lane_documents(j, e)]
  stream_in, stream_tg = np.concatenate([i for i, _ in ids]), np.concatenate([t for _, t in ids])
  assert len(stream_in) > len(inputs)
  np.testing.assert_array_equal(inputs, stream_in[:len(inputs)])
  np.testing.assert_array_equal(targets, stream_tg[:len(targets)])
  assert all((r['positions'][r['segment_ids'] == 1][0] == 0) for r in rows)


def test_eval_reads_the_held_out_files_in_order(stream_data):
  cfg, _ = stream_data
  batches = data_lib.eval_batches(cfg, batch_size=4, num_batches=2, vocab_size=512, process_index=1,
                                  process_count=2)
  lanes, _ = lanes_lib.open_lanes(cfg, seed=0, lanes=1, vocab_size=512, paths=cfg.eval_paths, shuffle=False)
  first = lanes.example(next(lanes.texts(0)))[0]
  again = data_lib.eval_batches(cfg, batch_size=4, num_batches=2, vocab_size=512, process_index=0, process_count=2)
  np.testing.assert_array_equal(again[0]['inputs'][0][:len(first)], first[:SEQ])
  assert batches[0]['inputs'].shape == (2, SEQ)


def test_too_few_units_for_the_lanes_is_one_clear_error(stream_data):
  cfg, _ = stream_data
  cfg = cfg.copy_and_resolve_references()
  cfg.paths = cfg.eval_paths
  with pytest.raises(data_lib.DataError, match='stream_lanes'):
    _iterators(cfg, 1)


def test_a_mixture_is_cut_inside_each_lane(stream_data):
  cfg, _ = stream_data
  root = cfg.paths
  parquet = f'{root}/p*.parquet'
  one = _with(cfg, paths=parquet, stream_lanes=4)
  mixed = _with(one, paths=f'{parquet};{root}/p[0-3].parquet', weights='3,1')
  batch = 4

  def rows(c, processes, steps=12):
    its = [data_lib.make_train_iterator(c, batch_size=batch, seed=3, vocab_size=512, process_index=p,
                                        process_count=processes) for p in range(processes)]
    out = []
    for _ in range(steps):
      blocks = [it.take(batch) for it in its]
      out += [r.tobytes() for r in np.concatenate([b['inputs'] for b in blocks])]
    return out, its

  alone, _ = rows(one, 1)
  off, _ = rows(_with(mixed, weights='1,0'), 1)
  assert off == alone  # a dataset of weight 0 never takes a row: the lanes read the first dataset alone
  both, its = rows(mixed, 1)
  assert both != alone and rows(mixed, 2)[0] == both and rows(mixed, 4)[0] == both
  state = its[0].get_state()['lanes']['0']
  assert state['row'] == 12 and state['datasets'][1] != lanes_lib.START  # lane 0 read from both datasets


def _with(cfg, **fields):
  out = cfg.copy_and_resolve_references()
  out.update(**fields)
  return out
