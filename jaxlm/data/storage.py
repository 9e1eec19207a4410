"""Local paths and bucket URLs (`gs://`, `s3://`) behind one small API: the only module that knows fsspec and
TensorStore specs.

Every other module passes a path, local or URL, and never asks which it is. Small files go through fsspec
(gcsfs, s3fs: `pip install -e '.[cloud]'`); arrays go through Orbax, whose TensorStore drivers write each
process's part straight to the bucket. The endpoint and credential variables users already set are passed to each
library in its own form (`configure`): one setting reaches checkpoints, logs and data alike.

  S3:  AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_REGION (or AWS_DEFAULT_REGION), AWS_ACCESS_KEY_ID /
       AWS_SECRET_ACCESS_KEY (or any source botocore reads: profiles, instance roles)
  GCS: STORAGE_EMULATOR_HOST (the Google client libraries' emulator variable), else application-default credentials

Object stores have no atomic rename and no append: a file is written whole by one PUT (readers see the old
object or the new one), a "move" is copy-then-delete, and an appended log is kept as fixed segments (`Segments`).
"""

import base64
import contextlib
import glob
import hashlib
import json
import os
import shutil
import socket
import tempfile
import threading
import urllib.parse

from jaxlm.data import format as format_lib
from jaxlm.errors import ConfigError, StorageError
from jaxlm.locations import SCHEMES, check_location

CONNECT_TIMEOUT_S = 3.0  # a wrong endpoint or closed port fails in seconds, not after minutes of retries
CLOUD_EXTRA = "pip install -e '.[cloud]'"


def is_url(path) -> bool:
  """Whether `path` is a bucket URL (gs://, s3://) rather than a local path."""
  return isinstance(path, str) and '://' in path and path.split('://', 1)[0] in SCHEMES


def scheme(path: str) -> str | None:
  """'gs', 's3', or None for a local path."""
  return path.split('://', 1)[0] if is_url(path) else None


def normalize(path: str) -> str:
  """A URL without a trailing slash, or an absolute local path with ~ expanded."""
  path = str(path)
  if is_url(path):
    configure()  # before Orbax's first use of the path: its fsspec calls then see the endpoint and credentials
    return path.rstrip('/')
  return os.path.abspath(os.path.expanduser(path))


def join(path: str, *names: str) -> str:
  """`path`/`names`..., for URLs and local paths alike."""
  if is_url(path):
    return '/'.join([path.rstrip('/'), *(n.strip('/') for n in names)])
  return os.path.join(os.path.expanduser(path), *names)


def basename(path: str) -> str:
  return path.rstrip('/').rsplit('/', 1)[-1] if is_url(path) else os.path.basename(path.rstrip(os.sep))


def dirname(path: str) -> str:
  return path.rstrip('/').rsplit('/', 1)[0] if is_url(path) else os.path.dirname(path.rstrip(os.sep))


def bucket(path: str) -> str:
  """The bucket of a URL: gs://b/x/y -> b."""
  return urllib.parse.urlparse(path).netloc


# ---------------------------------------------------------------- endpoints and credentials, per library

def endpoint(kind: str) -> str | None:
  """The endpoint URL set for `kind` ('gs', 's3') in the environment, or None for the public service."""
  if kind == 's3':
    url = os.environ.get('AWS_ENDPOINT_URL_S3') or os.environ.get('AWS_ENDPOINT_URL')
  else:
    url = os.environ.get('STORAGE_EMULATOR_HOST')
  if url and '://' not in url:
    url = f'http://{url}'  # the Google clients accept host:port
  return url or None


def s3_region() -> str:
  return os.environ.get('AWS_REGION') or os.environ.get('AWS_DEFAULT_REGION') or 'us-east-1'


_configured: dict = {}
_lock = threading.Lock()


