"""Turns text files into training shards: clean, train or load a tokenizer, tokenize, write ArrayRecord.

  python -m jaxlm.data.prepare --inputs=corpus/,extra/*.jsonl --out=data/mycorpus --vocab_size=8192 --workers=8
  python -m jaxlm.data.prepare --format=chat --tokenizer=runs/llama_import --inputs=chats.jsonl --out=data/sft \
      --seq_len=2048

--tokenizer takes a SentencePiece .model, a Hugging Face tokenizer.json, or a directory holding one (with its
tokenizer_config.json); without it a tokenizer is trained (--tokenizer_kind=sentencepiece, the default, or
bytelevel_bpe). Documents are stored without specials; the one separator between documents is the tokenizer's
end-of-text token (never BOS; an instruct tokenizer whose eos_token ends a turn still separates documents with its
end-of-text token), or --separator=TOKEN. prepare prints its choice and metadata.json names it.

--format=chat reads jsonl conversations (`messages`, or `prompt` / `completion`), renders each with the
tokenizer's chat template (or --chat_template=chatml|llama3) and stores its ids with one loss weight per token
(jaxlm/data/chat.py; --empty_think=train also trains the empty <think></think> block a Qwen3-style template
writes before an answer). A conversation longer than --seq_len + 1 tokens is cut at its last assistant turn that fits,
else dropped; bad records are skipped; all of it is counted in metadata.json['chat'].

Inputs are .txt (one document per file, or per paragraph / line with --txt_docs), .jsonl (one JSON object per
line, text in --text_field) and .parquet (a string column named --text_field) files, directories of them
(recursive) and globs; .gz variants of txt/jsonl are read too; any other named file is read as text. The output
directory holds:

  tokenizer.model | tokenizer.json  the tokenizer (trained here, or a copy of --tokenizer's files)
  train-00000.arrayrecord ...     one record per document: its token ids (uint16, or int32 for vocab > 65536),
  eval-00000.arrayrecord ...      without BOS/EOS; the training pipeline inserts the separator itself
  metadata.json                   counts, checksum, sources, split, dropped documents (see `_metadata`)

Each shard is written to a temporary name and renamed when complete (shards.py), so a run that is interrupted and
started again with the same command skips the shards that exist. The held-out split is decided per document by a hash
of its source name, so it never changes between runs or machines.

The embedded default corpus (`stdlib_dataset`) goes through the same `prepare` function.
"""

import collections
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence

import numpy as np
from absl import app
from absl import flags
from absl import logging

from jaxlm import cli
from jaxlm.data import chat as chat_lib
from jaxlm.data import engine as engine_lib
from jaxlm.data import format as format_lib
from jaxlm.data import plan as plan_lib
from jaxlm.data import shards as shards_lib
from jaxlm.data import storage
from jaxlm.data import tokenizer as tokenizer_lib
from jaxlm.data.plan import SPLITS, is_eval
from jaxlm.data.readers import TXT_DOCS, PrepareError, Source, expand_inputs, read_documents

FORMAT = 'jaxlm-prepared-1'  # bump when the shard layout changes; part of the stdlib cache key
DATA_FORMATS = ('text', 'chat', 'preference')  # --format


def token_dtype(vocab_size: int) -> np.dtype:
  """Storage dtype of token ids: 2 bytes while they fit."""
  return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def _sample_lines(sources, counts, *, text_field, txt_docs, eval_fraction, sample_bytes) -> Iterator[str]:
  """An evenly spread sample of training-split lines, about `sample_bytes` long, for the tokenizer trainer."""
  train_bytes = sum(s.size for s in sources) * (1.0 - eval_fraction)  # held-out documents are not sampled
  fraction, acc, taken = min(1.0, sample_bytes / max(train_bytes, 1.0)), 0.0, 0
  for source in sources:
    for key, text in read_documents(source, counts, text_field=text_field, txt_docs=txt_docs):
      if is_eval(key, eval_fraction):
        continue
      for line in text.split('\n'):
        acc += fraction  # every (1/fraction)-th line, spread over the whole corpus rather than its head
        if acc >= 1.0 and line.strip():
          acc -= 1.0
          taken += len(line) + 1
          yield line
        if taken >= sample_bytes:
          return


def _write_json(path: str, obj) -> None:
  format_lib.write_json(path, obj, indent=1)


