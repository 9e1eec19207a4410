"""Reads users' text files into documents: finds inputs, decodes and cleans them, counts what it drops.

Inputs are .txt (one document per file, or per paragraph / line), .jsonl (text in a configurable field) and
.parquet (a string column) files, directories of them (recursive) and globs; .gz variants of txt/jsonl are read
too. Cleaning normalises line endings, a leading byte-order mark and invalid UTF-8 (kept as U+FFFD, counted) and
drops empty documents (counted); it never lower-cases. `jaxlm.data.prepare` turns the documents into shards.
"""

import contextlib
import dataclasses
import glob
import gzip
import json
import os
from collections.abc import Iterator, Sequence

from absl import logging

from jaxlm import errors
from jaxlm.data import storage

TXT_DOCS = ('file', 'paragraphs', 'lines')


class PrepareError(errors.DataError):
  """Input or settings that prepare cannot use; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Source:
  """One input file. `key` is its stable name (path relative to the input root): hashed for the split.
  `version`: on a bucket, the store's hash of the object (what says it changed; a local file has its mtime)."""
  path: str
  key: str
  size: int
  version: str = ''


def _kind(path: str) -> str:
  name = path.lower().removesuffix('.gz')
  if name.endswith('.jsonl'):
    return 'jsonl'
  if name.endswith('.parquet'):
    return 'parquet'
  return 'txt'


def _is_data_file(path: str) -> bool:
  name = path.lower().removesuffix('.gz')
  return name.endswith(('.txt', '.jsonl')) or path.lower().endswith('.parquet')


def expand_inputs(specs: Sequence[str]) -> list[Source]:
  """Files named by `specs` (files, directories searched recursively for txt/jsonl/parquet, globs), in order."""
  sources, seen = [], set()
  for spec in specs:
    spec = os.path.expanduser(spec.strip())
    if not spec:
      continue
    if storage.is_url(spec):  # read in place: ranged reads of each object (storage.open_file)
      storage.check(spec, what='--inputs')
      found = [o for o in storage.list_objects(spec) if _is_data_file(o[0])]
      if not found:
        raise PrepareError(f'input {spec!r} holds no .txt, .jsonl or .parquet objects.')
      for url, key, size, version in found:
        if url not in seen:
          seen.add(url)
          sources.append(Source(path=url, key=key, size=size, version=version))
      continue
    if os.path.isdir(spec):
      found = [(p, os.path.relpath(p, spec)) for p in glob.glob(os.path.join(spec, '**', '*'), recursive=True)
               if os.path.isfile(p) and _is_data_file(p)]
    elif glob.has_magic(spec):
      found = [(p, p) for p in glob.glob(spec, recursive=True) if os.path.isfile(p)]
    elif os.path.isfile(spec):
      found = [(spec, os.path.basename(spec))]
    else:
      raise PrepareError(f'input {spec!r} is neither a file, a directory nor a glob that matches anything.')
    if not found:
      raise PrepareError(f'input {spec!r} contains no .txt, .jsonl or .parquet files.')
    for path, key in sorted(found, key=lambda x: x[1]):
      real = os.path.realpath(path)
      if real not in seen:  # the same file named twice (a dir and a glob) is read once
        seen.add(real)
        sources.append(Source(path=path, key=key.replace(os.sep, '/'), size=os.path.getsize(path)))
  if not sources:
    raise PrepareError('no input files: pass --inputs=FILE_DIR_OR_GLOB[,...]')
  return sources


@contextlib.contextmanager
def _open(path: str):
  with storage.open_file(path) as f:
    if path.lower().endswith('.gz'):
      with gzip.open(f, 'rb') as g:
        yield g
    else:
      yield f


def _normalise_newlines(text: str, counts: dict) -> str:
  if '\r' in text:  # Windows and old-Mac line endings; the tokenizer then sees one kind of newline
    counts['repaired_line_endings'] += 1
    text = text.replace('\r\n', '\n').replace('\r', '\n')
  return text


def _clean(text: str, counts: dict) -> str | None:
  """Normalises line endings and a leading byte-order mark; None (counted) for empty documents."""
  text = _normalise_newlines(text, counts).removeprefix('\ufeff')
  if not text.strip():
    counts['dropped_empty'] += 1
    return None
  return text


