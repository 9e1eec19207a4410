"""A preparation's shards: units counted, shards planned, and each shard written by a task on an engine.

`write` runs on the driver: it counts the documents of every unit (a file, a jsonl line range, a parquet row group),
plans the shards (plan.py), maps `shard_task` over them on an engine (engine.py: this process, a local pool or Ray)
and appends the run to runs.jsonl. `shard_task` runs in a worker process: it tokenizes one shard's documents with
the tokenizer that process loaded once and writes them as ArrayRecord, to `<name>.tmp-<pid>` renamed when complete,
with its stats (`<name>.json`) beside it. A shard whose final name exists is kept, not written again, so a task that
Ray retries, or a rerun after the driver died, writes the same bytes; `remove_temp_files` sweeps the temp files a
killed writer left. Tasks are module-level functions: a pool or Ray pickles them by reference.
"""

import collections
import contextlib
import json
import os
import sys
import time

import numpy as np

from jaxlm.data import chat as chat_lib
from jaxlm.data import format as format_lib
from jaxlm.data import plan as plan_lib
from jaxlm.data import readers
from jaxlm.data import storage
from jaxlm.data import tokenizer as tokenizer_lib
from jaxlm.data.plan import SPLITS

SHARD_SUFFIX = '.arrayrecord'  # a change to what a shard holds, or how, bumps prepare.FORMAT
# group_size:1 puts every record in its own chunk: random access (global shuffle) reads one document, not 64k.
ARRAY_RECORD_OPTIONS = 'group_size:1'


def write(sources, out: str, runner, reading: plan_lib.Reading, dtype: str, worker: tuple, *, shard_docs: int,
          block_bytes: int, progress: bool, engine: str, start: float) -> tuple[dict, collections.Counter, list]:
  """Plans the shards and writes those not written yet, on `runner` (closed here), and appends the run to
  runs.jsonl: (each split's shard stats, the readers' counts, per-source documents)."""
  counts = collections.Counter()
  shards = {split: [] for split in SPLITS}
  where = collections.Counter()  # shards written per node (runs.jsonl)
  try:
    units, offsets, found = _count_units(sources, runner, reading, counts, block_bytes)
    plan = plan_lib.plan_shards([c.split for c in found], shard_docs)
    tasks = [(out, split, index, [(units[p.unit], p, offsets[p.unit]) for p in pieces], reading, dtype, worker,
              runner.where()) for split in SPLITS for index, pieces in enumerate(plan[split])]
    bar = _Progress(len(tasks), progress)
    for _, (stats, written, node) in runner.map(shard_task, tasks):
      shards['train' if stats['file'].startswith('train') else 'eval'].append(stats)
      where[node] += written
      bar.add(stats, written)
  finally:
    runner.close()
  # A worker killed mid-shard (its task ran again elsewhere), or a task of a killed earlier driver that outlived
  # the sweep at the start, leaves its temp file: every shard is final now, so no writer of this run owns one.
  remove_temp_files(out)
  bar.draw(force=True)
  docs_per_source = collections.Counter()
  for u, c in zip(units, found):
    docs_per_source[u.source.key] += c.documents
  per_source = [{'key': s.key, 'path': s.path if storage.is_url(s.path) else os.path.abspath(s.path), 'bytes': s.size,
                 'documents': docs_per_source[s.key]} for s in sources]
  with open(os.path.join(out, 'runs.jsonl'), 'a') as f:  # what varies between runs stays out of metadata.json
    f.write(json.dumps({'engine': engine, 'workers': runner.workers, 'units': len(units),
                        'shards_written': dict(where), 'shards_kept': bar.kept,
                        'seconds': round(time.time() - start, 2)}) + '\n')
  return shards, counts, per_source


def _count_units(sources, runner, reading: plan_lib.Reading, counts: collections.Counter,
                 block_bytes: int) -> tuple[list, list, list]:
  """(the units, from sizes and footers; each one's first line number; each one's documents, read once)."""
  units = [u for s in sources for u in readers.units(s, counts, text_field=reading.text_field,
                                                     block_bytes=block_bytes)]
  ranged = [i for i, u in enumerate(units) if plan_lib.needs_line_count(u)]
  lines = [0] * len(units)
  for i, n in runner.map(readers.line_count, [(units[i],) for i in ranged]):
    lines[ranged[i]] = n
  offsets = plan_lib.line_offsets(units, lines)
  found = [None] * len(units)
  for i, c in runner.map(plan_lib.count_unit, [(u, reading, o) for u, o in zip(units, offsets)]):
    found[i] = c
  for c in found:
    counts.update(c.counts)
  return units, offsets, found


