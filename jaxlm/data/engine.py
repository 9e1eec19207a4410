"""Where prepare's tasks run: this process, a local process pool, or a Ray cluster. Same tasks, same output.

An engine maps a module-level function over argument tuples and yields (index, result) as tasks finish. Tasks
are idempotent (a shard task skips a shard that exists), so a task that Ray retries after its worker died, or a
rerun after the driver died, writes the same bytes. Ray is used through its task API, not `ray.data`'s readers and
sinks: their row order is the engine's, and the shards here must not depend on it.
"""

import multiprocessing
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures

from jaxlm import errors

ENGINES = ('local', 'ray')  # --engine


class Local:
  """Tasks in this process (workers=1) or in a pool of spawned processes."""

  def __init__(self, workers: int):
    self.workers = workers
    self.pool = None
    if workers > 1:
      # spawn, not fork: the caller may be a training process with JAX's threads running. An executor, not a
      # multiprocessing.Pool: a worker that dies (e.g. an unguarded calling script) raises instead of hanging.
      self.pool = futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context('spawn'))

  def where(self) -> str:
    return f'local:{socket.gethostname()}'

  def map(self, fn: Callable, args: Sequence[tuple], window: int = 0) -> Iterator[tuple[int, object]]:
    """(index, fn(*args[index])) in completion order; at most `window` tasks in flight (0 = 2 per worker)."""
    if self.pool is None:
      for i, a in enumerate(args):
        yield i, fn(*a)
      return
    window = window or 2 * self.workers
    pending, nxt = {}, 0
    try:
      while nxt < len(args) or pending:
        while nxt < len(args) and len(pending) < window:
          pending[self.pool.submit(fn, *args[nxt])] = nxt
          nxt += 1
        done, _ = futures.wait(pending, return_when=futures.FIRST_COMPLETED)
        for f in done:
          yield pending.pop(f), f.result()
    except futures.process.BrokenProcessPool as e:
      raise errors.DataError('a prepare worker process died. If you call prepare from a script, guard the script '
                             'with `if __name__ == "__main__":` (workers are spawned and re-import it), or pass '
                             'workers=1.') from e

  def close(self) -> None:
    if self.pool is not None:
      self.pool.shutdown(cancel_futures=True)


def init_ray(address: str = '', *, where: str = '--ray_address', **init_kwargs):
  """ray.init on the cluster at `address` (host:port of its head), or on a Ray instance started here; the module.

  A head that nobody answers at is refused in seconds, as one line naming `where` the address came from; ray.init
  alone retries for minutes first."""
  import ray  # pylint: disable=g-import-not-at-top  (the caller has said how to install it)
  if ray.is_initialized():
    return ray
  try:
    if address and '://' not in address and address != 'auto':  # a head's host:port (not Ray Client's ray://)
      host, _, port = address.rpartition(':')
      socket.create_connection((host, int(port)), timeout=5).close()
    ray.init(address=address or None, include_dashboard=False, logging_level='WARNING', log_to_driver=False,
             **init_kwargs)
  except (OSError, RuntimeError, ValueError) as e:  # ConnectionError is an OSError
    raise errors.StorageError(f'cannot reach the Ray cluster at {address or "(local)"} ({e}); check {where} '
                              f'(host:port of the head node) and that the cluster runs') from e
  return ray


class Ray:
  """Tasks on a Ray cluster (`address`), or on a Ray instance started here when no address is given."""

  def __init__(self, address: str = '', workers: int = 0):
    try:
      import ray  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise errors.DataError('--engine=ray needs Ray; pip install "jaxlm[ray]" (or use --engine=local)') from None
    self.started = not ray.is_initialized()
    self.ray = init_ray(address, **({} if address else {'num_cpus': workers or None}))
    self.workers = workers or int(ray.cluster_resources().get('CPU', 1))
    self._remote = {}

  def where(self) -> str:
    return f'ray:{self.ray.get_runtime_context().get_node_id()}'

  def map(self, fn: Callable, args: Sequence[tuple], window: int = 0) -> Iterator[tuple[int, object]]:
    """(index, result) as Ray tasks finish; a task whose worker dies is retried by Ray (the task is idempotent)."""
    ray = self.ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # pylint: disable=g-import-not-at-top
    if fn not in self._remote:
      self._remote[fn] = ray.remote(num_cpus=1, max_retries=3)(fn)
    remote = self._remote[fn]
    # Tasks dealt round robin over the nodes with CPUs (soft: a busy or lost node's task runs elsewhere): the tasks
    # share no data, and Ray's default packs a short burst of them onto the driver's node.
    nodes = sorted(n['NodeID'] for n in ray.nodes() if n['Alive'] and n['Resources'].get('CPU'))
    window = window or 2 * self.workers
    pending, nxt = {}, 0
    try:
      while nxt < len(args) or pending:
        while nxt < len(args) and len(pending) < window:
          place = NodeAffinitySchedulingStrategy(nodes[nxt % len(nodes)], soft=True) if nodes else 'DEFAULT'
          pending[remote.options(scheduling_strategy=place).remote(*args[nxt])] = nxt
          nxt += 1
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
          yield pending.pop(ref), ray.get(ref)
    finally:
      for ref in pending:
        ray.cancel(ref)

  def close(self) -> None:
    if self.started:
      self.ray.shutdown()


def make(engine: str, *, workers: int = 0, ray_address: str = ''):
  """The engine named by --engine."""
  if engine == 'local':
    return Local(workers or os.cpu_count() or 1)
  if engine == 'ray':
    return Ray(ray_address, workers)
  raise errors.DataError(f'engine={engine!r} is unknown; use one of {", ".join(ENGINES)}')
