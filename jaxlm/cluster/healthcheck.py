"""Check every device and host before (re)starting a job: `python -m jaxlm.cluster.healthcheck [options]`.

Run by every process of the job, like the train command (the same launcher, the same cluster detection):
  matmul      on each local device: the same float32 product, timed (best of --iters) and checksummed;
  all-reduce  inside each host (its local devices: NVLink / ICI) timed, and across every device of every process
              (the data-centre network) with an exactly known sum.
Each device is compared with the median device and each host with the median host. A device is bad when its
checksum differs from the median's (a silently wrong chip), or its matmul takes more than --slow_factor times the
median; a host when its all-reduce is that slow, or the global sum it got is wrong. The bad ones are named
(process, host name, device id) and the exit code is 1 on every process, so that a supervisor or scheduler can
cordon them off before a restart; 0 means all healthy. The whole check ends with exit code 1 after --timeout
(a hung device or peer), never waiting forever.
"""

import argparse
import dataclasses
import pathlib
import socket
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxlm import cli
from jaxlm import distributed

_HOST_BYTES = 64  # host names travel between processes as fixed-size byte arrays


@dataclasses.dataclass
class Report:
  """The verdict, as every process computes it from the gathered measurements."""
  lines: list[str]  # one per device or host found bad
  summary: str

  @property
  def healthy(self) -> bool:
    return not self.lines


def _injected(inject: str, kind: str, key: int) -> bool:
  return bool(inject) and inject.split(':')[0] == kind and int(inject.split(':')[1]) == key


# A drill's slowdown (--inject slow / slowhost): far past --slow_factor times even a loaded machine's timings (a
# 2-core box running other jobs has measured 7 ms for the 8 fake devices' all-reduce; 50 ms was then too little).
INJECTED_DELAY_S = 0.5


def _delay(inject: str, kind: str, key: int) -> float:
  """The drill's slowdown when `inject` names this device or process, else none."""
  return INJECTED_DELAY_S if _injected(inject, kind, key) else 0.0


def _best_time(fn, iters: int, delay_s: float = 0.0) -> float:
  """Fastest of `iters` calls of fn (compiled first), in seconds; `delay_s` emulates a slow device."""
  jax.block_until_ready(fn())
  best = float('inf')
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    time.sleep(delay_s)
    best = min(best, time.perf_counter() - start)
  return best