def _plan(sources, *, vocab_size, model_type, tokenizer_sha, text_field, txt_docs, eval_fraction,
          shard_docs, sample_mb, max_sentences, seed, tokenizer_kind='sentencepiece', separator='',
          data_format='text', chat_template='', seq_len=0, empty_think='mask') -> dict:
  """Every setting that decides the output; a re-run into the same directory must match it."""
  # empty_think is listed only when it is not the default, so a preparation begun before it existed resumes.
  return {**({'empty_think': empty_think} if empty_think != 'mask' else {}),
          'format': FORMAT, 'sources': [[s.key, s.size, _mtime(s)] for s in sources], 'vocab_size': vocab_size,
          'model_type': model_type, 'tokenizer_sha256': tokenizer_sha, 'text_field': text_field,
          'txt_docs': txt_docs, 'eval_fraction': eval_fraction, 'shard_docs': shard_docs,
          'sample_mb': sample_mb, 'max_sentences': max_sentences, 'seed': seed, 'tokenizer_kind': tokenizer_kind,
          'separator': separator, 'data_format': data_format, 'chat_template': chat_template, 'seq_len': seq_len}


def _mtime(source: Source) -> int | str:
  if source.version:  # a bucket object: the store's hash of it
    return source.version
  try:
    return os.stat(source.path).st_mtime_ns
  except OSError:
    return 0


def _changed_input(old: list, new: list) -> str | None:
  """The first input that differs between two plans' sources, as a phrase naming it."""
  old_by_key, new_by_key = {s[0]: s for s in old}, {s[0]: s for s in new}
  for s in new:
    if s[0] not in old_by_key:
      return f'input {s[0]} was added'
    if old_by_key[s[0]] != s:
      return f'input {s[0]} changed (size or modification time)'
  for s in old:
    if s[0] not in new_by_key:
      return f'input {s[0]} is gone'
  return None if old == new else 'the order of the inputs changed'


def _install_tokenizer(tokenizer: str, out: str) -> str:
  """Copies the given tokenizer's files into `out` (once); returns the main file's path there."""
  given = tokenizer_lib.load(tokenizer)
  for path in given.files:
    target = os.path.join(out, 'tokenizer.model' if given.kind == 'sentencepiece' else os.path.basename(path))
    if not os.path.exists(target):
      with format_lib.replacing(target) as tmp:
        shutil.copyfile(path, tmp)
  return os.path.join(out, 'tokenizer.model' if given.kind == 'sentencepiece' else 'tokenizer.json')


def prepare(sources: Sequence[Source], out: str, *, vocab_size: int = 8192, model_type: str = 'bpe',
            tokenizer: str = '', text_field: str = 'text', txt_docs: str = 'file', eval_fraction: float = 0.02,
            shard_docs: int = 10_000, workers: int = 0, sample_mb: float = 100.0,
            max_sentences: int = 1_000_000, seed: int = 0, progress: bool = True,
            tokenizer_kind: str = 'sentencepiece', separator: str = '', data_format: str = 'text',
            chat_template: str = '', seq_len: int = 0, empty_think: str = 'mask', engine: str = 'local', ray_address: str = '',
            block_bytes: int = 64 << 20) -> dict:
  """Prepares `sources` into `out` (resuming a previous run there); returns the metadata it wrote.

  `engine` (local: this process or a pool of `workers`; ray: tasks on the cluster at `ray_address`) and
  `block_bytes` (the size of jsonl ranges) change where the work runs, never the bytes written.
  """
  tokenizer = _check_settings(tokenizer, engine=engine, tokenizer_kind=tokenizer_kind, data_format=data_format,
                              empty_think=empty_think, seq_len=seq_len, txt_docs=txt_docs, model_type=model_type,
                              eval_fraction=eval_fraction, shard_docs=shard_docs)
  start = time.time()
  os.makedirs(out, exist_ok=True)
  settings = _plan(sources, vocab_size=vocab_size, model_type=model_type,
                   tokenizer_sha=tokenizer_lib.file_sha256(tokenizer) if tokenizer else None,
                   text_field=text_field, txt_docs=txt_docs, eval_fraction=eval_fraction, shard_docs=shard_docs,
                   sample_mb=sample_mb, max_sentences=max_sentences, seed=seed, tokenizer_kind=tokenizer_kind,
                   separator=separator, data_format=data_format, chat_template=chat_template, seq_len=seq_len,
                   empty_think=empty_think)
  _start_or_resume(out, settings)
  model_path, tok = _make_tokenizer(sources, out, tokenizer, settings)
  chat = _chat_settings(tok, tokenizer, data_format=data_format, chat_template=chat_template, seq_len=seq_len,
                        empty_think=empty_think)
  reading = plan_lib.Reading(text_field=text_field, txt_docs=txt_docs, data_format=data_format,
                             eval_fraction=eval_fraction)
  worker = (model_path, separator or None, chat)
  runner = engine_lib.make(engine, workers=workers, ray_address=ray_address)
  shards, counts, per_source = shards_lib.write(sources, out, runner, reading, token_dtype(tok.vocab_size).name,
                                                worker, shard_docs=shard_docs, block_bytes=block_bytes,
                                                progress=progress, engine=engine, start=start)
  meta = _metadata(tok, shards, per_source, counts, settings)
  if chat is not None:  # the template rendered with: the tokenizer's own lives outside its tokenizer.json's sha256
    meta['chat_template_sha256'] = hashlib.sha256(chat[0].encode()).hexdigest()
  _check_kept(meta, data_format=data_format, seq_len=seq_len, eval_fraction=eval_fraction)
  _write_json(os.path.join(out, 'metadata.json'), meta)
  logging.info('prepare: %s: %d documents, %d tokens (%d held out), dropped %s, in %.1fs', out,
               meta['documents'], meta['tokens'], meta['splits']['eval']['documents'], meta['dropped'],
               time.time() - start)
  return meta


