"""The training input pipeline: determinism, resume, process sharding, packing, mixtures, bad data."""

import glob
import json
import logging
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from array_record.python import array_record_module

from jaxlm.data import pipeline as data_lib
from jaxlm.data import prepare as prepare_lib
from jaxlm.data import tokenizer as tokenizer_lib
from tests.conftest import ROOT
from tests.helpers import grid, load_config

VOCAB = 320  # model vocab in these tests; the tokenizers below have <= 320 entries
EOS = 2  # SentencePiece's default eos id, which prepare keeps

WORDS = ('alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega def return class import the quick '
         'brown fox jumps over lazy dog 0 1 2 3 4 5 6 7 8 9').split()


def _docs(n: int, seed: int) -> list[str]:
  rng = np.random.default_rng(seed)
  # `doc<i>` makes every document unique; lengths from a few tokens to several windows of T=32.
  return [f'doc{i} ' + ' '.join(rng.choice(WORDS, size=int(rng.integers(2, 60)))) for i in range(n)]


@pytest.fixture(scope='module')
def prepared(tmp_path_factory) -> str:
  """A small prepared dataset: 60 jsonl documents, 320-entry BPE vocab, about 12 held out."""
  d = tmp_path_factory.mktemp('corpus')
  with open(d / 'docs.jsonl', 'w') as f:
    for text in _docs(60, seed=0):
      f.write(json.dumps({'text': text}) + '\n')
  out = str(d / 'prepared')
  prepare_lib.prepare(prepare_lib.expand_inputs([str(d / 'docs.jsonl')]), out, vocab_size=VOCAB,
                      eval_fraction=0.2, shard_docs=8, workers=1, progress=False)
  return out


def _cfg(paths: str, **overrides):
  c = load_config('base').data
  c.update(source='prepared', paths=paths, seq_len=32, num_workers=0)
  c.update(**overrides)
  return c


def _stored(path: str, split: str) -> list[tuple[int, ...]]:
  """Every document of a prepared split, as stored."""
  meta = json.load(open(os.path.join(path, 'metadata.json')))
  docs = []
  for shard in meta['splits'][split]['shards']:
    reader = array_record_module.ArrayRecordReader(os.path.join(path, shard['file']))
    docs += [tuple(np.frombuffer(r, meta['dtype']).tolist()) for r in reader.read_all()]
    reader.close()
  return docs


def _documents(batches) -> list[tuple[int, ...]]:
  """Documents read back from consecutive batches: non-padding inputs, split at each EOS."""
  stream = np.concatenate([b['inputs'][b['weights'] > 0] for batch in batches for b in _rows(batch)])
  starts = np.flatnonzero(stream == EOS)
  assert starts[0] == 0, 'the stream must begin with a document separator'
  return [tuple(stream[s + 1:e].tolist()) for s, e in zip(starts, list(starts[1:]) + [len(stream)])]


def _rows(batch):
  return [{k: v[i] for k, v in batch.items()} for i in range(len(batch['inputs']))]


def _write_prepared(path: str, like: str, train: list, eval_: list = (), tokenizer: str | None = None) -> str:
  """A prepared directory holding exactly these token lists (metadata copied from `like`)."""
  os.makedirs(path)
  meta = json.load(open(os.path.join(like, 'metadata.json')))
  shutil.copyfile(tokenizer or os.path.join(like, 'tokenizer.model'), os.path.join(path, 'tokenizer.model'))
  meta['tokenizer_sha256'] = tokenizer_lib.file_sha256(os.path.join(path, 'tokenizer.model'))
  for split, docs in (('train', train), ('eval', eval_)):
    shards = []
    if docs:
      writer = array_record_module.ArrayRecordWriter(os.path.join(path, f'{split}-00000.arrayrecord'), 'group_size:1')
      for doc in docs:
        writer.write(np.asarray(doc, meta['dtype']).tobytes())
      writer.close()
      shards = [{'file': f'{split}-00000.arrayrecord', 'documents': len(docs), 'tokens': sum(map(len, docs))}]
    meta['splits'][split] = {'documents': len(docs), 'tokens': sum(map(len, docs)), 'shards': shards}
  json.dump(meta, open(os.path.join(path, 'metadata.json'), 'w'))
  return path


