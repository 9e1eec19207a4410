"""Files that a reader must see whole or not at all: written under a temporary name, then renamed.

A rename within one directory is atomic on POSIX file systems, so a crash or a full disk leaves the old file
(or none), never half a file. Every writer of JSON, shards, tokenizers, checksums and exports goes through here.
"""

import contextlib
import json
import os


@contextlib.contextmanager
def replacing(path: str):
  """Yields a temporary path beside `path` to write; renames it onto `path` if the block succeeds."""
  tmp = f'{path}.tmp-{os.getpid()}'  # '.tmp-' marks leftovers that a resumed prepare removes
  try:
    yield tmp
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def write_atomic(path: str, data: str | bytes) -> None:
  """Writes `data` to `path` whole or not at all."""
  with replacing(path) as tmp, open(tmp, 'wb' if isinstance(data, bytes) else 'w') as f:
    f.write(data)


def write_json(path: str, value, **dump_args) -> None:
  """Writes `value` as JSON (and a final newline) to `path` whole or not at all."""
  write_atomic(path, json.dumps(value, **dump_args) + '\n')