def _check_settings(tokenizer: str, *, engine, tokenizer_kind, data_format, empty_think, seq_len, txt_docs,
                    model_type, eval_fraction, shard_docs) -> str:
  """Refuses (PrepareError) settings prepare cannot use, before any work; returns --tokenizer's main file."""
  if engine not in engine_lib.ENGINES:
    raise PrepareError(f'engine={engine!r} is unknown; use one of {", ".join(engine_lib.ENGINES)}.')
  if tokenizer_kind not in tokenizer_lib.KINDS:
    raise PrepareError(f'tokenizer_kind={tokenizer_kind!r} is unknown; use one of {", ".join(tokenizer_lib.KINDS)}.')
  if data_format not in DATA_FORMATS:
    raise PrepareError(f'format={data_format!r} is unknown; use one of {", ".join(DATA_FORMATS)}.')
  if data_format in ('chat', 'preference') and not tokenizer:
    raise PrepareError(f'--format={data_format} needs the model\'s tokenizer: pass --tokenizer=DIR (e.g. the directory '
                       'jaxlm.hf.import_llama wrote), whose chat template and special tokens the model knows.')
  if empty_think not in chat_lib.EMPTY_THINK:
    raise PrepareError(f'empty_think={empty_think!r} is unknown; use one of {", ".join(chat_lib.EMPTY_THINK)}.')
  if seq_len < 0:
    raise PrepareError(f'seq_len={seq_len} must be >= 0 (0 = keep conversations whole).')
  if txt_docs not in TXT_DOCS:
    raise PrepareError(f'txt_docs={txt_docs!r} is unknown; use one of {", ".join(TXT_DOCS)}.')
  if model_type not in tokenizer_lib.MODEL_TYPES:
    raise PrepareError(f'model_type={model_type!r} is unknown; use one of {", ".join(tokenizer_lib.MODEL_TYPES)}.')
  if not 0.0 <= eval_fraction < 1.0:
    raise PrepareError(f'eval_fraction={eval_fraction} must be in [0, 1).')
  if shard_docs < 1:
    raise PrepareError(f'shard_docs={shard_docs} must be >= 1.')
  if tokenizer and not os.path.exists(tokenizer):
    raise PrepareError(f'--tokenizer={tokenizer} does not exist; give a SentencePiece .model, a tokenizer.json, '
                       f'or a directory holding one.')
  if tokenizer:
    try:
      tokenizer = tokenizer_lib.main_file(tokenizer)
    except ValueError as e:
      raise PrepareError(f'--tokenizer: {e}') from e
  if engine == 'ray' and importlib.util.find_spec('ray') is None:
    raise PrepareError('--engine=ray needs Ray; pip install "jaxlm[ray]", or use --engine=local.')
  return tokenizer