def _decode(raw: bytes, counts: dict) -> str:
  try:
    return raw.decode('utf-8')
  except UnicodeDecodeError:
    # Keep the document: invalid byte sequences become U+FFFD, and the count says how many documents had them.
    counts['repaired_invalid_utf8'] += 1
    return raw.decode('utf-8', errors='replace')


def _warn_skip(counts: dict, what: str, where: str) -> None:
  counts[what] += 1
  if counts[what] <= 5:  # log the first few of each kind, count all of them
    # INFO, not WARNING: an empty __init__.py in the stdlib corpus is routine; the totals are in metadata.json.
    logging.info('prepare: skipping %s (%s)%s', where, what, '; further ones are only counted'
                 if counts[what] == 5 else '')


@dataclasses.dataclass(frozen=True)
class Unit:
  """A piece of one input that a worker reads alone: a parquet row group, a jsonl byte range, or a whole file.

  Enumerated from file sizes and parquet footers only. A jsonl range [start, end) holds the lines that begin in
  it (the convention of Hadoop's line reader), so ranges cut anywhere and still give every line once.
  """
  source: Source
  start: int = 0  # jsonl: first byte; parquet: row group
  end: int = -1  # jsonl: end byte (-1 = end of file); parquet: -1
  rows: int = 0  # parquet: rows in the row group (from the footer)
  row_offset: int = 0  # parquet: rows of the file before this row group

  @property
  def kind(self) -> str:
    return _kind(self.source.path)

  @property
  def name(self) -> str:
    """`key` for a whole file, `key@start` for a part of one (messages, progress)."""
    return self.source.key if self.end < 0 and self.kind != 'parquet' else f'{self.source.key}@{self.start}'


def units(source: Source, counts: dict, *, text_field: str = 'text', block_bytes: int = 64 << 20) -> list[Unit]:
  """The units of one input, without reading its documents: row groups, line ranges of ~block_bytes, or the file."""
  kind = _kind(source.path)
  if kind == 'parquet':
    try:
      import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise PrepareError(f'{source.path}: reading parquet needs pyarrow (pip install pyarrow).') from e
    try:
      with storage.open_file(source.path) as f:
        meta = pq.ParquetFile(f).metadata
      names = meta.schema.to_arrow_schema().names
    except Exception as e:  # pyarrow raises its own ArrowInvalid/OSError family for corrupt files
      _warn_skip(counts, 'dropped_unreadable_files', f'{source.path}: {e}')
      return []
    if text_field not in names:
      raise PrepareError(f'{source.path} has no column {text_field!r} (columns: {", ".join(names)}); '
                         f'pass --text_field=NAME.')
    out, offset = [], 0
    for g in range(meta.num_row_groups):
      rows = meta.row_group(g).num_rows
      out.append(Unit(source, start=g, rows=rows, row_offset=offset))
      offset += rows
    return out
  if kind == 'jsonl' and not source.path.lower().endswith('.gz') and 0 < block_bytes < source.size:
    return [Unit(source, start=a, end=min(a + block_bytes, source.size)) for a in range(0, source.size, block_bytes)]
  return [Unit(source)]  # txt, and gzip (no seeking into a compressed stream)


def _lines(f, unit: Unit) -> Iterator[bytes]:
  """The lines of a binary file that begin in the unit's byte range."""
  if unit.end < 0:
    yield from f
    return
  if unit.start > 0:
    f.seek(unit.start - 1)
    f.readline()  # the rest of the line that holds byte start - 1: it belongs to the range before
  while f.tell() < unit.end:
    raw = f.readline()
    if not raw:
      return
    yield raw


