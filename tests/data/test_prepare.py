"""`python -m jaxlm.data.prepare`: readers, cleaning, tokenizer training, shards, resume, split, errors."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from array_record.python import array_record_module

from jaxlm.data import prepare as prepare_lib
from jaxlm.data import shards as shards_lib
from jaxlm.data import tokenizer as tokenizer_lib
from tests.conftest import ROOT

VOCAB = 320
TEXTS = [f'Document {i}: The Quick brown fox, number {i * 7919}, jumps over the lazy dog.\n'
         f'    indented line {i}\n' * (1 + i % 4) for i in range(40)]


def _prepare(inputs, out, **kw):
  kw = {'vocab_size': VOCAB, 'workers': 1, 'shard_docs': 8, 'eval_fraction': 0.2, 'progress': False, **kw}
  return prepare_lib.prepare(prepare_lib.expand_inputs([str(i) for i in inputs]), str(out), **kw)


def _write_txt(d, texts):
  os.makedirs(d, exist_ok=True)
  for i, t in enumerate(texts):
    (d / f'{i:03d}.txt').write_text(t)
  return d


def _records(out, split='train') -> list[list[int]]:
  meta = json.load(open(out / 'metadata.json'))
  docs = []
  for shard in meta['splits'][split]['shards']:
    reader = array_record_module.ArrayRecordReader(str(out / shard['file']))
    docs += [np.frombuffer(r, meta['dtype']).tolist() for r in reader.read_all()]
    reader.close()
  return docs


def _all_texts(out) -> list[str]:
  tok = tokenizer_lib.load(str(out / 'tokenizer.model'))
  return [tok.decode(d) for split in ('train', 'eval') for d in _records(out, split)]


def test_reads_txt_jsonl_parquet_directories_and_globs(tmp_path):
  pa = pytest.importorskip('pyarrow')
  pq = pytest.importorskip('pyarrow.parquet')
  _write_txt(tmp_path / 'txt' / 'sub', TEXTS[:10])
  with open(tmp_path / 'a.jsonl', 'w') as f:
    for t in TEXTS[10:20]:
      f.write(json.dumps({'body': t, 'id': 1}) + '\n')
  with gzip.open(tmp_path / 'b.jsonl.gz', 'wt') as f:
    for t in TEXTS[20:25]:
      f.write(json.dumps({'body': t}) + '\n')
  pq.write_table(pa.table({'body': TEXTS[25:40]}), tmp_path / 'c.parquet')
  meta = _prepare([tmp_path / 'txt', tmp_path / '*.jsonl*', tmp_path / 'c.parquet'], tmp_path / 'out',
                  text_field='body')
  assert meta['documents'] == 40
  assert sorted(_all_texts(tmp_path / 'out')) == sorted(TEXTS)  # lossless: case, digits, indentation kept
  assert {s['key']: s['documents'] for s in meta['sources']} == {
      **{f'sub/{i:03d}.txt': 1 for i in range(10)}, str(tmp_path / 'a.jsonl'): 10,
      str(tmp_path / 'b.jsonl.gz'): 5, 'c.parquet': 15}
  assert meta['splits']['eval']['documents'] + meta['splits']['train']['documents'] == 40


def test_txt_documents_can_be_paragraphs_or_lines(tmp_path):
  (tmp_path / 'p.txt').write_text('\n\n'.join(f'para {i} line a\npara {i} line b' for i in range(30)))
  meta = _prepare([tmp_path / 'p.txt'], tmp_path / 'para', txt_docs='paragraphs')
  assert meta['documents'] == 30
  meta = _prepare([tmp_path / 'p.txt'], tmp_path / 'lines', txt_docs='lines')
  assert meta['documents'] == 60


def test_cleaning_counts_what_it_drops_and_repairs(tmp_path):
  d = _write_txt(tmp_path / 'in', TEXTS)
  (d / 'empty.txt').write_text('')
  (d / 'blank.txt').write_text('  \n\t\n')
  (d / 'crlf.txt').write_bytes(b'Windows line one\r\nline two\r\n')
  (d / 'bad_utf8.txt').write_bytes(b'caf\xe9 and \xff bytes')
  with open(d / 'x.jsonl', 'w') as f:
    f.write('{"text": "A good JSON document."}\n{"other": "no text field"}\n{"text": 42}\nnot json at all\n\n'
            '{"text": " \\n "}\n')
  meta = _prepare([d], tmp_path / 'out')
  assert meta['dropped'] == {'bad_json': 1, 'empty': 1, 'empty_files': 2, 'missing_field': 2}
  assert meta['repaired'] == {'invalid_utf8': 1, 'line_endings': 1}
  assert meta['documents'] == len(TEXTS) + 3
  texts = _all_texts(tmp_path / 'out')
  assert 'Windows line one\nline two\n' in texts  # line endings normalised, nothing else
  assert 'caf\ufffd and \ufffd bytes' in texts  # invalid bytes replaced, the document kept
  assert 'A good JSON document.' in texts


def test_tokenizer_splits_digits_falls_back_to_bytes_and_keeps_case(tmp_path):
  _prepare([_write_txt(tmp_path / 'in', TEXTS)], tmp_path / 'out')
  tok = tokenizer_lib.load(str(tmp_path / 'out' / 'tokenizer.model'))
  assert tok.vocab_size <= VOCAB and tok.eos_id == 2
  pieces = [tok.id_to_piece(i) for i in tok.encode('7919')]
  assert [p.strip('\u2581') for p in pieces if p.strip('\u2581')] == ['7', '9', '1', '9']
  for text in ('snowman \u2603 and emoji \U0001F600', 'MiXeD CaSe', '\ttabs\n  and  spaces '):
    assert tok.decode(tok.encode(text)) == text
  assert any(tok.id_to_piece(i).startswith('<0x') for i in tok.encode('\u2603'))  # unseen char → bytes


def test_unigram_model_type(tmp_path):
  meta = _prepare([_write_txt(tmp_path / 'in', TEXTS)], tmp_path / 'out', model_type='unigram')
  assert meta['model_type'] == 'unigram' and meta['vocab_size'] <= VOCAB
  assert sorted(_all_texts(tmp_path / 'out')) == sorted(TEXTS)


def test_tokenizer_is_trained_on_a_bounded_sample(tmp_path, monkeypatch):
  seen = []
  real = tokenizer_lib.train

  def spy(sentences, *args, **kwargs):
    sentences = list(sentences)
    seen.extend(sentences)
    return real(sentences, *args, **kwargs)

  monkeypatch.setattr(tokenizer_lib, 'train', spy)
  texts = [f'line {i} of a long corpus with some words in it\n' * 50 for i in range(100)]  # ~250 kB
  _prepare([_write_txt(tmp_path / 'in', texts)], tmp_path / 'out', sample_mb=0.05)
  taken = sum(len(s) + 1 for s in seen)
  assert 0.04e6 < taken < 0.06e6
  numbers = {int(s.split()[1]) for s in seen}
  assert min(numbers) < 10 and max(numbers) > 80  # spread over the corpus, not its first files


def test_given_tokenizer_is_used_and_its_eos_is_never_stored(tmp_path, monkeypatch):
  model = str(tmp_path / 'given.model')
  tokenizer_lib.train(TEXTS, model, vocab_size=VOCAB)
  # A tokenizer that adds BOS and EOS to everything it encodes: prepare must still store bare documents.
  # The real set-up runs first: it also resets what an earlier chat or preference preparation in this process
  # left behind (pytest-randomly may run one just before).
  init = shards_lib._init_worker

  def init_adding_bos_eos(path, *rest):
    init(path, *rest)
    shards_lib._WORKER_TOKENIZER = tokenizer_lib.SentencePiece(path, add_bos=True, add_eos=True)

  monkeypatch.setattr(shards_lib, '_init_worker', init_adding_bos_eos)
  meta = _prepare([_write_txt(tmp_path / 'in', TEXTS)], tmp_path / 'out', tokenizer=model)
  assert meta['tokenizer_sha256'] == tokenizer_lib.file_sha256(model)
  assert meta['model_type'] == 'given' and meta['vocab_size'] == tokenizer_lib.load(model).vocab_size
  docs = _records(tmp_path / 'out') + _records(tmp_path / 'out', 'eval')
  assert len(docs) == 40 and all(d[0] != 1 and d[-1] != 2 for d in docs)
  assert not any(t in (1, 2) for d in docs for t in d)


def test_parallel_workers_write_the_same_shards(tmp_path):
  d = _write_txt(tmp_path / 'in', TEXTS)
  model = str(tmp_path / 'm.model')
  tokenizer_lib.train(TEXTS, model, vocab_size=VOCAB)
  _prepare([d], tmp_path / 'one', tokenizer=model, workers=1)
  _prepare([d], tmp_path / 'two', tokenizer=model, workers=2)
  for split in ('train', 'eval'):
    assert _records(tmp_path / 'one', split) == _records(tmp_path / 'two', split)


def _shard_mtimes(out) -> dict:
  return {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out) if n.endswith('.arrayrecord')}


def test_rerun_after_losing_a_shard_rewrites_only_that_shard(tmp_path):
  d = _write_txt(tmp_path / 'in', TEXTS)
  first = _prepare([d], tmp_path / 'out')
  before = _shard_mtimes(tmp_path / 'out')
  model_mtime = os.stat(tmp_path / 'out' / 'tokenizer.model').st_mtime_ns
  assert len(before) >= 4
  os.remove(tmp_path / 'out' / 'train-00001.arrayrecord')
  second = _prepare([d], tmp_path / 'out')
  after = _shard_mtimes(tmp_path / 'out')
  assert set(after) == set(before)
  assert [n for n in before if after[n] != before[n]] == ['train-00001.arrayrecord']
  assert os.stat(tmp_path / 'out' / 'tokenizer.model').st_mtime_ns == model_mtime  # not retrained
  assert {k: v for k, v in first.items() if k != 'seconds'} == {k: v for k, v in second.items() if k != 'seconds'}


def test_interrupted_run_resumes_without_redoing_completed_shards(tmp_path, monkeypatch):
  d = _write_txt(tmp_path / 'in', TEXTS)
  real, calls = shards_lib._write_shard, []

  def interrupted_after_two(out, split, index, texts, dtype):
    if len(calls) == 2:
      open(os.path.join(out, f'{split}-{index:05d}.arrayrecord.tmp-999'), 'w').write('half a shard')
      raise KeyboardInterrupt
    calls.append((split, index))
    return real(out, split, index, texts, dtype)

  monkeypatch.setattr(shards_lib, '_write_shard', interrupted_after_two)
  with pytest.raises(KeyboardInterrupt):
    _prepare([d], tmp_path / 'out')
  assert not (tmp_path / 'out' / 'metadata.json').exists()
  done = _shard_mtimes(tmp_path / 'out')
  assert len(done) == 2
  monkeypatch.setattr(shards_lib, '_write_shard', real)
  meta = _prepare([d], tmp_path / 'out')
  after = _shard_mtimes(tmp_path / 'out')
  assert all(after[n] == t for n, t in done.items()) and len(after) > 2
  assert not [n for n in os.listdir(tmp_path / 'out') if '.tmp-' in n]
  assert meta['documents'] == len(TEXTS)


def test_a_shard_whose_first_writer_died_leaves_no_temp_file(tmp_path, monkeypatch):
  # A worker killed -9 mid-shard (its task then runs again elsewhere) leaves `<shard>.tmp-<its pid>` behind.
  d = _write_txt(tmp_path / 'in', TEXTS)
  clean = _prepare([d], tmp_path / 'clean')
  real = shards_lib._write_shard

  def retried(out, split, index, texts, dtype):
    if (split, index) == ('train', 1):
      open(os.path.join(out, f'{split}-{index:05d}.arrayrecord.tmp-999'), 'w').write('half a shard')
    return real(out, split, index, texts, dtype)

  monkeypatch.setattr(shards_lib, '_write_shard', retried)
  meta = _prepare([d], tmp_path / 'out')
  assert sorted(os.listdir(tmp_path / 'out')) == sorted(os.listdir(tmp_path / 'clean'))
  assert meta == clean


def test_rerun_with_other_settings_is_refused(tmp_path):
  d = _write_txt(tmp_path / 'in', TEXTS)
  _prepare([d], tmp_path / 'out')
  with pytest.raises(prepare_lib.PrepareError, match='vocab_size'):
    _prepare([d], tmp_path / 'out', vocab_size=VOCAB + 10)


def test_split_is_a_deterministic_hash_of_the_document_name(tmp_path):
  d = _write_txt(tmp_path / 'in', TEXTS)
  a = _prepare([d], tmp_path / 'a', shard_docs=3)
  b = _prepare([d], tmp_path / 'b', shard_docs=50)
  assert sorted(_all_texts(tmp_path / 'a')) == sorted(_all_texts(tmp_path / 'b'))
  assert a['splits']['eval']['documents'] == b['splits']['eval']['documents'] > 0
  held_out = {f'{i:03d}.txt' for i in range(len(TEXTS)) if prepare_lib.is_eval(f'{i:03d}.txt', 0.2)}
  tok = tokenizer_lib.load(str(tmp_path / 'a' / 'tokenizer.model'))
  assert sorted(tok.decode(x) for x in _records(tmp_path / 'a', 'eval')) == sorted(
      TEXTS[int(k[:3])] for k in held_out)
  assert prepare_lib.is_eval('x', 0.0) is False and prepare_lib.is_eval('x', 0.999999) is True


@pytest.mark.parametrize('setup, message', [
    ('missing', 'neither a file'),
    ('empty_dir', 'contains no .txt'),
    ('parquet_column', "no column 'text'"),
    ('nothing_usable', 'no training documents'),
])
def test_bad_input_gives_a_clear_error(tmp_path, setup, message):
  inputs = [tmp_path / 'in']
  if setup == 'missing':
    inputs = [tmp_path / 'nope.txt']
  elif setup == 'empty_dir':
    os.makedirs(tmp_path / 'in')
  elif setup == 'parquet_column':
    pa = pytest.importorskip('pyarrow')
    pq = pytest.importorskip('pyarrow.parquet')
    os.makedirs(tmp_path / 'in')
    pq.write_table(pa.table({'content': TEXTS}), tmp_path / 'in' / 'x.parquet')
  elif setup == 'nothing_usable':
    os.makedirs(tmp_path / 'in')
    (tmp_path / 'in' / 'x.jsonl').write_text('{"other": "a"}\n' * 5)
    _write_txt(tmp_path / 'in', ['', ' '])
  with pytest.raises(prepare_lib.PrepareError, match=message):
    _prepare(inputs, tmp_path / 'out', tokenizer='' if setup != 'nothing_usable' else _model(tmp_path))


def _model(tmp_path) -> str:
  path = str(tmp_path / 'm.model')
  tokenizer_lib.train(TEXTS, path, vocab_size=VOCAB)
  return path


def test_command_line_runs_shows_progress_and_exits_2_on_bad_input(tmp_path):
  d = _write_txt(tmp_path / 'in', TEXTS)
  cmd = [sys.executable, '-m', 'jaxlm.data.prepare', f'--inputs={d}', f'--out={tmp_path / "out"}', '--vocab_size=320',
         '--workers=2', '--shard_docs=10', '--eval_fraction=0.1']
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert 'prepare 100%' in done.stderr  # the progress bar
  assert json.loads(done.stdout.strip().splitlines()[-1])['documents'] == len(TEXTS)
  assert json.load(open(tmp_path / 'out' / 'metadata.json'))['tokens'] > 0
  bad = subprocess.run(cmd[:3] + [f'--inputs={tmp_path / "missing"}'] + cmd[4:], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
  assert bad.returncode == 2
  assert 'Traceback' not in bad.stderr and 'neither a file' in bad.stderr
