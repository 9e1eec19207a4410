"""What a location is: a local path or a bucket URL (`gs://BUCKET/...`, `s3://BUCKET/...`), and the check every
command applies to the locations it is given, before any work (cli.check_locations, config validation).

Below every other module (it imports nothing of jaxlm but its errors), so the command runner and the data layer
share one rule; data/storage.py reaches what a URL names.
"""

from jaxlm.errors import ConfigError

SCHEMES = ('gs', 's3')


def location_problem(path: str) -> str | None:
  """Why `path` is neither a local path nor a bucket URL jaxlm can use, or None.

  Anything written with `://` is meant as a URL: it must be gs:// or s3:// and name a bucket. Taken as a local
  path instead it would become a folder named `gs:` in the working directory, and a run would train there.
  """
  if not isinstance(path, str) or '://' not in path:
    return None
  kind, rest = path.split('://', 1)
  if kind not in SCHEMES:
    if not kind.isalnum():  # './runs/gs://b', 'runs/x://y': a local path cannot hold '://'
      return f'{path} is a local path with "://" in it; write a bucket URL as gs://BUCKET/PATH or s3://BUCKET/PATH'
    return (f'{path}: unknown storage scheme {kind}://; use gs://BUCKET/PATH, s3://BUCKET/PATH or a local path')
  if not rest.split('/', 1)[0]:
    return f'{path} names no bucket; write {kind}://BUCKET/PATH'
  return None


def check_location(path: str, what: str) -> None:
  """Refuses (ConfigError, exit 2, naming `what`) a location `location_problem` finds wrong; each of a
  comma- or semicolon-separated list is checked."""
  for part in str(path).replace(';', ',').split(','):
    if problem := location_problem(part.strip()):
      raise ConfigError(f'{what}: {problem}')
