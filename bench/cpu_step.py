"""jaxlm against the PyTorch baseline on the same device, in the same run: tokens/s, model FLOP/s, the ratio.

  python bench/cpu_step.py --config=configs/palm_small.py [--config.model.x=y ...] --steps=20 --warmup=3

Builds both in one process: the real jaxlm train step (bench/mfu.py: step.build_program, compiled ahead of time) and
the same model in PyTorch (bench/torch_gpt.py, torch.compile), then times them step for step in alternation:
jaxlm, torch, torch, jaxlm, ... Each pair of steps runs within a second or two of each other, so other work on a
shared machine slows both alike, and the median of the per-pair ratios is the figure to quote. Only one
framework computes at a time; the other's threads sleep. Both count model FLOPs with
jaxlm.model.flops_per_token. XLA_FLAGS from the environment apply to jaxlm as usual.
"""

import functools
import json
import multiprocessing
import os
import pathlib
import statistics
import sys
import time

if '--device=gpu' not in sys.argv:
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # before JAX starts: both frameworks on the host CPU

sys.path.insert(0, str(pathlib.Path(__file__).absolute().parents[1]))
import jaxlm  # noqa: E402,F401  first, as in `python -m jaxlm.train`: sets up malloc before JAX (jaxlm/malloc.py)
from absl import app, flags  # noqa: E402
import jax  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).absolute().parent))
import mfu  # noqa: E402  (defines --config, through jaxlm.train)
import torch_gpt  # noqa: E402
from jaxlm import model as model_lib  # noqa: E402

_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps of each framework, alternating.')
_WARMUP = flags.DEFINE_integer('warmup', 3, 'Untimed steps of each first (after compilation).')
_DEVICE = flags.DEFINE_string('device', 'cpu', 'cpu, or gpu (torch on cuda, JAX on its GPU backend).')
_COMPILE = flags.DEFINE_bool('compile', True, 'torch.compile the PyTorch model (eager on failure).')
_JSON = flags.DEFINE_string('json', '', 'Also write both results and the paired ratios to this file.')
_TORCH_PROCESS = flags.DEFINE_bool('torch_process', True, 'Run PyTorch in a child process with default malloc '
                                   '(see TorchProcess); false: in this process, under jaxlm\'s malloc settings.')
_PHASES = flags.DEFINE_bool('phases', False, 'Also time the forward pass alone and forward + backward alone, '
                            'in alternation as the steps: which part of the step a gap comes from.')


def _row(name: str, r: dict) -> tuple:
  best = r['tokens_per_s'] * r['step_s'] / r['step_s_min']
  flops = r['flops_per_token']
  return (name, f'{r["step_s_min"] * 1e3:.0f} / {r["step_s"] * 1e3:.0f}', f'{best:,.0f} / {r["tokens_per_s"]:,.0f}',
          f'{best * flops / 1e9:.1f} / {r["model_flops_per_s"] / 1e9:.1f}')


def jaxlm_phases(jaxlm) -> dict:
  """Forward-only and forward+backward callables of the jaxlm model on one batch, each returning its seconds."""
  model = jaxlm.program.model

  def loss(params, b):
    logits = model.apply({'params': params}, b['inputs'], b['segment_ids'], b['positions'])
    return model_lib.loss_fn(logits, b['targets'], b['weights'], model.config.z_loss)[0]

  with jaxlm._context():  # pylint: disable=protected-access
    batch = jaxlm.batches[0]
    params = jax.tree.map(lambda a: a.copy(), jaxlm.state.params)  # the step donates the state's buffers
    compiled = {'forward': jax.jit(loss).lower(params, batch).compile(),
                'forward + backward': jax.jit(jax.grad(loss)).lower(params, batch).compile()}

  def timed(fn):
    start = time.perf_counter()
    jax.block_until_ready(fn(params, batch))
    return time.perf_counter() - start
  return {name: functools.partial(timed, fn) for name, fn in compiled.items()}


def time_phases(jaxlm, torch, steps: int, warmup: int) -> list[tuple]:
  """(phase, jaxlm ms, torch ms, ratio) medians, the two frameworks called in alternation as in `main`."""
  rows = []
  for phase, j in jaxlm_phases(jaxlm).items():
    t = functools.partial(torch.phase, phase)
    for _ in range(warmup):
      j(), t()
    times = {j: [], t: []}
    for i in range(steps):
      for fn in ((j, t) if i % 2 == 0 else (t, j)):
        times[fn].append(fn())
    pairs = [tt / tj for tj, tt in zip(times[j], times[t])]
    rows.append((phase, statistics.median(times[j]) * 1e3, statistics.median(times[t]) * 1e3,
                 statistics.median(pairs)))
  return rows


def _serve_torch(conn, cfg, use_compile: bool, device: str) -> None:
  """The child process of TorchProcess: builds torch_gpt.Bench, then answers calls until told to stop."""
  bench = torch_gpt.Bench(cfg, use_compile, device)
  methods = {'ready': lambda: True, 'step': bench.step, 'phase': bench.phase, 'result': bench.result}
  while (message := conn.recv())[0] != 'stop':
    conn.send(methods[message[0]](*message[1:]))