def configure() -> None:
  """Passes the endpoint variables to fsspec and TensorStore in their own forms (again when they changed).

  TensorStore's GCS driver reads TENSORSTORE_GCS_HTTP_URL, not STORAGE_EMULATOR_HOST; gcsfs reads the latter but
  needs anonymous access against an emulator; s3fs (botocore) reads AWS_ENDPOINT_URL itself, but its retries are
  set here so a closed port fails fast.
  """
  import fsspec  # pylint: disable=import-outside-toplevel  -- fsspec comes with etils/orbax; gcsfs/s3fs do not
  key = (endpoint('gs'), endpoint('s3'), s3_region())
  with _lock:
    if _configured.get('key') == key:
      return
    gs_url, s3_url, region = key
    if gs_url:
      os.environ['TENSORSTORE_GCS_HTTP_URL'] = gs_url
      _plain_gcsfs()
      # An emulator takes no credentials; TensorStore's GCS driver would otherwise look for ADC and fail.
      os.environ.setdefault('GOOGLE_AUTH_TOKEN_FOR_TESTING', 'emulator')
      fsspec.config.conf['gcs'] = {**fsspec.config.conf.get('gcs', {}), 'token': 'anon'}
    # No listings cache: Orbax (through etils) and jaxlm hold separate instances, and other processes write the
    # same prefixes; a cached listing would show a step deleted or written elsewhere wrongly.
    fsspec.config.conf['gcs'] = {**fsspec.config.conf.get('gcs', {}), 'use_listings_cache': False}
    s3 = {'use_listings_cache': False, 'config_kwargs': {'connect_timeout': CONNECT_TIMEOUT_S, 'retries': {'max_attempts': 3}},
          'client_kwargs': {'region_name': region}}
    if s3_url:
      s3['endpoint_url'] = s3_url
    fsspec.config.conf['s3'] = {**fsspec.config.conf.get('s3', {}), **s3}
    _configured['key'] = key
  _clear_instances()


def _plain_gcsfs() -> None:
  """gcsfs's plain filesystem for gs:// against an emulator, which has no folders API.

  gcsfs picks its class once, when imported: with GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT unset, the extended one,
  whose folder-API calls stall against an emulator (a minute per bucket, or for good). The variable alone is
  not enough when gcsfs was imported before this ran, so the plain class is also registered with fsspec for
  gs:// (fsspec.register_implementation, public API).
  """
  import fsspec  # pylint: disable=import-outside-toplevel
  os.environ.setdefault('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT', 'false')
  if os.environ['GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT'].lower() in ('true', '1'):
    return  # asked for by the user
  try:
    from gcsfs.core import GCSFileSystem  # pylint: disable=import-outside-toplevel
  except ImportError:
    return  # filesystem() names the missing extra
  for name in ('gs', 'gcs'):
    fsspec.register_implementation(name, GCSFileSystem, clobber=True)


def _clear_instances() -> None:
  """Drops fsspec's cached instances of the store classes already imported (importing one here would fix its
  class before configure() set it up: see _plain_gcsfs)."""
  import fsspec  # pylint: disable=import-outside-toplevel
  for kind in SCHEMES:
    cls = fsspec.registry.get(kind)
    if cls is not None:
      cls.clear_instance_cache()


def filesystem(path: str):
  """(fsspec filesystem, path as that filesystem names it) for a URL; a missing extra is one clear line."""
  configure()
  import fsspec  # pylint: disable=import-outside-toplevel
  kind = scheme(path)
  try:
    fs = fsspec.filesystem(kind)
  except (ImportError, ValueError) as e:
    package = {'gs': 'gcsfs', 's3': 's3fs'}[kind]
    raise ConfigError(f'{path} is on {kind}://, which needs {package}: {CLOUD_EXTRA}') from e
  return fs, path.split('://', 1)[1]


def tensorstore_kvstore(path: str) -> dict:
  """The TensorStore kvstore spec of `path`, endpoint and region included (TensorStore reads neither variable)."""
  kind = scheme(path)
  if kind is None:
    return {'driver': 'file', 'path': normalize(path) + '/'}
  configure()
  name, _, key = path.split('://', 1)[1].partition('/')
  spec = {'driver': 'gcs' if kind == 'gs' else 's3', 'bucket': name, 'path': key.rstrip('/') + '/'}
  if kind == 's3':
    spec['aws_region'] = s3_region()
    if url := endpoint('s3'):
      spec['endpoint'] = url
  return spec


