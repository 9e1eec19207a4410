"""Small shared pieces for the tests: configs and synthetic batches."""


import numpy as np
import pytest

from jaxlm import cli
from tests.conftest import FAST_COMPILE_XLA_FLAGS, ROOT


class LazyModule:
  """`name`, imported (pytest.importorskip) at its first attribute access: a heavy reference library (torch,
  transformers, peft) named at a test module's top costs its collection nothing, so the fast loop does not pay
  for the full suite's parity tests."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr):
    if attr.startswith(('_', 'pytest')):  # what collection asks of every module-level name: not the module's
      raise AttributeError(attr)
    return getattr(pytest.importorskip(self._name), attr)


def grid(values, fast, ids=str, unpack: bool = False) -> list:
  """pytest params over `values`: those in `fast` run in the fast loop, the rest are marked e2e (full suite only).

  unpack: each value is a tuple of several argnames' values.
  """
  return [pytest.param(*(v if unpack else (v,)), id=ids(v), marks=() if v in fast else pytest.mark.e2e)
          for v in values]


def load_config(name: str = 'palm_tiny'):
  """A config from configs/<name>.py, unlocked so tests can override fields."""
  return cli.load_file(ROOT / 'configs' / f'{name}.py')




def plain_program(cfg, mesh, steps: int = 10, microbatches: int = 1):
  """The plain step (no finiteness check, no update multiplier) for `cfg`'s model and optimizer on `mesh`.

  The same program on the same mesh is the same Program within a test process (step.cached_program, as the
  trainer's resumed runs get it): its jitted functions are compiled once, not once per test that builds it again
  (a Program holds no state; a test that patches the model's code builds its own with step.build_program)."""
  from jaxlm import step
  cfg.train.update(steps=steps, seed=0, microbatches=microbatches)
  cfg.stability.policy = 'off'
  cfg.faults.lr_spike_steps = ''
  return step.cached_program(cfg, mesh, keep=16)[0]  # 16: a bound on the compiled executables kept alive


def odd_config(parallel_block: bool = True):
  """palm_tiny with distinct, prime-ish sizes so a wrong transpose fails loudly (D must divide by fsdp=8)."""
  c = load_config('palm_tiny')
  c.model.update(vocab_size=398, d_model=56, num_heads=4, num_kv_heads=2, head_dim=14, mlp_dim=94,
                 parallel_block=parallel_block, dtype='float32')
  c.optim.update(warmup_steps=0, lr=1e-2)
  return c


def random_batch(batch: int, seq: int, vocab: int, seed: int = 0, docs: int = 1) -> dict:
  """A packed batch of random tokens; `docs` > 1 splits each row into that many documents."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
  bounds = np.linspace(0, seq, docs + 1).astype(int)
  segment_ids = np.zeros((batch, seq), np.int32)
  positions = np.zeros((batch, seq), np.int32)
  for d in range(docs):
    segment_ids[:, bounds[d]:bounds[d + 1]] = d + 1
    positions[:, bounds[d]:bounds[d + 1]] = np.arange(bounds[d + 1] - bounds[d])
  return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=segment_ids, positions=positions,
              weights=np.ones((batch, seq), np.float32))


def train_command(workdir, *overrides, config: str = 'palm_tiny') -> list[str]:
  """The real entry point as a user types it."""
  import sys
  return [sys.executable, '-m', 'jaxlm.train', f'--config=configs/{config}.py', f'--workdir={workdir}',
          *overrides]


def train_env(devices: int = 8) -> dict:
  """Environment for a training subprocess: `devices` fake CPU devices, unbuffered output, and the run's shared
  compilation cache (tests/conftest.py: pytest_configure).

  The cache comes with the XLA:CPU scheduler setting that makes cached multi-device executables safe in one
  process (jaxlm/malloc.py: CPU_MESH_XLA_FLAG; jobs of several processes keep the cache off: jaxlm/distributed.py)
  and caches every program however quickly it compiled (JAX's default keeps those over 1 s; at -O0 most of ours
  are faster). A resumed or repeated run then reads its steps back instead of compiling them (measured on the
  kill -9 drills: 5–11 % less CPU time; bench/RESULTS.md, "Test suite")."""
  import os
  from tests.conftest import SUBPROCESS_CACHE_ENV
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1',
             XLA_FLAGS=f'--xla_force_host_platform_device_count={devices} {FAST_COMPILE_XLA_FLAGS}')
  if os.environ.get(SUBPROCESS_CACHE_ENV, '0') != '0':
    from jaxlm import malloc
    env['XLA_FLAGS'] += f' {malloc.CPU_MESH_XLA_FLAG}'
    env['JAX_COMPILATION_CACHE_DIR'] = os.environ[SUBPROCESS_CACHE_ENV]
    env['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
    # A size limit turns on JAX's file lock around each read and write: without it, a process could read an
    # entry that another is still writing.
    env['JAX_COMPILATION_CACHE_MAX_SIZE'] = str(8 << 30)
  return env


def run_cli(module: str, *args, devices: int = 8, timeout: float = 600, env: dict | None = None):
  """`python -m <module> args...` from the repository root, as a user runs it; a CompletedProcess with text."""
  import subprocess
  import sys
  return subprocess.run([sys.executable, '-m', module, *map(str, args)], cwd=ROOT,
                        env=env if env is not None else train_env(devices), capture_output=True, text=True,
                        timeout=timeout)


def assert_fails_with(out, code: int, *says: str) -> str:
  """An expected failure: exit `code`, no traceback, and one `jaxlm: <what>; <fix>` line last (saying `says`)."""
  assert out.returncode == code, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith('jaxlm: ') and '; ' in last and 'Traceback' not in out.stdout + out.stderr, \
      out.stderr[-2000:]
  for text in says:
    assert text in last, (text, last)
  return last


def loopback_server(handler, server_class=None):
  """A generator for a fixture: an HTTP server of `handler` on a free 127.0.0.1 port, serving on a thread; yields
  its base URL, and shuts it down when the fixture ends."""
  import http.server
  import threading
  server = (server_class or http.server.ThreadingHTTPServer)(('127.0.0.1', 0), handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    yield f'http://127.0.0.1:{server.server_address[1]}'
  finally:
    server.shutdown()
    server.server_close()


def read_records(workdir, kind: str = 'train') -> list[dict]:
  """Records of one kind from <workdir>/metrics.jsonl, in file order."""
  import json
  import pathlib
  path = pathlib.Path(workdir, 'metrics.jsonl')
  if not path.exists():
    return []
  records = []
  for line in path.read_text().splitlines():
    try:
      r = json.loads(line)
    except json.JSONDecodeError:  # a line cut by SIGKILL
      continue
    if r.get('kind') == kind:
      records.append(r)
  return records


def export_round_trip(hf_dir, run, out, architecture: str):
  """Exports the run `run` to `out` and checks it against the import's source `hf_dir`: the `architecture`, the
  same tensor names and values, and transformers reloading it as that class. Returns (its config.json, the
  reloaded model in float32, eval mode)."""
  import json
  import transformers
  from safetensors.numpy import load_file
  from jaxlm.hf import export
  summary = export.export(str(run), str(out))
  assert summary['architecture'] == architecture
  before, after = load_file(f'{hf_dir}/model.safetensors'), load_file(f'{out}/model.safetensors')
  assert sorted(before) == sorted(after)
  for name in before:
    np.testing.assert_array_equal(after[name], before[name], err_msg=name)
  back = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation='eager')
  assert type(back).__name__ == architecture
  with open(f'{out}/config.json') as f:
    return json.load(f), back.float().eval()
