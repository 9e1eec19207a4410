"""Throughput of the real jaxlm train step: tokens/s, step time, model FLOP/s, MFU and memory.

  python bench/mfu.py --config=configs/palm_1b.py --steps=20 --warmup=3 [--config.model.remat=full ...]

Builds the step exactly as `python -m jaxlm.train` does (step.build_program on the configured mesh, compiled
ahead of time), feeds random batches already on the device (so data loading is not what is measured), runs
`--warmup` untimed steps and then `--steps` timed ones, each waited for. MFU follows PaLM appendix B (model
FLOPs, not hardware FLOPs: remat does not count) against the dense bf16 peak in jaxlm.perf.PEAK_FLOPS; it
is 'n/a' on a device whose peak is unknown, a CPU included, and with model.matmul_dtype=fp8 (the peak is bf16's:
fp8 runs are compared in tokens/s and bf16-equivalent model FLOP/s, never as MFU).

  python bench/mfu.py --config=configs/palm_1b.py --baseline=torch

adds the PyTorch baseline (bench/torch_gpt.py: the same model, batches, AdamW and FLOPs formula; torch.compile,
bf16 autocast with float32 master weights) measured in the same run on the same device, and prints both rows and
the ratio of their tokens/s per device.
"""

import contextlib
import json
import multiprocessing
import os
import pathlib
import platform
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).absolute().parents[1]))
import jaxlm  # noqa: E402,F401  first, as in `python -m jaxlm.train`: sets up malloc before JAX (jaxlm/malloc.py)

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxlm import attention as attention_lib  # noqa: E402
from jaxlm import config as config_lib  # noqa: E402
from jaxlm import perf  # noqa: E402
from jaxlm import preflight  # noqa: E402
from jaxlm import model as model_lib  # noqa: E402
from jaxlm import sharding  # noqa: E402
from jaxlm import step  # noqa: E402


_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/palm_1b.py (with --config.a.b=v).')
FLAGS = flags.FLAGS


def random_batches(n: int, batch: int, seq: int, vocab: int, docs: int = 1, seed: int = 0) -> list[dict]:
  """`n` host batches of random tokens in jaxlm's batch format, each row split into `docs` documents."""
  rng = np.random.default_rng(seed)
  starts = np.linspace(0, seq, docs + 1).astype(int)[:-1]  # first position of each document
  segment = np.searchsorted(starts, np.arange(seq), side='right')  # 1-based document of each position
  segment_ids = np.broadcast_to(segment.astype(np.int32), (batch, seq))
  positions = np.broadcast_to((np.arange(seq) - starts[segment - 1]).astype(np.int32), (batch, seq))
  out = []
  for _ in range(n):
    tokens = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    out.append(dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=segment_ids, positions=positions,
                    weights=np.ones((batch, seq), np.float32)))
  return out