def checkpoints_unsupported(path: str) -> str | None:
  """Why Orbax cannot write checkpoints under `path`, or None.

  Orbax (0.12) builds the TensorStore spec of every array itself and takes `gs://` URLs and absolute local paths
  only: an `s3://` path is refused ("Checkpoint path should be absolute"), and its public API takes no kvstore
  spec. Logs, small files and data reach S3 through s3fs; checkpoints need a mount of the bucket.
  """
  if scheme(path) == 's3':
    return (f'{path}: Orbax writes checkpoints to gs:// and local paths only, not s3:// (it builds the '
            f'TensorStore specs itself); mount the bucket (mountpoint-s3, s3fs-fuse) and pass the mount point as '
            f'--workdir, or use a gs:// bucket (README "Object storage")')
  return None


# ---------------------------------------------------------------- reachability: seconds, not minutes

def check(path: str, what: str = '--workdir') -> None:
  """Fails in seconds, with one line and exit 3, when the store behind `path` cannot be reached: a closed or
  wrong endpoint, missing credentials, or no such bucket. Local paths pass (their errors come when written)."""
  if not is_url(path):
    return
  check_endpoint(path, what)
  kind = scheme(path)
  fs, _ = filesystem(path)
  try:
    fs.info(bucket(path))  # one request; unlike exists(), it raises what the store answered (a refused key)
  except FileNotFoundError:
    raise StorageError(f'{what}={path}: bucket {bucket(path)} does not exist (or these credentials cannot see '
                       f'it); create it or fix the URL') from None
  except Exception as e:  # pylint: disable=broad-except  -- credentials, permissions: each client its own class
    if kind == 's3' and not _s3_credentials():  # s3fs then sends anonymous requests, which a private bucket refuses
      raise StorageError(f'{what}={path}: no S3 credentials were found; set them ({_credentials_hint(kind)})') \
          from None
    raise StorageError(f'{what}={path}: {type(e).__name__}: {" ".join(str(e).split())[:200]}; check the '
                       f'credentials ({_credentials_hint(kind)})') from None


def check_endpoint(path: str, what: str = '--workdir') -> None:
  """The network part of `check`: one TCP connect to the store's endpoint (no client library imported)."""
  check_location(path, what)  # a malformed URL is the user's to fix (exit 2), not the network's
  if not is_url(path):
    return
  kind = scheme(path)
  url = endpoint(kind)
  host, port = ((urllib.parse.urlparse(url).hostname, urllib.parse.urlparse(url).port
                 or (443 if url.startswith('https') else 80)) if url else
                ('storage.googleapis.com' if kind == 'gs' else f's3.{s3_region()}.amazonaws.com', 443))
  variable = {'gs': 'STORAGE_EMULATOR_HOST', 's3': 'AWS_ENDPOINT_URL'}[kind]
  try:
    socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
  except OSError as e:
    raise StorageError(f'{what}={path}: cannot reach {host}:{port} ({e.strerror or e}); check {variable} and '
                       f'the network') from None


def _s3_credentials() -> bool:
  """Whether botocore finds S3 credentials anywhere it looks (variables, profiles, an instance role)."""
  import botocore.session  # pylint: disable=import-outside-toplevel  -- with s3fs
  return botocore.session.Session().get_credentials() is not None


def _credentials_hint(kind: str) -> str:
  return ('AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile' if kind == 's3' else
          'gcloud auth application-default login, or GOOGLE_APPLICATION_CREDENTIALS')


# ---------------------------------------------------------------- files and directories

def exists(path: str) -> bool:
  if not is_url(path):
    return os.path.exists(os.path.expanduser(path))
  fs, key = filesystem(path)
  return fs.exists(key)


def isdir(path: str) -> bool:
  """A local directory, or a URL prefix that holds at least one object."""
  if not is_url(path):
    return os.path.isdir(os.path.expanduser(path))
  fs, key = filesystem(path)
  fs.invalidate_cache(key)
  return fs.isdir(key)


def isfile(path: str) -> bool:
  if not is_url(path):
    return os.path.isfile(os.path.expanduser(path))
  fs, key = filesystem(path)
  return fs.isfile(key)


def listdir(path: str) -> list[str]:
  """Names directly under `path` ([] if there is nothing); one listing on a bucket."""
  if not is_url(path):
    path = os.path.expanduser(path)
    return sorted(os.listdir(path)) if os.path.isdir(path) else []
  fs, key = filesystem(path)
  fs.invalidate_cache(key)
  try:
    return sorted({p.rstrip('/').rsplit('/', 1)[-1] for p in fs.ls(key, detail=False)} - {''})
  except FileNotFoundError:
    return []


