"""Input-pipeline throughput against what the trainer consumes, and `prepare` throughput.

  python bench/data.py [--config=configs/palm_small.py] [--trainer_tokens_per_s=N] [--workers=0,2]

Prepares the embedded stdlib corpus for the config's vocabulary and cap into a fresh temporary cache (timing the
first run exactly as a first `python -m jaxlm.train` sees it: tokenizer training + tokenization), re-tokenizes
it with that tokenizer (tokenization alone), then draws `--batches` training batches of the config's batch and
sequence length through `jaxlm.data.make_train_iterator` for each worker count and reports tokens/s against
`--trainer_tokens_per_s` (target: the pipeline at least 20× faster than the trainer, so it never stalls a step).

`--stream_mb` > 0 also times data.source=stream: the same stdlib text written as jsonl (one document per line,
cut into --stream_files files) is read and tokenized on the fly by the lanes of the config's batch, in this one
process; the table shows its tokens/s and the cores a host needs per 100k tokens/s (tokenizing is CPU-bound and
lanes are independent, so it scales with the processes/cores that hold lanes).
"""

import json
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

from absl import app
from absl import flags
from absl import logging

sys.path.insert(0, str(pathlib.Path(__file__).absolute().parents[1]))
from jaxlm import cli  # noqa: E402
from jaxlm.data import pipeline as data_lib  # noqa: E402
from jaxlm.data import prepare as prepare_lib  # noqa: E402
from jaxlm.data import shards as shards_lib  # noqa: E402
from jaxlm.data import stream as stream_lib  # noqa: E402

_CONFIG = flags.DEFINE_string('config', 'configs/palm_small.py', 'Config file whose data/batch settings to use.')
# Default: over 4× palm_small's measured training throughput on the 2-core CPU (~4.5k tokens/s, cpu_step.py).
_TRAINER = flags.DEFINE_float('trainer_tokens_per_s', 20_000.0, 'Tokens/s the train step consumes.')
_WORKERS = flags.DEFINE_list('workers', ['0', '2'], 'data.num_workers values to measure.')
_BATCHES = flags.DEFINE_integer('batches', 300, 'Timed batches per measurement (after 10 untimed ones).')
_INDEX_MB = flags.DEFINE_integer('index_mb', 256, 'Size of the synthetic prepared corpus whose document index is '
                                  'timed (0 = skip).')
_INDEX_GB = flags.DEFINE_float('index_gb', 10.0, 'Corpus size the cached index build (load + epoch order) is '
                               'timed for, from synthetic document lengths.')
_JSON = flags.DEFINE_string('json', '', 'Also write the results as one JSON object to this file.')
_STREAM_MB = flags.DEFINE_float('stream_mb', 8.0, 'MB of stdlib text streamed as jsonl for data.source=stream '
                                '(0 = skip).')
_STREAM_FILES = flags.DEFINE_integer('stream_files', 64, 'jsonl files the streamed text is cut into (units).')


def _stream_tokens_per_s(d, tmp: str, tokenizer: str, batch_size: int, vocab: int, batches: int) -> dict:
  """data.source=stream on the stdlib text as jsonl: one process holding every lane, tokenizing on the fly."""
  sources = prepare_lib.stdlib_sources(_STREAM_MB.value)
  root = os.path.join(tmp, 'stream')
  os.makedirs(root)
  files = [open(os.path.join(root, f'{i:04d}.jsonl'), 'w') for i in range(_STREAM_FILES.value)]
  for i, s in enumerate(sources):
    with open(s.path, encoding='utf-8', errors='replace') as f:
      files[i % len(files)].write(json.dumps({'text': f.read()}) + '\n')
  for f in files:
    f.close()
  d.update(source='stream', paths=root, tokenizer=tokenizer, stream_lanes=batch_size, num_workers=0)
  it = data_lib.make_train_iterator(d, batch_size=batch_size, seed=0, vocab_size=vocab, process_index=0,
                                    process_count=1)
  start = time.perf_counter()
  first = next(it)  # start-up: unit listing at construction, then the first units opened
  first_s = time.perf_counter() - start
  start = time.perf_counter()
  for _ in range(batches):
    next(it)
  rate = batches * first['inputs'].size / (time.perf_counter() - start)
  return {'stream_mb': _STREAM_MB.value, 'stream_first_batch_s': round(first_s, 2),
          'stream_tokens_per_s': round(rate), 'stream_cores_per_100k_tokens_per_s': round(100_000 / rate, 1)}