def _take(it, n):
  return [next(it) for _ in range(n)]


def _equal(a, b) -> bool:
  return all(set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_batches_follow_the_contract(prepared):
  # No process arguments: this one JAX process reads the whole batch.
  it = data_lib.make_train_iterator(_cfg(prepared), batch_size=4, seed=0, vocab_size=VOCAB)
  for batch in _take(it, 5):
    assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
        'inputs': ((4, 32), 'int32'), 'targets': ((4, 32), 'int32'), 'segment_ids': ((4, 32), 'int32'),
        'positions': ((4, 32), 'int32'), 'weights': ((4, 32), 'float32')}
    for row in _rows(batch):
      same = row['segment_ids'][1:] == row['segment_ids'][:-1]
      # Inside a document the target of t is the input of t + 1: the shift is right at every position.
      np.testing.assert_array_equal(row['targets'][:-1][same], row['inputs'][1:][same])
      assert row['inputs'].max() < VOCAB and row['inputs'].min() >= 0


def test_same_seed_same_batches_other_seed_other_order(prepared):
  make = lambda seed: data_lib.make_train_iterator(_cfg(prepared), batch_size=4, seed=seed, vocab_size=VOCAB,
                                                   process_index=0, process_count=1)
  a, b, c = _take(make(7), 6), _take(make(7), 6), _take(make(8), 6)
  assert _equal(a, b)
  assert not _equal(a, c)


@pytest.mark.parametrize('num_workers', grid([0, 2], fast=[0]))  # workers are processes: full suite only
def test_state_restore_gives_identical_next_batches(prepared, num_workers):
  cfg = _cfg(prepared, num_workers=num_workers)
  make = lambda: data_lib.make_train_iterator(cfg, batch_size=4, seed=3, vocab_size=VOCAB, process_index=0,
                                              process_count=1)
  it = make()
  _take(it, 5)
  state = json.dumps(it.get_state())  # JSON-serialisable, as Grain's Orbax handler writes it
  want = _take(it, 6)
  fresh = make()
  fresh.set_state(json.loads(state))
  assert _equal(_take(fresh, 6), want)
  if num_workers:
    it.close()
    fresh.close()


def test_state_saved_by_orbax_checkpoint_manager(prepared, tmp_path):
  grain = pytest.importorskip('grain')
  ocp = pytest.importorskip('orbax.checkpoint')
  make = lambda: data_lib.make_train_iterator(_cfg(prepared), batch_size=4, seed=1, vocab_size=VOCAB,
                                              process_index=0, process_count=1)
  it = make()
  _take(it, 3)
  with ocp.CheckpointManager(str(tmp_path / 'ckpt')) as mngr:
    mngr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    want = _take(it, 4)
    restored = mngr.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(make())))
  assert _equal(_take(restored['data'], 4), want)