def makedirs(path: str) -> None:
  """Creates a local directory; a bucket has no directories (a prefix exists once an object is under it)."""
  if not is_url(path):
    os.makedirs(os.path.expanduser(path), exist_ok=True)


def read_bytes(path: str) -> bytes:
  if not is_url(path):
    with open(os.path.expanduser(path), 'rb') as f:
      return f.read()
  fs, key = filesystem(path)
  return fs.cat_file(key)


def read_text(path: str) -> str:
  return read_bytes(path).decode()


def read_json(path: str):
  return json.loads(read_bytes(path))


def write_bytes(path: str, data: bytes | str) -> None:
  """Writes `data` whole or not at all: a rename locally, one PUT on a bucket (readers see old or new)."""
  if not is_url(path):
    format_lib.write_atomic(os.path.expanduser(path), data)
    return
  fs, key = filesystem(path)
  fs.pipe_file(key, data.encode() if isinstance(data, str) else data)


def write_json(path: str, value, **dump_args) -> None:
  write_bytes(path, json.dumps(value, **dump_args) + '\n')


def remove(path: str) -> None:
  """Removes a file if it exists."""
  if not is_url(path):
    with contextlib.suppress(FileNotFoundError):
      os.remove(os.path.expanduser(path))
    return
  fs, key = filesystem(path)
  with contextlib.suppress(FileNotFoundError):
    fs.rm_file(key)


def rmtree(path: str) -> None:
  """Removes a directory (every object under a prefix) if it exists."""
  if not is_url(path):
    shutil.rmtree(os.path.expanduser(path), ignore_errors=True)
    return
  fs, key = filesystem(path)
  with contextlib.suppress(FileNotFoundError):
    fs.rm(key, recursive=True)
  fs.invalidate_cache(key)


def move(src: str, dst: str) -> None:
  """Moves a directory: a rename locally; copy then delete on a bucket (a prefix cannot be renamed)."""
  if not is_url(src):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.rename(src, dst)
    return
  fs, key = filesystem(src)
  _, target = filesystem(dst)
  fs.invalidate_cache(key)
  for name in fs.find(key):  # object by object: the copy is complete before anything is deleted
    fs.copy(name, target + name[len(key):])
  fs.rm(key, recursive=True)
  fs.invalidate_cache(key)


def upload(local: str, url: str) -> None:
  """Copies a local file or directory to `url` (a local path too: then a plain copy)."""
  if not is_url(url):
    if os.path.isdir(local):
      shutil.copytree(local, url, dirs_exist_ok=True)
    else:
      os.makedirs(os.path.dirname(os.path.abspath(url)), exist_ok=True)
      shutil.copyfile(local, url)
    return
  fs, key = filesystem(url)
  if os.path.isdir(local):
    for base, _, files in os.walk(local):
      for name in sorted(files):
        path = os.path.join(base, name)
        fs.put_file(path, key + '/' + os.path.relpath(path, local).replace(os.sep, '/'))
  else:
    fs.put_file(local, key)


@contextlib.contextmanager
def writing_dir(path: str, what: str = '--out'):
  """A local directory to write the files of the directory `path` into: `path` itself when local; for a bucket
  URL a temporary directory, uploaded file by file when the block ends without an error (a failed block uploads
  nothing, so a half-written directory never reaches the bucket)."""
  if not is_url(path):
    os.makedirs(path, exist_ok=True)
    yield path
    return
  check(path, what=what)  # before the work: a wrong endpoint fails in seconds
  with tempfile.TemporaryDirectory(prefix='jaxlm-upload-') as local:
    yield local
    upload(local, path)


def download(url: str, local: str) -> None:
  """Copies the object `url` (or a local file) to the local file `local` whole (renamed into place when
  complete)."""
  with format_lib.replacing(local) as tmp:
    if is_url(url):
      fs, key = filesystem(url)
      fs.get_file(key, tmp)
    else:
      shutil.copyfile(os.path.expanduser(url), tmp)