def _pipeline_tokens_per_s(data_cfg, batch_size: int, vocab: int, batches: int) -> float:
  it = data_lib.make_train_iterator(data_cfg, batch_size=batch_size, seed=0, vocab_size=vocab, process_index=0,
                                    process_count=1)
  for _ in range(10):  # worker start-up and read-ahead fill are not steady-state throughput
    next(it)
  start = time.perf_counter()
  for _ in range(batches):
    batch = next(it)
  seconds = time.perf_counter() - start
  if data_cfg.num_workers:
    it.close()
  return batches * batch['inputs'].size / seconds


def _index_seconds(tmp: str, mb: int, gb: float) -> dict:
  """The global stream's document index: a first scan of `mb` MB of shards, its cached load, and one epoch's order.

  Synthetic uint16 documents of 200-2000 tokens (mean ~1100, 2.2 kB), 16 shards, written as prepare writes them.
  """
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  meta = {'dtype': 'uint16', 'eos_id': 2, 'bos_id': 1}
  shards, written, docs = [], 0, 0
  for i in range(16):
    path = os.path.join(tmp, f'index-{i:05d}.arrayrecord')
    writer = array_record_module.ArrayRecordWriter(path, shards_lib.ARRAY_RECORD_OPTIONS)
    while written < (i + 1) * mb * 1e6 / 16:
      doc = rng.integers(3, 60000, int(rng.integers(200, 2000)), dtype=np.uint16)
      writer.write(doc.tobytes())
      written, docs = written + doc.nbytes, docs + 1
    writer.close()
    shards.append(path)
  start = time.perf_counter()
  lengths = stream_lib.document_lengths(shards, meta, os.path.join(tmp, 'cache'))
  scan = time.perf_counter() - start
  start = time.perf_counter()
  stream_lib.document_lengths(shards, meta, os.path.join(tmp, 'cache'))
  cached = time.perf_counter() - start
  # The cached build at `gb`: load the lengths (scaled from the load above) + one epoch's permutation and offsets.
  big_docs = int(gb * 1e9 / (written / docs))
  big = stream_lib.DocumentStream(None, rng.integers(200, 2000, big_docs).astype(np.int64), seed=0, seq_len=2048,
                                  eos_id=2, bos_id=1, dtype='uint16')
  start = time.perf_counter()
  big.epoch(0)
  epoch = time.perf_counter() - start
  return {'index_corpus_mb': round(written / 1e6), 'index_documents': docs, 'index_scan_s': round(scan, 2),
          'index_scan_mb_per_s': round(written / 1e6 / scan), 'index_cached_load_s': round(cached, 3),
          'index_big_gb': gb, 'index_big_documents': big_docs,
          'index_big_build_s': round(epoch + cached * big_docs / docs, 2)}