class _Progress:
  """A one-line progress bar on stderr (the driver's), redrawn at most a few times a second."""

  def __init__(self, total_shards: int, enabled: bool):
    self.total, self.enabled, self.start, self.last = max(total_shards, 1), enabled, time.time(), 0.0
    self.bytes = self.docs = self.tokens = self.shards = self.kept = 0

  def add(self, stats: dict, written: bool) -> None:
    self.shards += 1
    self.kept += not written
    if written:  # rates count this run's work; shards kept from an earlier run only advance the bar
      self.bytes, self.docs, self.tokens = (self.bytes + stats['bytes'], self.docs + stats['documents'],
                                            self.tokens + stats['tokens'])
    self.draw()

  def draw(self, force: bool = False) -> None:
    now = time.time()
    if not self.enabled or (not force and now - self.last < 0.25):
      return
    self.last = now
    elapsed, done = max(now - self.start, 1e-9), self.shards / self.total
    sys.stderr.write(f'\rprepare {done:4.0%} |{"#" * int(20 * done):<20}| {self.shards}/{self.total} shards '
                     f'({self.kept} kept) {self.bytes / 1e6 / elapsed:.2f} MB/s {self.docs / elapsed:,.0f} docs/s '
                     f'{self.tokens / elapsed:,.0f} tokens/s ')
    if force:
      sys.stderr.write('\n')
    sys.stderr.flush()


# The worker side. Module-level globals so each worker process (pool or Ray) loads the tokenizer once.
_WORKER_TOKENIZER = None
_WORKER_CHAT = None  # (template, most tokens a record may keep, empty_think, pairs?) for chat / preference
_WORKER_KEY = None


def _init_worker(model_path: str, separator: str | None = None, chat: tuple | None = None) -> None:
  global _WORKER_TOKENIZER, _WORKER_CHAT, _WORKER_KEY
  if _WORKER_KEY != (model_path, separator, chat):
    _WORKER_TOKENIZER = tokenizer_lib.load(model_path, separator=separator)
    _WORKER_CHAT = chat
    _WORKER_KEY = (model_path, separator, chat)


def shard_task(out: str, split: str, index: int, pieces: list, reading: plan_lib.Reading, dtype: str,
               worker: tuple, where: str) -> tuple[dict, bool, str]:
  """Writes shard `index` of `split` from its pieces ((unit, piece, line offset)), unless it exists already:
  (its stats, whether written here, where it ran)."""
  if (done := _shard_done(out, split, index)) is not None:
    return done, False, where
  _init_worker(*worker)
  docs = [d for unit, piece, offset in pieces for d in plan_lib.read_piece(unit, piece, offset, reading)]
  if where.startswith('ray:'):
    import ray  # pylint: disable=g-import-not-at-top  # only inside a Ray task
    where = f'ray:{ray.get_runtime_context().get_node_id()}'
  return _write_shard(out, split, index, docs, dtype), True, where


def _shard_name(split: str, index: int) -> str:
  return f'{split}-{index:05d}{SHARD_SUFFIX}'


def _write_shard(out: str, split: str, index: int, texts: list[str], dtype: str) -> dict:
  """Tokenizes one shard's documents and writes it (temp file, then rename); returns its counts."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  name = _shard_name(split, index)
  final, tmp = os.path.join(out, name), os.path.join(out, f'{name}.tmp-{os.getpid()}')
  chat = {}
  if _WORKER_CHAT is None:
    ids = _WORKER_TOKENIZER.encode_documents(texts)
    records = [np.asarray(doc, dtype=dtype).tobytes() for doc in ids]
    size = sum(len(t.encode()) for t in texts)
  else:  # texts are chat records: conversations, or preference pairs (chat.encode_shard)
    records, ids, chat = chat_lib.encode_shard(_WORKER_TOKENIZER, texts, _WORKER_CHAT, dtype)
    size = sum(len(json.dumps(t)) for t in texts)
  writer = array_record_module.ArrayRecordWriter(tmp, ARRAY_RECORD_OPTIONS)
  for record in records:
    writer.write(record)
  writer.close()
  tokens = sum(len(doc) for doc in ids)
  stats = {'file': name, 'documents': len(ids), 'tokens': tokens, 'bytes': size}
  if chat:
    stats['chat'] = chat
  # Stats first, shard last: a shard's final name existing means its stats exist too.
  format_lib.write_json(os.path.join(out, name.removesuffix(SHARD_SUFFIX) + '.json'), stats, indent=1)
  os.replace(tmp, final)
  return stats


def remove_temp_files(out: str) -> None:
  """Deletes shard temp files (`<name>.tmp-<pid>`): those of an interrupted writer are never complete or read."""
  for name in os.listdir(out):
    if '.tmp-' in name:
      with contextlib.suppress(FileNotFoundError):  # its writer renamed it meanwhile
        os.remove(os.path.join(out, name))


def _shard_done(out: str, split: str, index: int) -> dict | None:
  name = _shard_name(split, index)
  try:
    if os.path.exists(os.path.join(out, name)):
      with open(os.path.join(out, name.removesuffix(SHARD_SUFFIX) + '.json')) as f:
        return json.load(f)
  except (OSError, json.JSONDecodeError):
    pass
  return None