def read_unit(unit: Unit, counts: dict, *, text_field: str = 'text', txt_docs: str = 'file',
              line_offset: int = 0) -> Iterator[tuple[int, str]]:
  """Yields (index, cleaned text) of one unit's documents; bad records are skipped and counted.

  The index names the document inside its file together with the source key (`key:index`): the 1-based line of a
  jsonl file (a range's lines are numbered from 1 + line_offset), the row of a parquet file, the part of a txt
  file split into paragraphs or lines; -1 for a txt file that is one document. A range's lines are numbered
  after those of the ranges before it (`line_offset`, the sum of their `line_count`).
  """
  source = unit.source
  kind = unit.kind
  try:
    if kind == 'parquet':
      yield from _read_row_group(unit, counts, text_field)
      return
    with _open(source.path) as f:
      if kind == 'jsonl':
        for line_no, raw in enumerate(_lines(f, unit), line_offset + 1):
          if not raw.strip():
            continue
          try:
            obj = json.loads(_decode(raw, counts))
          except json.JSONDecodeError:
            _warn_skip(counts, 'dropped_bad_json', f'{source.path}:{line_no}')
            continue
          value = obj.get(text_field) if isinstance(obj, dict) else None
          if not isinstance(value, str):
            _warn_skip(counts, 'dropped_missing_field', f'{source.path}:{line_no} has no string {text_field!r}')
            continue
          if (text := _clean(value, counts)) is not None:
            yield line_no, text
        return
      raw = f.read()
  except (OSError, EOFError, gzip.BadGzipFile) as e:
    _warn_skip(counts, 'dropped_unreadable_files', f'{source.path}: {e}')
    return
  if not raw.strip():
    _warn_skip(counts, 'dropped_empty_files', source.path)
    return
  text = _decode(raw, counts)
  if txt_docs == 'file':
    if (text := _clean(text, counts)) is not None:
      yield -1, text
    return
  text = _normalise_newlines(text, counts)
  parts = text.split('\n') if txt_docs == 'lines' else text.split('\n\n')
  for i, part in enumerate(parts):
    if part.strip():  # blank separators between paragraphs/lines are layout, not dropped documents
      yield i, _clean(part, counts)


def line_count(unit: Unit) -> int:
  """Lines that begin in a jsonl unit (what the next range of the file numbers its lines after)."""
  try:
    with _open(unit.source.path) as f:
      return sum(1 for _ in _lines(f, unit))
  except (OSError, EOFError, gzip.BadGzipFile):
    return 0


def doc_key(source_key: str, index: int) -> str:
  """The document's stable name, hashed for the held-out split: `key:index`, or `key` for a whole-file document."""
  return source_key if index < 0 else f'{source_key}:{index}'


def read_documents(source: Source, counts: dict, *, text_field: str = 'text',
                   txt_docs: str = 'file') -> Iterator[tuple[str, str]]:
  """Yields (key, cleaned text) for each document of one file; bad records are skipped and counted."""
  if _kind(source.path) == 'parquet':
    for unit in units(source, counts, text_field=text_field, block_bytes=2**62):
      for i, text in read_unit(unit, counts, text_field=text_field):
        yield doc_key(source.key, i), text
    return
  for i, text in read_unit(Unit(source), counts, text_field=text_field, txt_docs=txt_docs):
    yield doc_key(source.key, i), text


def read_records(source: Source | Unit, counts: dict, line_offset: int = 0) -> Iterator[tuple[str, object]]:
  """Yields (key, parsed JSON value) for each line of a .jsonl file or range (chat data); bad lines are skipped
  and counted."""
  unit = source if isinstance(source, Unit) else Unit(source)
  source = unit.source
  if _kind(source.path) != 'jsonl':
    raise PrepareError(f'{source.path}: chat data is read from .jsonl files (one conversation per line).')
  try:
    with _open(source.path) as f:
      for line_no, raw in enumerate(_lines(f, unit), line_offset + 1):
        if not raw.strip():
          continue
        try:
          yield f'{source.key}:{line_no}', json.loads(_decode(raw, counts))
        except json.JSONDecodeError:
          _warn_skip(counts, 'dropped_bad_json', f'{source.path}:{line_no}')
  except (OSError, EOFError, gzip.BadGzipFile) as e:
    _warn_skip(counts, 'dropped_unreadable_files', f'{source.path}: {e}')


def _read_row_group(unit: Unit, counts: dict, text_field: str) -> Iterator[tuple[int, str]]:
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top  # optional: only parquet inputs need it
  source = unit.source
  try:
    with storage.open_file(source.path) as f:
      column = pq.ParquetFile(f).read_row_group(unit.start, columns=[text_field]).column(0)
  except Exception as e:  # pylint: disable=broad-except  -- pyarrow's ArrowInvalid/OSError family
    _warn_skip(counts, 'dropped_unreadable_files', f'{source.path} row group {unit.start}: {e}')
    return
  for j, value in enumerate(column.to_pylist()):
    row = unit.row_offset + j
    if isinstance(value, bytes):
      value = _decode(value, counts)
    if not isinstance(value, str):
      _warn_skip(counts, 'dropped_missing_field', f'{source.path} row {row} has no string {text_field!r}')
      continue
    if (text := _clean(value, counts)) is not None:
      yield row, text