def main(argv) -> None:
  del argv
  cfg = cli.load_file(_CONFIG.value)
  d, vocab, batch_size = cfg.data, cfg.model.vocab_size, cfg.train.batch_size
  results = {'config': cfg.name, 'batch_size': batch_size, 'seq_len': d.seq_len, 'vocab_size': vocab,
             'cpus': os.cpu_count()}
  with tempfile.TemporaryDirectory() as tmp:
    d.cache_dir = os.path.join(tmp, 'cache')
    start = time.perf_counter()
    path = prepare_lib.stdlib_dataset(d, vocab)
    first_run = time.perf_counter() - start
    meta = json.load(open(os.path.join(path, 'metadata.json')))
    mb = sum(s['bytes'] for s in meta['sources']) / 1e6
    start = time.perf_counter()
    prepare_lib.prepare(prepare_lib.stdlib_sources(d.stdlib_max_mb), os.path.join(tmp, 'again'),
                        tokenizer=os.path.join(path, 'tokenizer.model'), eval_fraction=d.eval_fraction,
                        shard_docs=64, progress=False)
    tokenize_only = time.perf_counter() - start
    results.update(corpus_mb=round(mb, 2), tokens=meta['tokens'], first_run_s=round(first_run, 1),
                   prepare_mb_per_s=round(mb / first_run, 2), tokenize_only_mb_per_s=round(mb / tokenize_only, 2))
    for w in _WORKERS.value:
      d.num_workers = int(w)
      results[f'pipeline_tokens_per_s_workers{w}'] = round(
          _pipeline_tokens_per_s(d, batch_size, vocab, _BATCHES.value))

    if _INDEX_MB.value:
      results.update(_index_seconds(tmp, _INDEX_MB.value, _INDEX_GB.value))
    if _STREAM_MB.value:
      results.update(_stream_tokens_per_s(d, tmp, os.path.join(path, 'tokenizer.model'), batch_size, vocab,
                                          min(_BATCHES.value, 100)))

  trainer = _TRAINER.value
  rows = [('stdlib corpus', f'{results["corpus_mb"]:.1f} MB -> {results["tokens"] / 1e6:.2f}M tokens', ''),
          ('first-run prepare (train tokenizer + tokenize)', f'{results["first_run_s"]:.1f} s',
           f'{results["prepare_mb_per_s"]:.2f} MB/s'),
          ('tokenize only (existing tokenizer)', f'{tokenize_only:.1f} s',
           f'{results["tokenize_only_mb_per_s"]:.2f} MB/s'),
          ('trainer consumes (--trainer_tokens_per_s)', f'{trainer:,.0f} tok/s', '1.0x')]
  for w in _WORKERS.value:
    rate = results[f'pipeline_tokens_per_s_workers{w}']
    rows.append((f'input pipeline, num_workers={w} (B={batch_size}, T={d.seq_len})', f'{rate:,.0f} tok/s',
                 f'{rate / trainer:,.1f}x {"OK" if rate >= 20 * trainer else "BELOW 20x TARGET"}'))
  if _INDEX_MB.value:
    rows += [(f'document index, first scan ({results["index_documents"]:,} docs)',
              f'{results["index_corpus_mb"]} MB in {results["index_scan_s"]:.1f} s',
              f'{results["index_scan_mb_per_s"]} MB/s'),
             (f'document index, cached build at {results["index_big_gb"]:g} GB',
              f'{results["index_big_documents"]:,} docs', f'{results["index_big_build_s"]:.2f} s')]
  if _STREAM_MB.value:
    rate = results['stream_tokens_per_s']
    rows += [(f'data.source=stream, 1 process, {batch_size} lanes (B={batch_size}, T={d.seq_len})',
              f'{rate:,.0f} tok/s', f'{rate / trainer:,.1f}x {"OK" if rate >= trainer else "BELOW TRAINER"}'),
             ('stream: first batch (unit listing + first units)', f'{results["stream_first_batch_s"]:.2f} s', ''),
             ('stream: cores per 100k tok/s', f'{results["stream_cores_per_100k_tokens_per_s"]:.1f}', '')]
  width = max(len(r[0]) for r in rows)
  print(f'{"measure":<{width}}  {"value":>26}  {"rate / ratio":>22}')
  for name, value, ratio in rows:
    print(f'{name:<{width}}  {value:>26}  {ratio:>22}')
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump(dict(results, trainer_tokens_per_s=trainer), f)


if __name__ == '__main__':
  logging.set_verbosity(logging.WARNING)
  app.run(main)