class Bench:
  """The compiled jaxlm train step with its state and batches on the device; `step()` runs one and waits."""

  def __init__(self, cfg, docs: int = 1):
    config_lib.validate(cfg, jax.device_count())
    self.cfg = cfg
    self.mesh = sharding.make_mesh(cfg.mesh)
    if cfg.model.remat == preflight.REMAT_AUTO:  # as the trainer: the least recompute that fits
      cfg = cfg.copy_and_resolve_references()
      cfg.model.remat, why = preflight.choose_remat(cfg, self.mesh)
      print(f'model.remat=auto chose {cfg.model.remat}: {why}', flush=True)
      self.cfg = cfg
    t = cfg.train
    with self._context():
      self.program = step.build_program(cfg, self.mesh)  # the step `python -m jaxlm.train` would run
      start = time.perf_counter()
      batch = step.abstract_batch(t.batch_size, cfg.data.seq_len, self.program.batch_sharding)
      lowered = self.program.train_step.lower(self.program.abstract_state, batch)
      self.compiled = lowered.compile()
      self.compile_s = time.perf_counter() - start
      self.state = self.program.init()
      self.batches = [step.global_batch(b, self.program.batch_sharding) for b in
                      random_batches(4, t.batch_size, cfg.data.seq_len, cfg.model.vocab_size, docs, t.seed)]
    self.steps_run = 0
    self.out = None

  def _context(self):
    """The mesh and sharding rules that train.run traces under (attention's shard_map reads them)."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.sharding.set_mesh(self.mesh))
    stack.enter_context(nn.logical_axis_rules(sharding.RULES))
    return stack

  def step(self) -> float:
    """Runs one train step on the next batch, waits for it, and returns its wall time in seconds."""
    batch = self.batches[self.steps_run % len(self.batches)]
    start = time.perf_counter()
    self.state, self.out = self.compiled(self.state, batch)
    jax.block_until_ready((self.state, self.out))
    self.steps_run += 1
    return time.perf_counter() - start

  def result(self, times: list[float]) -> dict:
    """Throughput, MFU and memory of the timed steps `times`."""
    cfg, t = self.cfg, self.cfg.train
    m = self.program.model.config
    device = jax.devices()[0]
    step_s = statistics.median(times)
    tokens_per_s = t.batch_size * cfg.data.seq_len / step_s
    flops = model_lib.flops_per_token(m, cfg.data.seq_len)
    flops_causal = model_lib.flops_per_token(m, cfg.data.seq_len, causal=True)
    fp8 = m.matmul_dtype == 'fp8'  # MFU is against the bf16 peak: an fp8 run reports tokens/s and model FLOP/s only
    return dict(
        framework='jaxlm', jax=jax.__version__, device_kind=device.device_kind, platform=device.platform,
        num_devices=self.mesh.size, mesh=dict(self.mesh.shape), batch_size=t.batch_size, seq_len=cfg.data.seq_len,
        dtype=m.dtype, remat=m.remat, scan_layers=m.scan_layers, attention=m.attention.kernel,
        attention_used=attention_lib.select(m.attention.kernel, dtype=m.dtype, head_dim=m.head_dim,
                                            seq_len=cfg.data.seq_len)[0],
        params=model_lib.param_count(m), step_s=step_s, step_s_mean=statistics.fmean(times),
        step_s_min=min(times), tokens_per_s=tokens_per_s, flops_per_token=flops,
        model_flops_per_s=tokens_per_s * flops, matmul_dtype=m.matmul_dtype,
        mfu=None if fp8 else perf.mfu(tokens_per_s, flops, self.mesh.size, device.device_kind),
        mfu_causal=None if fp8 else perf.mfu(tokens_per_s, flops_causal, self.mesh.size, device.device_kind),
        compile_s=self.compile_s, loss=float(self.out['loss']),
        compiled_memory=perf.compiled_memory(self.compiled),
        runtime_memory=perf.device_memory_stats(), xla_flags=os.environ.get('XLA_FLAGS', ''),
        deterministic=bool(t.deterministic),
        host=platform.node(), load_average=os.getloadavg()[0])


def measure(cfg, steps: int, warmup: int, docs: int = 1) -> dict:
  """Compiles the train step for `cfg`, runs `warmup` + `steps` steps, and returns `Bench.result`."""
  bench = Bench(cfg, docs)
  for _ in range(warmup):
    bench.step()
  return bench.result([bench.step() for _ in range(steps)])


def _percent(x, r=None):
  if r is not None and r.get('matmul_dtype') == 'fp8':
    return 'n/a (fp8 matmuls: compare tokens/s and bf16-equivalent model FLOP/s, never MFU)'
  return 'n/a (unknown peak)' if x is None else f'{100 * x:.1f}%'


def table(r: dict) -> str:
  """The result as a two-column table."""
  peak_runtime = r['runtime_memory'].get('hbm_peak_bytes')
  rows = [
      ('device', f'{r["num_devices"]} × {r["device_kind"]} ({r["platform"]}), mesh {r["mesh"]}'),
      ('model', f'{r["params"]:,} parameters, {r["dtype"]}, remat={r["remat"]}, scan_layers={r["scan_layers"]}'
                + (', fp8 matmuls' if r['matmul_dtype'] == 'fp8' else '')),
      ('attention', f'{r["attention"]} -> {r["attention_used"]}'),
      ('batch', f'{r["batch_size"]} × {r["seq_len"]} tokens'),
      ('step time', f'{r["step_s"] * 1e3:.1f} ms median (mean {r["step_s_mean"] * 1e3:.1f}, '
                    f'min {r["step_s_min"] * 1e3:.1f})'),
      ('tokens/s', f'{r["tokens_per_s"]:,.0f} ({r["tokens_per_s"] / r["num_devices"]:,.0f} per device)'),
      ('model FLOP/s' + (' (bf16-equivalent)' if r['matmul_dtype'] == 'fp8' else ''),
       f'{r["model_flops_per_s"] / 1e12:.3f} TFLOP/s ({r["flops_per_token"] / 1e6:.1f} MFLOP/token)'),
      ('MFU', _percent(r['mfu'], r)),
      ('MFU (causal attention)', _percent(r['mfu_causal'], r)),
      ('peak device memory',
       perf.format_bytes(peak_runtime) if peak_runtime else 'n/a (backend keeps no stats)'),
      ('compiled memory', perf.format_memory(r['compiled_memory'])),
      ('compile', f'{r["compile_s"]:.1f} s'),
      ('loss after the timed steps', f'{r["loss"]:.3f}'),
      ('deterministic', f'train.deterministic={r["deterministic"]}'),
      ('XLA_FLAGS', r['xla_flags'] or '(none)'),
  ]
  width = max(len(k) for k, _ in rows)
  return '\n'.join(f'{k:<{width}}  {v}' for k, v in rows)


def _measure_torch(conn, cfg, steps: int, warmup: int, use_compile: bool) -> None:
  """The child process of `torch_baseline`: measures bench/torch_gpt.py's model and sends its result (or the error)."""
  try:
    sys.path.insert(0, str(pathlib.Path(__file__).absolute().parent))
    import torch  # pylint: disable=import-outside-toplevel  -- optional: only the baseline needs it
    import torch_gpt  # pylint: disable=import-outside-toplevel
    on_cpu = os.environ.get('JAX_PLATFORMS', '').startswith('cpu')  # the device JAX was told to use
    device = 'cuda' if torch.cuda.is_available() and not on_cpu else 'cpu'
    conn.send(torch_gpt.measure(cfg, steps, warmup, use_compile, device))
  except Exception as e:  # pylint: disable=broad-except  -- reported by the parent as one line
    conn.send(f'{type(e).__name__}: {e}')