@pytest.mark.parametrize('process_count', [2, 4])
def test_processes_are_disjoint_and_cover_one_epoch(prepared, process_count):
  # Each process holds its contiguous block of every global batch; together the blocks are the whole stream.
  size = 2 * process_count
  per_process = [list(data_lib.make_train_iterator(_cfg(prepared), batch_size=size, seed=5, vocab_size=VOCAB,
                                                   process_index=p, process_count=process_count, num_epochs=1))
                 for p in range(process_count)]
  assert len({len(b) for b in per_process}) == 1  # every process gets the same number of batches
  glued = [{k: np.concatenate([b[i][k] for b in per_process]) for k in per_process[0][i]}
           for i in range(len(per_process[0]))]
  stored = _stored(prepared, 'train')
  assert sorted(_documents(glued)) == sorted(stored)  # every training document exactly once, none dropped
  one = list(data_lib.make_train_iterator(_cfg(prepared), batch_size=size, seed=5, vocab_size=VOCAB,
                                          process_index=0, process_count=1, num_epochs=1))
  assert _equal(glued, one) and len(glued) == len(one)  # the processes' blocks are the 1-process batches
  for p, batches in enumerate(per_process):
    assert all(len(b['inputs']) == size // process_count for b in batches)  # balanced to the row
    rows = {r['inputs'].tobytes() for b in batches for r in _rows(b) if r['weights'].any()}
    for q in range(p):
      assert not rows & {r['inputs'].tobytes() for b in per_process[q] for r in _rows(b) if r['weights'].any()}


def test_each_epoch_is_reshuffled(prepared):
  it = data_lib.make_train_iterator(_cfg(prepared), batch_size=1, seed=0, vocab_size=VOCAB, process_index=0,
                                    process_count=1, num_epochs=2)
  docs = _documents(list(it))
  n = len(_stored(prepared, 'train'))
  first, second = docs[:n], docs[n:]
  assert sorted(first) == sorted(second) == sorted(_stored(prepared, 'train'))
  assert first != second


def test_exactly_one_eos_between_documents(prepared):
  it = data_lib.make_train_iterator(_cfg(prepared), batch_size=1, seed=0, vocab_size=VOCAB, process_index=0,
                                    process_count=1, num_epochs=1)
  batches = list(it)
  stream = np.concatenate([b['inputs'][b['weights'] > 0] for b in batches])
  n_docs = len(_stored(prepared, 'train'))
  assert (stream == EOS).sum() == n_docs  # one separator per document, no more
  assert not np.any((stream[1:] == EOS) & (stream[:-1] == EOS))  # never two in a row
  targets = np.concatenate([b['targets'][b['weights'] > 0] for b in batches])
  assert (targets == EOS).sum() == n_docs


def test_one_eos_even_when_stored_documents_carry_their_own(prepared, tmp_path):
  # Shards from a tokenizer that adds BOS/EOS itself (and an empty document that is only an EOS).
  docs = [[1, 10, 11, EOS], [20, 21, 22, EOS, EOS], [EOS], [1, 30, 31]]
  path = _write_prepared(str(tmp_path / 'withe'), prepared, docs, eval_=docs)
  batch = data_lib.eval_batches(_cfg(path, seq_len=16), batch_size=1, num_batches=1, vocab_size=VOCAB,
                                process_index=0, process_count=1)[0]
  np.testing.assert_array_equal(batch['inputs'][0][:10], [EOS, 10, 11, EOS, 20, 21, 22, EOS, 30, 31])
  np.testing.assert_array_equal(batch['targets'][0][:10], [10, 11, EOS, 20, 21, 22, EOS, 30, 31, EOS])
  assert (batch['inputs'][0][batch['weights'][0] > 0] == EOS).sum() == 3
  it = data_lib.make_train_iterator(_cfg(path, seq_len=16), batch_size=1, seed=0, vocab_size=VOCAB,
                                    process_index=0, process_count=1, num_epochs=1)
  stream = np.concatenate([b['inputs'][b['weights'] > 0] for b in it])
  assert (stream == EOS).sum() == 3 and 1 not in stream


def _boundary_docs():
  return [[10, 11, 12], [20, 21, 22, 23, 24], list(range(30, 40))]


def test_segment_ids_and_positions_at_document_boundaries(prepared, tmp_path):
  path = _write_prepared(str(tmp_path / 'b'), prepared, _boundary_docs(), eval_=_boundary_docs())
  got = data_lib.eval_batches(_cfg(path, seq_len=8), batch_size=1, num_batches=3, vocab_size=VOCAB,
                              process_index=0, process_count=1)
  rows = [{k: v[0].tolist() for k, v in b.items()} for b in got]
  E = EOS
  assert [r['inputs'] for r in rows] == [[E, 10, 11, 12, E, 20, 21, 22], [23, 24, E, 30, 31, 32, 33, 34],
                                         [35, 36, 37, 38, 39, 0, 0, 0]]
  assert [r['targets'] for r in rows] == [[10, 11, 12, E, 20, 21, 22, 23], [24, E, 30, 31, 32, 33, 34, 35],
                                          [36, 37, 38, 39, E, 0, 0, 0]]
  assert [r['segment_ids'] for r in rows] == [[1, 1, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, 2, 2, 2, 2],
                                              [1, 1, 1, 1, 1, 0, 0, 0]]
  # A document's continuation in the next row restarts its positions (it cannot see its first part anyway).
  assert [r['positions'] for r in rows] == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 5],
                                            [0, 1, 2, 3, 4, 0, 0, 0]]
  assert rows[2]['weights'] == [1, 1, 1, 1, 1, 0, 0, 0]