def _start_or_resume(out: str, settings: dict) -> None:
  """Records the settings in out/plan.json, or checks that an earlier run there had the same; sweeps temp files."""
  plan_path = os.path.join(out, 'plan.json')
  if os.path.exists(plan_path):
    with open(plan_path) as f:
      old = json.load(f)
    if old != settings:
      if old.get('sources') != settings['sources'] and (what := _changed_input(old.get('sources', []),
                                                                               settings['sources'])):
        raise PrepareError(f'{what} since {out} was started; use a new --out directory, or delete {out} to '
                           f'start over.')
      changed = sorted(k for k in settings if old.get(k) != settings[k])
      raise PrepareError(f'{out} holds a preparation with different settings ({", ".join(changed)} changed); '
                         f'use a new --out directory, or delete {out} to start over.')
    logging.info('prepare: resuming in %s (completed shards are kept)', out)
  else:
    _write_json(plan_path, settings)
  shards_lib.remove_temp_files(out)


def _make_tokenizer(sources, out: str, tokenizer: str, settings: dict) -> tuple[str, tokenizer_lib.Tokenizer]:
  """(its main file in `out`, the tokenizer): --tokenizer's copied there, one trained on a sample of the training
  split, or the one an earlier run there trained; prints which token separates documents."""
  s = settings
  model_path = os.path.join(out, 'tokenizer.json' if s['tokenizer_kind'] == 'bytelevel_bpe' else 'tokenizer.model')
  try:
    if tokenizer:
      model_path = _install_tokenizer(tokenizer, out)
    elif not os.path.exists(model_path):
      t0 = time.time()
      lines = _sample_lines(sources, _new_counts(), text_field=s['text_field'], txt_docs=s['txt_docs'],
                            eval_fraction=s['eval_fraction'], sample_bytes=int(s['sample_mb'] * 1e6))
      if s['tokenizer_kind'] == 'bytelevel_bpe':
        tokenizer_lib.train_bytelevel_bpe(lines, out, vocab_size=s['vocab_size'], max_sentences=s['max_sentences'])
      else:
        # The driver's cores, not --workers: the model file records its thread count, and no output byte may
        # depend on the engine or the worker count.
        tokenizer_lib.train(lines, model_path, vocab_size=s['vocab_size'], model_type=s['model_type'],
                            max_sentences=s['max_sentences'], num_threads=os.cpu_count() or 1, seed=s['seed'])
      logging.info('prepare: trained a %s tokenizer (vocab %d) in %.1fs', s['tokenizer_kind'], s['vocab_size'],
                   time.time() - t0)
    tok = tokenizer_lib.load(model_path, separator=s['separator'] or None)
  except ValueError as e:
    raise PrepareError(str(e).rstrip('.')) from e
  # Printed, not logged: which token ends a document decides what the model learns; never leave it implicit.
  print(f'prepare: documents are separated by {tok.separator!r} (id {tok.separator_id}): {tok.separator_reason}',
        file=sys.stderr, flush=True)
  return model_path, tok


def _chat_settings(tok, tokenizer: str, *, data_format: str, chat_template: str, seq_len: int,
                   empty_think: str) -> tuple | None:
  """The workers' chat settings (template, most ids a record may keep or 0, empty_think, pairs?); None for text."""
  if data_format not in ('chat', 'preference'):
    return None
  try:
    template = chat_lib.template_of(tok, chat_template or None)
  except ValueError as e:
    raise PrepareError(str(e)) from e
  if template is None:
    raise PrepareError(f'the tokenizer {tokenizer} has no chat_template; pass --chat_template=chatml or llama3.')
  # A row of T tokens holds a conversation (or a pair, packed as one unit) of T + 1 ids.
  return (template, seq_len + 1 if seq_len else 0, empty_think, data_format == 'preference')