def torch_baseline(cfg, steps: int, warmup: int, use_compile: bool) -> dict:
  """bench/torch_gpt.py's result for cfg's model, measured in a child process that ends before JAX starts.

  Why a child that runs first: XLA reserves most of a GPU's memory for the life of its process (75 % by default),
  so PyTorch beside it would run out of memory; ended, the child has given every byte back. And the child leaves
  glibc's malloc as PyTorch users have it (`JAXLM_KEEP_HOST_MEMORY=0`, see bench/cpu_step.py's TorchProcess).
  """
  context = multiprocessing.get_context('spawn')
  conn, child = context.Pipe()
  os.environ['JAXLM_KEEP_HOST_MEMORY'] = '0'  # inherited by the child, whose `import jaxlm` then leaves malloc be
  try:
    process = context.Process(target=_measure_torch, args=(child, cfg, steps, warmup, use_compile))
    process.start()
  finally:
    del os.environ['JAXLM_KEEP_HOST_MEMORY']
  try:
    result = conn.recv()
  except EOFError:
    result = f'the process died (exit code {process.join() or process.exitcode})'
  process.join()
  if isinstance(result, str):
    raise RuntimeError(f'the PyTorch baseline failed: {result}')
  return result


def baseline_rows(j: dict, t: dict) -> tuple[str, float]:
  """(jaxlm and torch as rows of one table, jaxlm/torch tokens/s per device)."""
  ratio = (j['tokens_per_s'] / j['num_devices']) / t['tokens_per_s']
  peak_note = j['matmul_dtype'] == 'fp8'
  torch_mfu = None if peak_note else perf.mfu(t['tokens_per_s'], t['flops_per_token'], 1, j['device_kind'])
  rows = [('framework', 'device', 'step ms (median)', 'tokens/s per device', 'model TFLOP/s', 'MFU'),
          (f'jaxlm (jax {j["jax"]}, {j["attention_used"]} attention, remat={j["remat"]}, '
           f'scan_layers={j["scan_layers"]}{", fp8" if peak_note else ""})',
           f'{j["num_devices"]} × {j["device_kind"]}', f'{j["step_s"] * 1e3:.1f}',
           f'{j["tokens_per_s"] / j["num_devices"]:,.0f}', f'{j["model_flops_per_s"] / j["num_devices"] / 1e12:.3f}',
           'n/a' if peak_note else _percent(j['mfu'])),
          (f'torch ({t["torch"]}, {t["mode"]}, '
           + ('float32' if j['dtype'] == 'float32' else f'{j["dtype"]} autocast, float32 master weights') + ')',
           f'1 × {t["device"]}', f'{t["step_s"] * 1e3:.1f}', f'{t["tokens_per_s"]:,.0f}',
           f'{t["model_flops_per_s"] / 1e12:.3f}', 'n/a' if peak_note else _percent(torch_mfu))]
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  text = '\n'.join('  '.join(f'{c:<{w}}' for c, w in zip(row, widths)) for row in rows)
  return text + f'\nratio jaxlm/torch (tokens/s per device): {ratio:.3f}', ratio