class TorchProcess:
  """torch_gpt.Bench in a process of its own, with glibc's default malloc; step/phase/result as Bench's.

  Why: `import jaxlm` sets malloc up for XLA (jaxlm/malloc.py: one arena, no mmap), which PyTorch users do not
  have; the baseline runs as they run it. The child times its own steps (the pipe's round trip is not counted)
  and waits while jaxlm runs, so the two still alternate step by step.
  """

  def __init__(self, cfg, use_compile: bool, device: str):
    context = multiprocessing.get_context('spawn')
    self._conn, child = context.Pipe()
    os.environ['JAXLM_KEEP_HOST_MEMORY'] = '0'  # inherited by the child, whose `import jaxlm` then leaves malloc be
    try:
      self._process = context.Process(target=_serve_torch, args=(child, cfg, use_compile, device), daemon=True)
      self._process.start()
    finally:
      del os.environ['JAXLM_KEEP_HOST_MEMORY']
    self._call('ready')

  def _call(self, *message):
    self._conn.send(message)
    return self._conn.recv()

  def step(self) -> float:
    return self._call('step')

  def phase(self, name: str) -> float:
    return self._call('phase', name)

  def result(self, times: list[float]) -> dict:
    return self._call('result', times)

  def close(self) -> None:
    self._conn.send(('stop',))
    self._process.join()


def main(argv):
  del argv
  cfg = mfu._CONFIG.value  # pylint: disable=protected-access
  load_before = os.getloadavg()[0]
  jaxlm = mfu.Bench(cfg)
  device = 'cuda' if _DEVICE.value == 'gpu' else 'cpu'
  torch = (TorchProcess if _TORCH_PROCESS.value else torch_gpt.Bench)(cfg, _COMPILE.value, device)
  for _ in range(_WARMUP.value):
    jaxlm.step()
    torch.step()
  times = {'jaxlm': [], 'torch': []}
  for i in range(_STEPS.value):
    order = ('jaxlm', 'torch') if i % 2 == 0 else ('torch', 'jaxlm')  # neither always goes first
    for name in order:
      times[name].append((jaxlm if name == 'jaxlm' else torch).step())
  j, t = jaxlm.result(times['jaxlm']), torch.result(times['torch'])
  pairs = [tt / tj for tj, tt in zip(times['jaxlm'], times['torch'])]  # jaxlm/torch throughput, pair by pair

  print(f'\n{cfg.name}: {cfg.train.batch_size} × {cfg.data.seq_len} tokens, {cfg.model.dtype}, {j["params"]:,} '
        f'parameters, {j["flops_per_token"] / 1e6:.1f} MFLOP/token (PaLM formula), device {j["device_kind"]}, '
        f'{_STEPS.value} alternating steps each, load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}')
  rows = [('framework', 'step ms min / median', 'tokens/s best / median', 'model GFLOP/s best / median'),
          _row(f'jaxlm (jax {j["jax"]}, {j["attention_used"]} attention, remat={j["remat"]}, '
               f'scan_layers={j["scan_layers"]})', j),
          _row(f'torch ({t["torch"]}, {t["mode"]}, {t["threads"]} threads)', t)]
  widths = [max(len(r[i]) for r in rows) for i in range(4)]
  for row in rows:
    print('  '.join(f'{c:<{w}}' for c, w in zip(row, widths)))
  ratio = statistics.median(pairs)
  print(f'ratio jaxlm/torch in tokens/s (= in model FLOP/s): {ratio:.2f} (median of {len(pairs)} step pairs; '
        f'quartiles {statistics.quantiles(pairs, n=4)[0]:.2f}-{statistics.quantiles(pairs, n=4)[2]:.2f}); '
        f'fastest steps {t["step_s_min"] / j["step_s_min"]:.2f}; medians {t["step_s"] / j["step_s"]:.2f}')
  phases = []
  if _PHASES.value:
    phases = time_phases(jaxlm, torch, _STEPS.value, _WARMUP.value)
    rows = [('phase', 'jaxlm ms median', 'torch ms median', 'jaxlm/torch (paired)')]
    rows += [(p, f'{j:.1f}', f'{t:.1f}', f'{r:.2f}') for p, j, t, r in phases]
    rows.append(('whole train step', f'{j["step_s"] * 1e3:.1f}', f'{t["step_s"] * 1e3:.1f}', f'{ratio:.2f}'))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
      print('  '.join(f'{c:<{w}}' for c, w in zip(row, widths)))
  if _TORCH_PROCESS.value:
    torch.close()
  if _JSON.value:
    pathlib.Path(_JSON.value).write_text(json.dumps(dict(jaxlm=j, torch=t, times=times, pair_ratios=pairs, phases=phases)))


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main)