def free_bytes(path: str) -> int | None:
  """Free bytes of the disk holding `path` (its nearest existing parent); None for a bucket (no such number)."""
  if is_url(path):
    return None
  path = os.path.abspath(os.path.expanduser(path))
  while not os.path.exists(path):
    path = os.path.dirname(path)
  try:
    return shutil.disk_usage(path).free
  except OSError:
    return None


def tree_bytes(path: str) -> int:
  """Total bytes of the files under `path`."""
  if is_url(path):
    fs, key = filesystem(path)
    return sum(info.get('size', 0) for info in fs.find(key, detail=True).values())
  total = 0
  for base, _, files in os.walk(path):
    for f in files:
      with contextlib.suppress(OSError):
        total += os.path.getsize(os.path.join(base, f))
  return total


# ---------------------------------------------------------------- inputs read in place

def open_file(path: str):
  """A local file or a bucket object opened for binary reading; seekable (a seek on an object is a ranged read)."""
  if not is_url(path):
    return open(os.path.expanduser(path), 'rb')  # pylint: disable=consider-using-with
  fs, key = filesystem(path)
  return fs.open(key, 'rb')


def list_objects(spec: str) -> list[tuple[str, str, int, str]]:
  """(URL, name relative to the spec, size, the store's hash) of each object a bucket URL names: the object
  itself, every object under the prefix, or a glob's matches (its URLs as names), from one listing."""
  fs, key = filesystem(spec)
  fs.invalidate_cache(key)
  prefix = spec.split('://', 1)[0] + '://'
  if glob.has_magic(key):
    found = {name: info for name, info in fs.glob(key, detail=True).items() if info.get('type') != 'directory'}
    return [(prefix + name, prefix + name, int(info['size']), _object_hash(spec, info))
            for name, info in sorted(found.items())]
  key = key.rstrip('/')
  if fs.isfile(key):
    info = fs.info(key)
    return [(spec, key.rsplit('/', 1)[-1], int(info['size']), _object_hash(spec, info))]
  return [(prefix + name, name[len(key):].lstrip('/'), int(info['size']), _object_hash(spec, info))
          for name, info in sorted(fs.find(key, detail=True).items())]


# ---------------------------------------------------------------- integrity from the store's own hashes

def hashes(path: str, skip: tuple[str, ...] = ()) -> tuple[str, dict[str, str]]:
  """(algorithm, {relative path: hash}) of every file under `path`, except `skip`.

  Locally SHA-256 of the bytes; on a bucket the hash the store keeps for each object, read from one listing (no
  download): crc32c on GCS, the ETag on S3 (the MD5 of a single-part upload).
  """
  if not is_url(path):
    sums = {}
    for base, _, files in os.walk(path):
      for name in files:
        full = os.path.join(base, name)
        rel = os.path.relpath(full, path)
        if rel in skip:
          continue
        with open(full, 'rb') as f:
          sums[rel] = hashlib.file_digest(f, 'sha256').hexdigest()
    return 'sha256', sums
  fs, key = filesystem(path)
  fs.invalidate_cache(key)
  sums = {}
  for name, info in fs.find(key, detail=True).items():
    rel = name[len(key):].lstrip('/')
    if rel in skip:
      continue
    sums[rel] = _object_hash(path, info)
  return _hash_algorithm(path), sums


def _hash_algorithm(url: str) -> str:
  return 'crc32c' if scheme(url) == 'gs' else 'etag'


def _object_hash(url: str, info: dict) -> str:
  """The hash the store keeps for the object `info` describes (one entry of a listing)."""
  value = info.get('crc32c') if _hash_algorithm(url) == 'crc32c' else (info.get('ETag') or info.get('etag'))
  return str(value).strip('"') if value is not None else f'size:{info.get("size")}'


def crc32c_b64(data: bytes) -> str:
  """The crc32c of `data` as GCS reports it (base64 of the big-endian value); needs google-crc32c (cloud extra)."""
  import google_crc32c  # pylint: disable=import-outside-toplevel
  return base64.b64encode(google_crc32c.value(data).to_bytes(4, 'big')).decode()


# ---------------------------------------------------------------- append-only logs on a bucket

SEGMENT_BYTES = 256 * 1024  # a full segment is never written again; the open one is rewritten at each flush