def test_cross_document_attention_gives_one_segment_and_plain_positions(prepared, tmp_path):
  path = _write_prepared(str(tmp_path / 'x'), prepared, _boundary_docs(), eval_=_boundary_docs())
  got = data_lib.eval_batches(_cfg(path, seq_len=8, cross_document_attention=True), batch_size=1, num_batches=3,
                              vocab_size=VOCAB, process_index=0, process_count=1)
  assert got[0]['segment_ids'][0].tolist() == [1] * 8
  assert got[2]['segment_ids'][0].tolist() == [1] * 5 + [0] * 3
  assert all(b['positions'][0].tolist() == list(range(8)) for b in got)
  assert got[2]['weights'][0].tolist() == [1] * 5 + [0] * 3


def test_document_longer_than_seq_len_is_split_not_dropped(prepared, tmp_path):
  long_doc = list(range(40, 60))  # 20 tokens + separator over windows of 8
  path = _write_prepared(str(tmp_path / 'l'), prepared, [long_doc], eval_=[long_doc])
  got = data_lib.eval_batches(_cfg(path, seq_len=8), batch_size=1, num_batches=3, vocab_size=VOCAB,
                              process_index=0, process_count=1)
  inputs = np.concatenate([b['inputs'][0][b['weights'][0] > 0] for b in got])
  assert inputs.tolist() == [EOS] + long_doc
  assert [b['positions'][0][0] for b in got] == [0, 0, 0]
  assert np.concatenate([b['targets'][0][b['weights'][0] > 0] for b in got]).tolist() == long_doc + [EOS]


def test_mixture_follows_weights(prepared, tmp_path):
  a = _write_prepared(str(tmp_path / 'a'), prepared, [list(range(10, 40))] * 8)
  b = _write_prepared(str(tmp_path / 'b'), prepared, [list(range(200, 230))] * 8)
  it = data_lib.make_train_iterator(_cfg(f'{a},{b}', seq_len=16, weights='3,1'), batch_size=8, seed=0,
                                    vocab_size=VOCAB, process_index=0, process_count=1)
  rows = np.concatenate([x['inputs'] for x in _take(it, 25)])
  from_b = (rows >= 200).any(axis=1)
  assert not ((rows >= 10) & (rows < 40)).any(axis=1)[from_b].any()  # a row comes from one dataset
  assert 0.2 < from_b.mean() < 0.3


def test_mixture_needs_one_tokenizer(prepared, tmp_path):
  other = str(tmp_path / 'other.model')
  tokenizer_lib.train(_docs(80, seed=1), other, vocab_size=300)
  b = _write_prepared(str(tmp_path / 'b'), prepared, [[10, 11]] * 4, tokenizer=other)
  with pytest.raises(data_lib.DataError, match='different tokenizers'):
    data_lib.make_train_iterator(_cfg(f'{prepared},{b}'), batch_size=2, seed=0, vocab_size=VOCAB,
                                 process_index=0, process_count=1)


def _copy(prepared, tmp_path) -> str:
  return shutil.copytree(prepared, tmp_path / 'copy')


