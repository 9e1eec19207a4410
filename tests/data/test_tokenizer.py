"""Tokenizers real models ship: Hugging Face tokenizer.json and SentencePiece behind one interface, and exactly one
separator between documents whatever the tokenizer's post-processor adds."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from array_record.python import array_record_module

from jaxlm.data import pipeline as data_lib
from jaxlm.data import prepare as prepare_lib
from jaxlm.data import tokenizer as tokenizer_lib
from tests.conftest import ROOT
from tests.data import chat_fixtures
from tests.helpers import load_config

TEXTS = chat_fixtures.corpus(40, seed=3)


def _prepare(tmp_path, **kw):
  inputs = tmp_path / 'docs.jsonl'
  chat_fixtures.write_jsonl(inputs, [{'text': t} for t in TEXTS])
  kw = {'vocab_size': 400, 'workers': 1, 'shard_docs': 8, 'eval_fraction': 0.2, 'progress': False, **kw}
  out = str(tmp_path / 'out')
  return prepare_lib.prepare(prepare_lib.expand_inputs([str(inputs)]), out, **kw), out


def _records(out, split='train') -> list[list[int]]:
  meta = json.load(open(os.path.join(out, 'metadata.json')))
  docs = []
  for shard in meta['splits'][split]['shards']:
    reader = array_record_module.ArrayRecordReader(os.path.join(out, shard['file']))
    docs += [np.frombuffer(r, meta['dtype']).tolist() for r in reader.read_all()]
    reader.close()
  return docs


def _stream_documents(out, separator: int, rows: int = 12) -> list[tuple[int, ...]]:
  """The training stream's inputs split at the separator, checking exactly one separator starts each document."""
  c = load_config('base').data
  c.update(source='prepared', paths=out, seq_len=64, num_workers=0, cross_document_attention=True)
  stream, _ = data_lib.make_train_rows(c, seed=0, vocab_size=400)
  tokens = np.concatenate([stream[k]['inputs'] for k in range(rows)])
  starts = np.flatnonzero(tokens == separator)
  assert starts[0] == 0 and np.all(np.diff(starts) > 1), 'one separator, never two in a row'
  return [tuple(tokens[s + 1:e].tolist()) for s, e in zip(starts[:-1], starts[1:])]


@pytest.mark.parametrize('post', ['bos', 'bos_eos'])
def test_hf_tokenizer_documents_equal_tokenizers_encoding_with_one_separator(tmp_path, post, capfd):
  from tokenizers import Tokenizer
  tok_dir = chat_fixtures.make_tokenizer(str(tmp_path / 'tok'), post=post)
  own = Tokenizer.from_file(os.path.join(tok_dir, 'tokenizer.json'))
  bos = own.token_to_id('<|begin_of_text|>')
  assert own.encode('x').ids[0] == bos  # the post-processor really adds BOS
  meta, out = _prepare(tmp_path, tokenizer=tok_dir)
  end_of_text = own.token_to_id('<|end_of_text|>')
  # An instruct tokenizer (eos_token = <|eot_id|>) still separates documents with its end-of-text token.
  assert (meta['separator'], meta['eos_id']) == ('<|end_of_text|>', end_of_text)
  assert "separated by '<|end_of_text|>'" in capfd.readouterr().err
  assert meta['tokenizer'] == 'tokenizer.json' and meta['tokenizer_kind'] == 'huggingface'
  assert os.path.isfile(os.path.join(out, 'tokenizer_config.json'))
  expected = {tuple(own.encode(t, add_special_tokens=False).ids) for t in TEXTS}
  stored = _records(out) + _records(out, 'eval')
  assert {tuple(d) for d in stored} == expected and len(stored) == len(TEXTS)
  assert not any(bos in d or end_of_text in d for d in stored)
  docs = _stream_documents(out, end_of_text)
  assert len(docs) >= 3 and all(d in expected for d in docs) and not any(bos in d for d in docs)


def test_sentencepiece_stream_has_one_separator_between_documents(tmp_path):
  meta, out = _prepare(tmp_path, vocab_size=320)
  tok = tokenizer_lib.load(os.path.join(out, 'tokenizer.model'))
  assert meta['separator'] == tok.id_to_token(tok.eos_id) and meta['tokenizer_kind'] == 'sentencepiece'
  expected = {tuple(tok.encode(t)) for t in TEXTS}
  docs = _stream_documents(out, tok.separator_id)
  assert len(docs) >= 3 and all(d in expected for d in docs)


def test_bytelevel_bpe_is_trained_by_prepare_and_round_trips(tmp_path):
  meta, out = _prepare(tmp_path, tokenizer_kind='bytelevel_bpe', vocab_size=300)
  tok = tokenizer_lib.load(out)
  assert tok.kind == 'huggingface' and meta['separator'] == '<|endoftext|>' and tok.vocab_size <= 300
  assert sorted(tok.decode(d) for s in ('train', 'eval') for d in _records(out, s)) == sorted(TEXTS)  # lossless


def test_separator_override_and_refusals(tmp_path):
  tok_dir = chat_fixtures.make_tokenizer(str(tmp_path / 'tok'))
  tok = tokenizer_lib.load(tok_dir, separator='<|eot_id|>')
  assert (tok.separator, tok.separator_reason) == ('<|eot_id|>', 'given by --separator')
  with pytest.raises(ValueError, match='not a token'):
    tokenizer_lib.load(tok_dir, separator='<|nope|>')
  meta, out = _prepare(tmp_path, tokenizer=tok_dir, vocab_size=400)
  c = load_config('base').data
  c.update(source='prepared', paths=out, seq_len=64)
  with pytest.raises(data_lib.DataError, match=r'need a 400-entry vocabulary but model.vocab_size=399') as e:
    data_lib.make_train_rows(c, seed=0, vocab_size=399)
  # The model's own tokenizer cannot be retrained smaller: the fix is the model's size, never prepare --vocab_size.
  assert 'set --config.model.vocab_size=400 or more' in str(e.value) and 'import_llama' in str(e.value)
  assert '--vocab_size<=' not in str(e.value)
  done = subprocess.run([sys.executable, '-m', 'jaxlm.data.prepare', f'--inputs={tmp_path / "docs.jsonl"}',
                         f'--out={tmp_path / "o2"}', f'--tokenizer={tok_dir}', '--separator=<|nope|>'],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert done.returncode == 2 and 'Traceback' not in done.stderr
  assert done.stderr.strip().splitlines()[-1].startswith('jaxlm: ') and '<|nope|>' in done.stderr


def test_a_tokenizer_without_any_end_of_text_token_needs_a_separator(tmp_path):
  tokenizer_lib.train_bytelevel_bpe(iter(TEXTS), str(tmp_path), vocab_size=300, end_of_text='<|sep|>')
  config = json.loads((tmp_path / 'tokenizer_config.json').read_text())
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(dict(config, eos_token=None)))
  with pytest.raises(ValueError, match='no end-of-text token.*--separator=TOKEN'):
    tokenizer_lib.load(str(tmp_path))
  assert tokenizer_lib.load(str(tmp_path), separator='<|sep|>').separator_id == 0