class Segments:
  """An append-only text log kept as numbered segments `<directory>/<n>.<suffix>`: the form an appended file
  takes on a store where an append is an overwrite.

  Every `write` uploads the open segment whole before it returns (one PUT), so a kill -9 loses no record
  written; a full segment is closed and never rewritten, so a PUT stays small. A new process starts a new
  segment after the ones there (a crashed run's segments are kept as they are).
  """

  def __init__(self, directory: str, suffix: str = 'jsonl'):
    self.directory, self.suffix = directory, suffix
    numbers = [int(n.split('.')[0]) for n in listdir(directory) if n.split('.')[0].isdigit()]
    self.number = max(numbers, default=-1) + 1
    self.buffer = b''
    self.closed = False

  def write(self, text: str) -> None:
    """Appends `text` and uploads the open segment."""
    self.buffer += text.encode()
    write_bytes(join(self.directory, f'{self.number:08d}.{self.suffix}'), self.buffer)
    if len(self.buffer) >= SEGMENT_BYTES:
      self.number, self.buffer = self.number + 1, b''

  def flush(self) -> None:
    pass  # every write is uploaded

  def close(self) -> None:
    self.closed = True


def read_segments(directory: str, suffix: str = 'jsonl') -> bytes:
  """The concatenated segments of a `Segments` log, in order (b'' if none)."""
  names = sorted(n for n in listdir(directory) if n.endswith(f'.{suffix}') and n.split('.')[0].isdigit())
  return b''.join(read_bytes(join(directory, n)) for n in names)


class Mirror:
  """A local directory whose files are uploaded to `url` on `sync()`: for writers that only know local files
  (TensorBoard's event writer). Files only grow, so each sync uploads the files that changed, whole."""

  def __init__(self, url: str, prefix: str = 'jaxlm-'):
    self.url = url
    self.local = tempfile.mkdtemp(prefix=prefix)
    self._sizes: dict[str, int] = {}

  def sync(self) -> None:
    for name in sorted(os.listdir(self.local)):
      path = os.path.join(self.local, name)
      size = os.path.getsize(path)
      if self._sizes.get(name) != size:
        upload(path, join(self.url, name))
        self._sizes[name] = size

  def close(self) -> None:
    self.sync()
    shutil.rmtree(self.local, ignore_errors=True)


def open_log(path: str):
  """A line-buffered append handle: the file itself locally, `Segments` under `<path>.d/` on a bucket."""
  if not is_url(path):
    return open(os.path.expanduser(path), 'a', buffering=1)
  return Segments(f'{path}.d', suffix=path.rsplit('.', 1)[-1])


def read_log(path: str) -> bytes:
  """What `open_log(path)` handles wrote, in order."""
  if not is_url(path):
    return read_bytes(path) if os.path.exists(os.path.expanduser(path)) else b''
  return read_segments(f'{path}.d', suffix=path.rsplit('.', 1)[-1])


# ---------------------------------------------------------------- data: read in place or a verified local cache

def local_copy(url: str, cache_dir: str) -> str:
  """A local directory holding the files under `url`, downloaded once and verified against the store's hashes
  (files whose hash matches are not downloaded again). Local paths are returned as they are."""
  if not is_url(url):
    return url
  digest = hashlib.sha256(url.encode()).hexdigest()[:16]
  local = os.path.join(os.path.expanduser(cache_dir), 'remote', f'{bucket(url)}-{digest}')
  os.makedirs(local, exist_ok=True)
  algorithm, want = hashes(url)
  record = os.path.join(local, '.jaxlm-hashes.json')
  have = read_json(record) if os.path.exists(record) else {}  # what was verified before: not fetched again
  for rel, value in sorted(want.items()):
    target = os.path.join(local, rel)
    if have.get(rel) == value and os.path.exists(target):
      continue
    os.makedirs(os.path.dirname(target), exist_ok=True)
    download(join(url, rel), target)
    if algorithm == 'crc32c':
      with open(target, 'rb') as f:
        if crc32c_b64(f.read()) != value:
          raise StorageError(f'{join(url, rel)} arrived with another crc32c than the store holds; run again')
    have[rel] = value
    format_lib.write_json(record, have)
  return local