def _check_kept(meta: dict, *, data_format: str, seq_len: int, eval_fraction: float) -> None:
  """Refuses a preparation that kept no training document; prints what chat data kept and warns of no held-out."""
  if data_format == 'preference':
    c = meta['chat']
    bad = sum(c['skipped'].values())
    if meta['documents'] == 0:
      raise PrepareError(f'none of the {bad + c["dropped_too_long"]} preference records could be used (skipped: '
                         f'{c["skipped"]}, too long for --seq_len={seq_len}: {c["dropped_too_long"]}); records need '
                         f'{{prompt, chosen, rejected}} or {{chosen, rejected}} message lists with one prompt')
    print(f'prepare: {meta["documents"]} pairs kept, {c["dropped_too_long"]} dropped as longer than '
          f'--seq_len={seq_len} together, {bad} bad records skipped {c["skipped"]}', file=sys.stderr, flush=True)
  elif data_format == 'chat':
    c = meta['chat']
    bad = sum(c['skipped'].values())
    if meta['documents'] == 0:
      raise PrepareError(f'none of the {bad + c["dropped_too_long"]} chat records could be used (skipped: '
                         f'{c["skipped"]}, too long: {c["dropped_too_long"]}); records need `messages` '
                         f'(roles system/user/assistant, at least one assistant turn) or `prompt` + `completion`')
    print(f'prepare: {meta["documents"]} conversations kept ({c["truncated"]} truncated at a turn boundary), '
          f'{c["dropped_too_long"]} dropped as longer than --seq_len={seq_len}, {bad} bad records skipped '
          f'{c["skipped"]}', file=sys.stderr, flush=True)
  if meta['splits']['train']['documents'] == 0:
    raise PrepareError(f'no training documents were found in the inputs (skipped: {meta["dropped"]}); check '
                       f'--inputs, --text_field and --eval_fraction.')
  if eval_fraction > 0 and meta['splits']['eval']['documents'] == 0:
    logging.warning('prepare: no document fell into the held-out split (eval_fraction=%g of %d documents); '
                    'evaluation will fail on this data. Use more documents (e.g. --txt_docs=paragraphs).',
                    eval_fraction, meta['documents'])


def _new_counts() -> collections.Counter:
  return collections.Counter()


def _metadata(tok, shards, per_source, counts, plan) -> dict:
  """metadata.json: a function of the inputs and settings only (timings go to runs.jsonl)."""
  splits = {}
  for split in SPLITS:
    listed = sorted(shards[split], key=lambda s: s['file'])
    splits[split] = {'documents': sum(s['documents'] for s in listed), 'tokens': sum(s['tokens'] for s in listed),
                     'shards': listed}
  return {
      'format': FORMAT,
      'documents': splits['train']['documents'] + splits['eval']['documents'],
      'tokens': splits['train']['tokens'] + splits['eval']['tokens'],  # without the separators data.py adds
      'vocab_size': tok.vocab_size,  # every id the tokenizer can produce, added tokens included
      'eos_id': tok.separator_id,  # the one token the pipeline puts between documents (named in `separator`)
      'bos_id': tok.bos_id,
      'separator': tok.separator,
      'separator_reason': tok.separator_reason,
      'tokenizer_eos_id': tok.eos_id,  # the tokenizer's own eos_token (an instruct model's end of turn)
      'dtype': token_dtype(tok.vocab_size).name,
      'tokenizer': os.path.basename(tok.path),
      'tokenizer_kind': tok.kind,
      'tokenizer_sha256': tok.sha256,
      'content': plan['data_format'],  # text: documents; chat: conversations with per-token loss weights
      **({'chat': _chat_counts(shards)} if plan['data_format'] in ('chat', 'preference') else {}),
      'model_type': plan['model_type'] if plan['tokenizer_sha256'] is None else 'given',
      'eval_fraction': plan['eval_fraction'],
      'split_rule': 'eval if sha256(document key)[:8] as big-endian uint64 < eval_fraction * 2**64',
      'splits': splits,
      'dropped': {k.removeprefix('dropped_'): v for k, v in sorted(counts.items()) if k.startswith('dropped_')},
      'repaired': {k.removeprefix('repaired_'): v for k, v in sorted(counts.items()) if k.startswith('repaired_')},
      'sources': per_source,
      'settings': {k: v for k, v in plan.items() if k != 'sources'},
  }


def _chat_counts(shards) -> dict:
  """Totals of the chat shards' counts: kept, truncated, dropped as too long, skipped by reason."""
  total = collections.Counter()
  for split in SPLITS:
    for s in shards[split]:
      for k, v in s.get('chat', {}).items():
        total[k] = max(total[k], v) if k == 'longest' else total[k] + v
  return {'conversations': total['kept'] + total['truncated'], 'truncated': total['truncated'],
          'dropped_too_long': total['dropped_too_long'], 'longest': total['longest'],
          'weighted_tokens': total['weighted_tokens'],
          'skipped': {k.removeprefix('bad_'): v for k, v in sorted(total.items()) if k.startswith('bad_')}}