@pytest.mark.parametrize('damage, message', [
    ('missing_dir', 'does not exist'),
    ('no_metadata', 'no metadata.json'),
    ('vocab', 'vocabulary but model.vocab_size=100; set --config.model.vocab_size=320 or more, or prepare again '
              'with --vocab_size<=100'),  # a tokenizer prepare trained: a smaller one is a fix too
    ('tokenizer', 'does not match the tokenizer'),
    ('truncated', 'truncated'),
    ('missing_shard', 'is missing'),
])
def test_bad_data_gives_a_clear_error(prepared, tmp_path, damage, message):
  path, vocab = str(_copy(prepared, tmp_path)), VOCAB
  train = os.path.join(path, 'train-00001.arrayrecord')
  if damage == 'missing_dir':
    path = str(tmp_path / 'nowhere')
  elif damage == 'no_metadata':
    os.remove(os.path.join(path, 'metadata.json'))
  elif damage == 'vocab':
    vocab = 100
  elif damage == 'tokenizer':
    tokenizer_lib.train(_docs(80, seed=2), os.path.join(path, 'tokenizer.model'), vocab_size=300)
  elif damage == 'truncated':
    raw = open(train, 'rb').read()
    open(train, 'wb').write(raw[:len(raw) // 2])
  elif damage == 'missing_shard':
    os.remove(train)
  with pytest.raises(data_lib.DataError, match=message) as e:
    data_lib.make_train_iterator(_cfg(path), batch_size=2, seed=0, vocab_size=vocab, process_index=0,
                                 process_count=1)
  assert isinstance(e.value, ValueError)


def _damage_chunks(shard: str) -> None:
  """Overwrites the first half of an array_record shard, keeping its size (its footer and index stay)."""
  size = os.path.getsize(shard)
  with open(shard, 'r+b') as f:
    f.write(b'\xff' * (size // 2))


@pytest.mark.parametrize('num_workers', grid([0, 2], fast=[0]))
def test_a_shard_damaged_mid_run_is_one_data_error(prepared, tmp_path, num_workers):
  path = str(_copy(prepared, tmp_path))
  it = data_lib.make_train_iterator(_cfg(path, num_workers=num_workers), batch_size=2, seed=0, vocab_size=VOCAB,
                                    process_index=0, process_count=1)
  for shard in glob.glob(os.path.join(path, 'train-*.arrayrecord')):
    _damage_chunks(shard)
  with pytest.raises(data_lib.DataError, match=r'reading the training data failed after row 0 \(RuntimeError: '
                                              r'Corrupted .*; a shard changed or was damaged'):
    for _ in range(20):
      next(it)
  it.close()


def test_batch_must_split_over_processes(prepared):
  with pytest.raises(data_lib.DataError, match='not divisible'):
    data_lib.make_train_iterator(_cfg(prepared), batch_size=6, seed=0, vocab_size=VOCAB, process_index=0,
                                 process_count=4)


def test_eval_batches_are_deterministic_and_split_over_processes(prepared):
  kw = dict(batch_size=4, num_batches=3, vocab_size=VOCAB)
  first = data_lib.eval_batches(_cfg(prepared), process_index=0, process_count=1, **kw)
  assert len(first) == 3 and _equal(first, data_lib.eval_batches(_cfg(prepared), process_index=0,
                                                                    process_count=1, **kw))
  halves = [data_lib.eval_batches(_cfg(prepared), process_index=p, process_count=2, **kw) for p in range(2)]
  for k in range(3):
    for key in first[k]:
      np.testing.assert_array_equal(np.concatenate([halves[0][k][key], halves[1][k][key]]), first[k][key])
  # Held-out documents only: none of them occurs in the training split.
  assert not set(_documents(first)[1:-1]) & set(_stored(prepared, 'train'))


def test_eval_cycles_a_small_split_and_says_so(prepared, caplog):
  caplog.set_level(logging.WARNING)
  got = data_lib.eval_batches(_cfg(prepared), batch_size=4, num_batches=40, vocab_size=VOCAB, process_index=0,
                              process_count=1)
  assert len(got) == 40
  assert 'cycling' in caplog.text


def test_eval_without_held_out_documents_fails_clearly(prepared, tmp_path):
  path = _write_prepared(str(tmp_path / 'noeval'), prepared, [[10, 11]] * 4)
  with pytest.raises(data_lib.DataError, match='no eval documents'):
    data_lib.eval_batches(_cfg(path), batch_size=2, num_batches=1, vocab_size=VOCAB, process_index=0,
                          process_count=1)


def test_load_tokenizer_matches_the_data(prepared):
  tok = data_lib.load_tokenizer(_cfg(prepared), VOCAB)
  meta = json.load(open(os.path.join(prepared, 'metadata.json')))
  assert (tok.eos_id, tok.vocab_size) == (meta['eos_id'], meta['vocab_size'])
  assert data_lib.tokenizer_path(_cfg(prepared), VOCAB) == tok.path == os.path.join(prepared, 'tokenizer.model')
  assert data_lib.tokenizer_path(_cfg(prepared)) == tok.path  # vocab_size may be left out for prepared data
  text = 'doc7 lazy fox 1234'
  assert tok.decode(tok.encode(text)) == text
  assert tok.decode(tok.encode(text) + [VOCAB + 5]) == text  # ids beyond the tokenizer (padded vocab) ignored


def _stdlib_cfg(cache_dir):
  return _cfg('', source='stdlib', cache_dir=str(cache_dir), stdlib_max_mb=1, eval_fraction=0.25)


def test_stdlib_corpus_is_prepared_once_and_reused(tmp_path):
  cfg = _stdlib_cfg(tmp_path)
  it = data_lib.make_train_iterator(cfg, batch_size=2, seed=0, vocab_size=400, process_index=0, process_count=1)
  assert next(it)['inputs'].shape == (2, 32)
  (path,) = data_lib.dataset_dirs(cfg, 400)
  meta = json.load(open(os.path.join(path, 'metadata.json')))
  assert meta['vocab_size'] <= 400 and meta['splits']['eval']['documents'] > 0
  assert all('site-packages' not in s['path'] for s in meta['sources'])
  assert sum(s['bytes'] for s in meta['sources']) <= 1e6
  before = os.path.getmtime(os.path.join(path, 'metadata.json'))
  start = time.time()
  assert data_lib.dataset_dirs(cfg, 400) == [path]
  assert time.time() - start < 0.5 and os.path.getmtime(os.path.join(path, 'metadata.json')) == before
  assert data_lib.eval_batches(cfg, batch_size=2, num_batches=2, vocab_size=400, process_index=0,
                               process_count=1)[0]['inputs'].shape == (2, 32)


def test_stdlib_preparation_is_safe_when_two_processes_start_together(tmp_path):
  code = ('import sys; sys.path.insert(0, %r)\n'
          'from absl import logging; logging.set_verbosity(logging.INFO)\n'
          'from jaxlm.data import prepare\n'
          'from tests.helpers import load_config\n'
          'c = load_config("base").data\n'
          'c.update(cache_dir=%r, stdlib_max_mb=1, eval_fraction=0.25)\n'
          'if __name__ == "__main__":\n'
          '  print(prepare.stdlib_dataset(c, 400))\n') % (str(ROOT), str(tmp_path))
  procs = [subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT) for _ in range(2)]
  outs = [p.communicate(timeout=120) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  assert outs[0][0] == outs[1][0]
  assert sum('preparing the stdlib corpus' in err for _, err in outs) == 1  # one did the work, one waited
  assert not [n for n in os.listdir(tmp_path) if n.endswith('.partial')]
  path = outs[0][0].strip()
  assert data_lib.open_prepared(path, 400).meta['documents'] > 0


# --- The global stream: the same batches on any number of processes and workers; exact, checked resume. -----

def _global(cfg, process_count: int, batches: int, size: int = 8, sizes=None, **kw) -> list[dict]:
  """The first global batches, assembled from every process's rows as make_array_from_process_local_data does."""
  its = [data_lib.make_train_iterator(cfg, batch_size=size, seed=11, vocab_size=VOCAB, process_index=p,
                                      process_count=process_count, **kw) for p in range(process_count)]
  out = []
  for i in range(batches):
    parts = [it.take(sizes[i]) if sizes else next(it) for it in its]
    out.append({k: np.concatenate([part[k] for part in parts]) for k in parts[0]})
  for it in its:
    it.close()
  return out


@pytest.mark.parametrize('process_count, num_workers', grid([(2, 0), (4, 0), (1, 2), (2, 2)], fast=[(2, 0), (4, 0)],
                                                            ids=lambda c: f'{c[0]}-{c[1]}', unpack=True))
def test_global_batches_do_not_depend_on_processes_or_workers(prepared, process_count, num_workers):
  want = _global(_cfg(prepared), 1, 12)
  got = _global(_cfg(prepared, num_workers=num_workers), process_count, 12)
  assert _equal(got, want) and len(got) == 12
  # A batch ramp cuts the same rows into other batch sizes: 4, 4, 8, 8, ... rows, in the stream's order.
  sizes = [4, 4, 8, 8, 8]
  ramp = _global(_cfg(prepared), process_count, 5, size=4, sizes=sizes)
  rows = np.concatenate([b['inputs'] for b in want])[:sum(sizes)]
  np.testing.assert_array_equal(np.concatenate([b['inputs'] for b in ramp]), rows)


@pytest.mark.e2e  # starts Grain worker processes
def test_mixture_is_a_function_of_the_row_position(prepared, tmp_path):
  a = _write_prepared(str(tmp_path / 'a'), prepared, [list(range(10, 10 + n)) for n in range(3, 40)])
  b = _write_prepared(str(tmp_path / 'b'), prepared, [list(range(200, 200 + n)) for n in range(3, 30)])
  cfg = _cfg(f'{a},{b}', weights='2,1')
  want = _global(cfg, 1, 10)
  assert _equal(_global(cfg, 4, 10), want) and _equal(_global(_cfg(f'{a},{b}', weights='2,1', num_workers=2), 2, 10),
                                                      want)
  rows = np.concatenate([x['inputs'] for x in want])
  from_b = (rows >= 200).any(axis=1)
  assert from_b.mean() == pytest.approx(1 / 3, abs=0.02)


def test_rows_are_what_concat_then_split_packs(prepared):
  # The stream packs exactly as the Grain packer would the same documents in the same order (format unchanged).
  import grain
  for cross in (False, True):
    cfg = _cfg(prepared, cross_document_attention=cross)
    rows, _ = data_lib.make_train_rows(cfg, seed=4, vocab_size=VOCAB, num_epochs=1)
    stream = rows.streams[0]
    order, _ = stream.epoch(0)
    p = data_lib.open_prepared(prepared, VOCAB)
    # The order is Grain's `shuffle(seed)` of the documents (so 1 process reads what the per-process pipeline did).
    shuffled = data_lib._source(p, 'train').shuffle(seed=data_lib._seed(4, 0))
    assert [shuffled[i] for i in range(len(order))] == [stream.source[int(i)] for i in order]
    ds = grain.MapDataset.source([stream.source[int(i)] for i in order])
    packed = list(data_lib._packed(ds, p, 32, cross, read_threads=1))
    assert len(packed) == len(rows)
    assert _equal([rows[k] for k in range(len(rows))], packed)


def test_state_is_the_global_row_position(prepared):
  one = data_lib.make_train_iterator(_cfg(prepared), batch_size=8, seed=2, vocab_size=VOCAB, process_index=0,
                                     process_count=1)
  _take(one, 3)
  state = json.loads(json.dumps(one.get_state()))
  assert state['rows'] == 24 and state['tokens'] == 24 * 32
  want = _take(one, 2)
  # Saved by one process, continued by four: their blocks are the rows the one process reads next.
  parts = []
  for p in range(4):
    it = data_lib.make_train_iterator(_cfg(prepared), batch_size=8, seed=2, vocab_size=VOCAB, process_index=p,
                                      process_count=4)
    it.set_state(state)
    parts.append(_take(it, 2))
  assert _equal([{k: np.concatenate([parts[p][i][k] for p in range(4)]) for k in want[i]} for i in range(2)], want)


def _resume(cfg, state, allow=False, **fields):
  it = data_lib.make_train_iterator(cfg, batch_size=8, seed=fields.pop('seed', 2), vocab_size=VOCAB,
                                    process_index=0, process_count=1)
  it.expect(allow_change=allow, **fields)
  it.set_state(state)
  return it


@pytest.mark.parametrize('change, message', [
    ('seq_len', r'data\.seq_len was 32 when the checkpoint was written, now 16\. Fix: set --config\.data\.seq_len=32'),
    ('batch_size', r'train\.batch_size was 8 when the checkpoint was written, now 16\. Fix: set '
                   r'--config\.train\.batch_size=8'),
    ('dataset', r'data\.paths was \[\[.*\]\] when the checkpoint was written, now \[\[.*\]\]\. Fix: use the original'),
    ('tokenizer', r'tokenizer was .* now .*Fix: use the original data'),
    ('old_format', r'the data position was .*per-process Grain iterator'),
])
def test_a_resume_that_cannot_be_exact_is_refused_or_logged(prepared, tmp_path, change, message):
  cfg = _cfg(prepared)
  it = data_lib.make_train_iterator(cfg, batch_size=8, seed=2, vocab_size=VOCAB, process_index=0, process_count=1)
  it.expect(**{'train.batch_size': 8})
  _take(it, 3)
  state, fields = it.get_state(), {'train.batch_size': 8}
  if change == 'seq_len':
    cfg = _cfg(prepared, seq_len=16)
  elif change == 'batch_size':
    fields = {'train.batch_size': 16}
  elif change == 'dataset':
    cfg = _cfg(_write_prepared(str(tmp_path / 'd'), prepared, [[10, 11, 12]] * 9))
  elif change == 'tokenizer':
    other = str(tmp_path / 'other.model')
    tokenizer_lib.train(_docs(80, seed=1), other, vocab_size=300)
    cfg = _cfg(_write_prepared(str(tmp_path / 't'), prepared, _stored(prepared, 'train'), tokenizer=other))
  elif change == 'old_format':
    state = {'parents': {}, 'inputs': 3}  # what the per-process Grain pipeline saved
  with pytest.raises(data_lib.DataError, match=message) as e:
    _resume(cfg, state, **fields)
  assert 'allow_data_change=True' in str(e.value) and '\n' not in str(e.value)
  resumed = _resume(cfg, state, allow=True, **fields)  # allowed: continued, and the notes say how
  rows = resumed.rows
  assert resumed.notes and next(resumed)['inputs'].shape == (8, cfg.seq_len)
  if change == 'seq_len':
    assert rows == 48 and 'at most one row is skipped' in resumed.notes[0]  # token 768 = row 48 of 16
  elif change == 'batch_size':
    assert rows == 24 and 'no row is skipped or repeated' in resumed.notes[0]
  elif change == 'old_format':
    assert rows == 0 and 'starts again at row 0' in resumed.notes[-1]


def test_document_index_is_cached(prepared, tmp_path):
  cfg = _cfg(prepared, cache_dir=str(tmp_path / 'cache'))
  a = _global(cfg, 1, 2)
  (cached,) = os.listdir(tmp_path / 'cache' / 'index')
  assert cached.endswith('.npy')
  assert _equal(_global(cfg, 1, 2), a)  # read back from the cache: the same stream