def set_deterministic(train_cfg) -> str:
  """train.deterministic as the trainer honours it (train.set_deterministic): XLA's deterministic GPU kernels,
  asked for before JAX starts its backend. Returns the XLA_FLAGS this run uses."""
  flags_now = os.environ.get('XLA_FLAGS', '')
  if train_cfg.deterministic and attention_lib.DETERMINISTIC_XLA_FLAGS not in flags_now.split():
    os.environ['XLA_FLAGS'] = f'{flags_now} {attention_lib.DETERMINISTIC_XLA_FLAGS}'.strip()
  return os.environ.get('XLA_FLAGS', '')


def main(argv):
  del argv
  cfg = _CONFIG.value
  xla_flags = set_deterministic(cfg.train)  # before the first JAX call starts the backend
  print(f'train.deterministic={cfg.train.deterministic}; XLA_FLAGS: {xla_flags or "(none)"}', flush=True)
  try:
    baseline = torch_baseline(cfg, FLAGS.steps, FLAGS.warmup, FLAGS.torch_compile) if FLAGS.baseline else None
    result = measure(cfg, FLAGS.steps, FLAGS.warmup, FLAGS.docs)
  except config_lib.ConfigError as e:
    print(f'mfu: {e}', file=sys.stderr)
    sys.exit(2)
  print(table(result), flush=True)
  if baseline is not None:
    if (baseline['device'] == 'cuda') != (result['platform'] == 'gpu'):
      print(f'WARNING: torch ran on {baseline["device"]} and jaxlm on {result["platform"]}: not the same device')
    text, ratio = baseline_rows(result, baseline)
    print(f'\nbaseline, same model, batches, optimizer and FLOPs formula (bench/torch_gpt.py):\n{text}', flush=True)
    result = dict(result, baseline=baseline, ratio=ratio)
  if FLAGS.json:
    pathlib.Path(FLAGS.json).write_text(json.dumps(result))


def define_flags():
  """This script's own flags; not defined on import, so bench/cpu_step.py can import the module."""
  flags.DEFINE_integer('steps', 10, 'Timed steps.')
  flags.DEFINE_integer('warmup', 3, 'Untimed steps first.')
  flags.DEFINE_integer('docs', 1, 'Documents per row of the random batches (>1 exercises segment masks).')
  flags.DEFINE_string('json', '', 'Also write the result as one JSON object to this file.')
  flags.DEFINE_enum('baseline', '', ['', 'torch'], 'torch: also measure bench/torch_gpt.py on the same device (first, '
                    'in a child process) and print both rows and the tokens/s ratio.')
  flags.DEFINE_bool('torch_compile', True, '--baseline=torch: torch.compile the model (eager when compiling fails).')


if __name__ == '__main__':
  define_flags()
  flags.mark_flag_as_required('config')
  app.run(main)