def stdlib_sources(max_mb: float) -> list[Source]:
  """This interpreter's standard-library .py files, sorted, without site-packages, up to `max_mb` MB."""
  root = sysconfig.get_paths()['stdlib']
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in ('site-packages', 'dist-packages', '__pycache__')]
    found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith('.py'))
  sources, total, cap = [], 0, int(max_mb * 1e6)
  for path in sorted(found):
    size = os.path.getsize(path)
    if total + size > cap:
      break
    total += size
    sources.append(Source(path=path, key=os.path.relpath(path, root).replace(os.sep, '/'), size=size))
  return sources


@contextlib.contextmanager
def _file_lock(path: str):
  with open(path, 'a') as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      logging.info('prepare: another process is preparing %s; waiting for it', path.removesuffix('.lock'))
      fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def stdlib_dataset(data_cfg, vocab_size: int, *, workers: int = 0) -> str:
  """Directory of the prepared stdlib corpus for this Python, vocab and cap; prepares it on first use."""
  v = sys.version_info
  root = os.path.expanduser(data_cfg.cache_dir)
  key = (f'stdlib-py{v.major}.{v.minor}.{v.micro}-vocab{vocab_size}-{data_cfg.stdlib_max_mb:g}mb'
         f'-eval{data_cfg.eval_fraction:g}-{FORMAT}')
  final = os.path.join(root, key)
  if os.path.exists(os.path.join(final, 'metadata.json')):
    return final
  os.makedirs(root, exist_ok=True)
  # Two processes (hosts of a multi-process test on one machine) may start together: the lock makes one of
  # them prepare while the other waits; the rename publishes a complete directory or nothing.
  with _file_lock(os.path.join(root, key + '.lock')):
    if os.path.exists(os.path.join(final, 'metadata.json')):
      return final
    start = time.time()
    sources = stdlib_sources(data_cfg.stdlib_max_mb)
    # Printed, not logged: the trainer shows only warnings, and a first run should say why it pauses.
    print(f'data: preparing the stdlib corpus ({len(sources)} files, {sum(s.size for s in sources) / 1e6:.1f} MB, '
          f'vocab {vocab_size}) into {final}', file=sys.stderr, flush=True)
    partial = final + '.partial'  # fixed name: an interrupted first run resumes here
    prepare(sources, partial, vocab_size=vocab_size, model_type='bpe', eval_fraction=data_cfg.eval_fraction,
            shard_docs=64, workers=workers, sample_mb=100.0)
    os.rename(partial, final)
    print(f'data: stdlib corpus ready in {time.time() - start:.1f}s (reused from now on)', file=sys.stderr,
          flush=True)
  return final


FLAGS = flags.FLAGS


def _define_flags() -> None:
  # Defined only when run as a program: data.py imports this module into the trainer, whose flags they would
  # otherwise collide with.
  flags.DEFINE_list('inputs', [], 'Files, directories and globs of .txt / .jsonl / .parquet, comma-separated.')
  flags.DEFINE_string('out', '', 'Output directory (created; an interrupted run there is resumed), or a gs:// or '
                      's3:// URL: prepared under --cache_dir, then uploaded with metadata.json last.')
  flags.DEFINE_string('cache_dir', '~/.cache/jaxlm', 'Where a bucket --out is prepared before it is uploaded.')
  flags.DEFINE_integer('vocab_size', 8192, 'SentencePiece vocabulary size to train (<= the model vocab_size).')
  flags.DEFINE_enum('model_type', 'bpe', tokenizer_lib.MODEL_TYPES, 'SentencePiece algorithm to train.')
  flags.DEFINE_string('tokenizer', '', 'Use this tokenizer instead of training one: a SentencePiece .model, a '
                      'Hugging Face tokenizer.json, or a directory with one (and its tokenizer_config.json).')
  flags.DEFINE_enum('tokenizer_kind', 'sentencepiece', tokenizer_lib.KINDS, 'Kind of tokenizer to train when '
                    '--tokenizer is not given.')
  flags.DEFINE_string('separator', '', 'Token put between documents (default: the tokenizer\'s end-of-text token).')
  flags.DEFINE_enum('format', 'text', DATA_FORMATS, 'text: documents; chat: jsonl conversations (messages or '
                    'prompt/completion) with the prompt masked out of the loss.')
  flags.DEFINE_string('chat_template', '', 'chat: a built-in template (chatml, llama3) instead of the tokenizer\'s.')
  flags.DEFINE_enum('empty_think', 'mask', chat_lib.EMPTY_THINK, 'chat: an empty <think></think> block the '
                    'template writes before an answer (Qwen3) gets weight 0 (mask) or is trained (train).')
  flags.DEFINE_integer('seq_len', 0, 'chat: the training seq_len; longer conversations are cut at a turn boundary '
                       'or dropped (0 = keep whole).')
  flags.DEFINE_string('text_field', 'text', 'Field (jsonl) or column (parquet) holding the document text.')
  flags.DEFINE_enum('txt_docs', 'file', TXT_DOCS, 'What one document is in a .txt file.')
  flags.DEFINE_float('eval_fraction', 0.02, 'Fraction of documents held out for evaluation (by a hash of their name).')
  flags.DEFINE_integer('shard_docs', 10_000, 'Documents per ArrayRecord shard.')
  flags.DEFINE_integer('workers', 0, 'Tokenizer processes (0 = one per CPU core; with --engine=ray, tasks in '
                       'flight / 2, 0 = the cluster\'s CPUs).')
  flags.DEFINE_enum('engine', 'local', engine_lib.ENGINES, 'Where tasks run: local (this machine) or ray (a Ray '
                    'cluster, `jaxlm[ray]`). The output is the same byte for byte.')
  flags.DEFINE_string('ray_address', '', '--engine=ray: the cluster (host:port of the head); empty = start Ray '
                      'on this machine.')
  flags.DEFINE_float('block_mb', 64, 'Size of the line ranges an uncompressed .jsonl is cut into (parquet is '
                       'cut at row groups); does not change the output.')
  flags.DEFINE_float('sample_mb', 100.0, 'MB of training text sampled (evenly across the corpus) for the tokenizer.')
  flags.DEFINE_integer('max_sentences', 1_000_000, 'Most lines the SentencePiece trainer keeps from that sample.')
  flags.DEFINE_integer('seed', 0, 'Seed of the tokenizer trainer.')