def measure_devices(n: int, iters: int, inject: str = '') -> tuple[np.ndarray, np.ndarray]:
  """Per local device: (matmul seconds, column sums of the product); the inputs are the same everywhere."""
  rng = np.random.default_rng(0)
  a = rng.standard_normal((n, n), np.float32)
  b = rng.standard_normal((n, n), np.float32)
  matmul = jax.jit(lambda x, y: jnp.dot(x, y, precision='highest'))
  times, sums = [], []
  for d in jax.local_devices():
    x, y = jax.device_put(a, d), jax.device_put(b, d)
    times.append(_best_time(lambda: matmul(x, y), iters, _delay(inject, 'slow', d.id)))
    column_sums = np.asarray(matmul(x, y), np.float64).sum(axis=0)
    if _injected(inject, 'wrong', d.id):
      column_sums[n // 3] += 0.1 * np.abs(column_sums).max()  # one corrupted column, as from a flaky multiplier
    sums.append(column_sums)
  return np.asarray(times), np.stack(sums)


def measure_host(iters: int, inject: str = '') -> float:
  """Seconds for an all-reduce over this host's devices only."""
  local = jax.local_devices()
  mesh = Mesh(np.asarray(local), ('d',))
  x = jax.device_put(np.ones((len(local), 1 << 16), np.float32), NamedSharding(mesh, P('d')))
  total = jax.jit(lambda v: v.sum(axis=0), out_shardings=NamedSharding(mesh, P()))
  return _best_time(lambda: total(x), iters, _delay(inject, 'slowhost', jax.process_index()))


def measure_global(iters: int) -> tuple[float, bool]:
  """(seconds, correct) for an all-reduce over every device of every process; device i contributes i + 1."""
  mesh = Mesh(np.asarray(jax.devices()), ('d',))
  sharding = NamedSharding(mesh, P('d'))
  count = jax.device_count()
  x = jax.make_array_from_callback((count, 1 << 12), sharding,
                                   lambda index: np.full((1, 1 << 12), index[0].start + 1, np.float32))
  total = jax.jit(lambda v: v.sum(axis=0), out_shardings=NamedSharding(mesh, P()))
  seconds = _best_time(lambda: total(x), iters)
  got = np.asarray(total(x).addressable_data(0))
  return seconds, bool(np.all(got == count * (count + 1) / 2))  # small integers: exact in float32


def _median(x: np.ndarray) -> float:
  # The lower median is one of the measurements: with two hosts it is the faster one, not their average.
  return float(np.quantile(x, 0.5, method='lower'))


def judge(hosts: list[str], device_ids: np.ndarray, times: np.ndarray, sums: np.ndarray, host_times: np.ndarray,
          global_ok: np.ndarray, *, slow_factor: float, rtol: float) -> Report:
  """Names the devices and hosts that differ from the median. Arrays are (processes, local devices[, N])."""
  lines = []
  median_time = _median(times)
  median_sums = np.quantile(sums.reshape(-1, sums.shape[-1]), 0.5, axis=0, method='lower')
  scale = max(float(np.abs(median_sums).max()), 1e-30)
  for p, host in enumerate(hosts):
    for k, device in enumerate(device_ids[p]):
      where = f'process {p} ({host}) device {device}'
      error = float(np.abs(sums[p, k] - median_sums).max()) / scale
      if not np.all(np.isfinite(sums[p, k])) or error > rtol:
        lines.append(f'{where}: WRONG matmul result, {error:.2e} from the median device (tolerance {rtol:g})')
      if times[p, k] > slow_factor * median_time:
        lines.append(f'{where}: SLOW matmul, {times[p, k] * 1e3:.2f} ms = {times[p, k] / median_time:.1f}× the '
                     f'median {median_time * 1e3:.2f} ms')
  median_host = _median(host_times)
  for p, host in enumerate(hosts):
    if host_times[p] > slow_factor * median_host:
      lines.append(f'process {p} ({host}): SLOW all-reduce over its devices, {host_times[p] * 1e3:.2f} ms = '
                   f'{host_times[p] / median_host:.1f}× the median host {median_host * 1e3:.2f} ms')
    if not global_ok[p]:
      lines.append(f'process {p} ({host}): WRONG result from the all-reduce across processes')
  summary = (f'{times.size} devices on {len(hosts)} hosts: matmul median {median_time * 1e3:.2f} ms, '
             f'all-reduce in a host median {median_host * 1e3:.2f} ms')
  return Report(lines, summary)


def check(*, size: int = 0, iters: int = 5, slow_factor: float = 3.0, rtol: float = 1e-3, inject: str = '') -> Report:
  """Measures on this process, gathers every process's numbers, and judges them (the same on all).

  size: matmul N (0 = 256 on CPUs, 4096 on accelerators). inject (tests and drills): "slow:<device id>",
  "wrong:<device id>" or "slowhost:<process>" makes that one look bad.
  """
  n = size or (256 if jax.devices()[0].platform == 'cpu' else 4096)
  times, sums = measure_devices(n, iters, inject)
  host_time = measure_host(iters, inject)
  global_time, global_ok = measure_global(iters)
  name = np.frombuffer(socket.gethostname().encode()[:_HOST_BYTES].ljust(_HOST_BYTES, b'\0'), np.uint8)
  ids = np.asarray([d.id for d in jax.local_devices()], np.int32)
  mine = dict(times=times, sums=sums, host_time=np.float64(host_time), global_ok=np.bool_(global_ok), name=name,
              ids=ids)
  if jax.process_count() > 1:
    gathered = {k: np.asarray(v) for k, v in multihost_utils.process_allgather(mine).items()}
  else:
    gathered = {k: np.asarray(v)[None] for k, v in mine.items()}
  hosts = [bytes(row).rstrip(b'\0').decode(errors='replace') for row in gathered['name']]
  report = judge(hosts, gathered['ids'], gathered['times'], gathered['sums'], gathered['host_time'],
                 gathered['global_ok'], slow_factor=slow_factor, rtol=rtol)
  report.summary += f', all-reduce across all {global_time * 1e3:.2f} ms'
  return report


def main(argv: list[str] | None = None) -> int:
  """Joins the job's other processes, checks, prints the verdict from process 0; returns the exit code."""
  p = argparse.ArgumentParser(prog='python -m jaxlm.cluster.healthcheck', description=__doc__.split('\n')[0])
  p.add_argument('--size', type=int, default=0, help='matmul size N (N×N float32); 0 = 256 on CPUs, 4096 else')
  p.add_argument('--iters', type=int, default=5, help='timed repetitions; the fastest counts')
  p.add_argument('--slow_factor', type=float, default=3.0, help='slower than this many times the median = bad')
  p.add_argument('--rtol', type=float, default=1e-3, help='largest checksum difference from the median, relative')
  p.add_argument('--timeout', type=float, default=600.0, help='exit 1 if not finished after this many seconds')
  p.add_argument('--inject', default='', help='tests and drills: slow:<device>, wrong:<device>, slowhost:<process>')
  p.add_argument('--initialize', default='auto', choices=('auto', 'always', 'never'),
                 help='join the other processes as dist.initialize says (always: on TPU VMs made with gcloud)')
  args = p.parse_args(argv)
  # The dist section of the base config: the same cluster detection and timeouts as training.
  base = pathlib.Path(__file__).resolve().parents[2] / 'configs' / 'base.py'
  dist_cfg = cli.load_file(base).dist
  dist_cfg.initialize = args.initialize
  dist_cfg.step_timeout_s = 0  # no training steps here: the check's own watchdog below bounds it
  distributed.initialize(dist_cfg)
  watchdog = distributed.Watchdog(args.timeout, 'the health check did not finish', exit_code=1)
  watchdog.beat('the start of the check')
  report = check(size=args.size, iters=args.iters, slow_factor=args.slow_factor, rtol=args.rtol, inject=args.inject)
  watchdog.stop()
  if jax.process_index() == 0:
    print(f'healthcheck: {report.summary}')
    for line in report.lines:
      print(f'healthcheck: BAD {line}')
    print('healthcheck: ' + ('all healthy' if report.healthy else
                             f'{len(report.lines)} problem(s): cordon the named devices/hosts off before restarting'),
          flush=True)
  return 0 if report.healthy else 1


def console() -> None:
  """The `jaxlm-...` console command (pyproject.toml [project.scripts])."""
  sys.exit(main())


if __name__ == '__main__':
  console()