def upload_prepared(local: str, url: str) -> None:
  """Uploads a prepared directory, metadata.json last: a reader that finds it finds every shard in place."""
  storage.remove(storage.join(url, 'metadata.json'))  # a re-upload is incomplete until the marker is back
  for name in sorted(os.listdir(local)):
    if name not in ('metadata.json', 'plan.json'):
      storage.upload(os.path.join(local, name), storage.join(url, name))
  storage.upload(os.path.join(local, 'metadata.json'), storage.join(url, 'metadata.json'))


def main(argv: Sequence[str]) -> None:
  """`python -m jaxlm.data.prepare`: exit 0 when done, 2 on input or settings it cannot use."""
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not FLAGS.inputs or not FLAGS.out:
    raise PrepareError('--inputs and --out are required; e.g. --inputs=corpus/,more/*.jsonl --out=data/mine')
  out = FLAGS.out
  if storage.is_url(out):  # prepared here, then uploaded (metadata.json last: the dataset's commit marker)
    storage.check(out, what='--out')
    out = os.path.join(os.path.expanduser(FLAGS.cache_dir), 'upload', hashlib.sha256(out.encode()).hexdigest()[:16])
  try:
    meta = prepare(expand_inputs(FLAGS.inputs), out, vocab_size=FLAGS.vocab_size,
                   model_type=FLAGS.model_type, tokenizer=FLAGS.tokenizer, text_field=FLAGS.text_field,
                   txt_docs=FLAGS.txt_docs, eval_fraction=FLAGS.eval_fraction, shard_docs=FLAGS.shard_docs,
                   workers=FLAGS.workers, sample_mb=FLAGS.sample_mb, max_sentences=FLAGS.max_sentences,
                   seed=FLAGS.seed, tokenizer_kind=FLAGS.tokenizer_kind, separator=FLAGS.separator,
                   data_format=FLAGS.format, chat_template=FLAGS.chat_template, seq_len=FLAGS.seq_len,
                   empty_think=FLAGS.empty_think, engine=FLAGS.engine, ray_address=FLAGS.ray_address,
                   block_bytes=int(FLAGS.block_mb * 2**20))
  except KeyboardInterrupt:
    print('\nprepare: interrupted; run the same command again to resume (completed shards are kept).',
          file=sys.stderr)
    sys.exit(130)
  if out != FLAGS.out:
    upload_prepared(out, FLAGS.out)
  print(json.dumps({k: meta[k] for k in ('documents', 'tokens', 'vocab_size', 'dropped')}))


def console() -> None:
  """The command line (also the console script in pyproject.toml)."""
  cli.run(main, define=_define_flags)


if __name__ == '__main__':
  console()
