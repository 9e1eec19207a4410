"""Cleans a raw corpus with datatrove before prepare: language → quality (Gopher, C4, FineWeb) → MinHash dedup.

  python -m jaxlm.data.clean --inputs=raw/ --out=data/clean --languages=en [--executor=local|ray|slurm]
  python -m jaxlm.data.prepare --inputs=data/clean --out=data/prepared

The stages are datatrove's, in the order of the FineWeb recipe (Penedo et al. 2024):

  1 filter     readers (parquet, jsonl, jsonl.gz) → language id → GopherRepetitionFilter → GopherQualityFilter
               → C4QualityFilter (without its terminal-punctuation rule, as FineWeb) → FineWebQualityFilter
               → .work/filtered/*.jsonl.gz
  2 signature  MinhashDedupSignature over the filtered documents (the same reader and tasks as stage 5)
  3 buckets    MinhashDedupBuckets
  4 cluster    MinhashDedupCluster: one survivor per cluster of near-duplicates (exact copies included)
  5 write      MinhashDedupFilter → ParquetWriter: --out/*.parquet with a `text` column (what prepare and
               data.source=stream read)

Language id: --lid=ft176 (datatrove's LanguageFilter, fastText's lid.176 model, fetched once by datatrove) for
production; --lid=py3langid runs offline (its model ships in the wheel: the tests use it). Scratch files and
datatrove's logs go to --out/.work (hidden: prepare's directory search skips it). A rerun skips the tasks that
finished (datatrove's own completion markers), so an interrupted clean resumes.
"""

import collections
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence

from absl import app
from absl import flags

from jaxlm import cli
from jaxlm import errors
from jaxlm.data import engine
from jaxlm.data import readers

try:  # the one module that needs datatrove: a missing one is reported by clean(), as one line
  from datatrove.pipeline.filters.base_filter import BaseFilter
except ImportError:
  BaseFilter = object

EXECUTORS = ('local', 'ray', 'slurm')
LIDS = ('ft176', 'py3langid')


class CleanError(errors.DataError):
  """Input or settings that clean cannot use; the message says what to change."""


def ray_runtime_env(runtime_env: dict | None = None) -> dict:
  """`runtime_env` (a new dict) with the worker setup hook a Ray job that cleans needs: ray.init(runtime_env=...).

  Every Ray worker of the job runs the hook when it starts (a public runtime_env field, named by module path; Ray
  honours it for a job, not for one actor). A new dict each call: ray.init adds its own keys to the one it gets.
  """
  return {**(runtime_env or {}), 'worker_process_setup_hook': 'jaxlm.data.clean.default_sigterm_in_forks'}


def default_sigterm_in_forks() -> None:
  """Forks the processes of a Ray worker with SIGTERM's default action (the kernel ends them), not Ray's handler.

  datatrove runs an actor's ranks in a forked multiprocess Pool; at the pool's exit the parent SIGTERMs the
  workers still waiting for work and joins them. A worker forked with a Python-level SIGTERM handler (the Ray
  worker's) that is signalled before it has finished starting loses the signal: the handler only marks it, and
  CPython clears those marks in a new child. That worker then waits on the pool's lock for ever, and so does the
  join. So the handler is set aside in the parent for the fork itself: the child starts with the default action
  (no Python involved), and the Ray worker gets its own handler back at once. Main thread only: Python sets
  handlers nowhere else (a fork from another thread keeps Ray's handler, as before).
  """
  saved = []

  def before():
    if threading.current_thread() is threading.main_thread():
      saved.append(signal.signal(signal.SIGTERM, signal.SIG_DFL))

  def after_in_parent():
    if saved:
      signal.signal(signal.SIGTERM, saved.pop())

  os.register_at_fork(before=before, after_in_parent=after_in_parent, after_in_child=saved.clear)


def _ray_job() -> None:
  """Starts Ray with ray_runtime_env() (the cluster at RAY_ADDRESS, else a local one), or checks the caller's job."""
  ray = engine.init_ray(os.environ.get('RAY_ADDRESS', ''), where='RAY_ADDRESS', runtime_env=ray_runtime_env())
  if not ray.get_runtime_context().runtime_env.get('worker_process_setup_hook'):
    raise CleanError('this Ray job was started without a worker setup hook, and datatrove\'s rank pools can then '
                     'hang at exit; ray.init(..., runtime_env=jaxlm.data.clean.ray_runtime_env()) (a hook of your '
                     'own must call jaxlm.data.clean.default_sigterm_in_forks)')


def _datatrove():
  try:
    import datatrove  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise CleanError('cleaning needs datatrove; pip install "jaxlm[clean]"') from None


class Py3LangIdFilter(BaseFilter):
  """Keeps documents whose language py3langid names among `languages` with probability > `threshold` (offline:
  the model is in its wheel); sets metadata language / language_score as datatrove's LanguageFilter does."""
  name = '🌍 Language ID (py3langid)'

  def __init__(self, languages: Sequence[str], threshold: float = 0.65):
    super().__init__()
    self.languages, self.threshold, self._id = list(languages), threshold, None

  def filter(self, doc) -> bool:
    if self._id is None:  # loaded in the worker, not pickled with the pipeline
      from py3langid.langid import MODEL_FILE, LanguageIdentifier  # pylint: disable=g-import-not-at-top
      self._id = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    lang, score = self._id.classify(doc.text)
    doc.metadata['language'], doc.metadata['language_score'] = lang, float(score)
    return lang in self.languages and score > self.threshold


def _readers(sources: list, text_field: str, work: str) -> list:
  """datatrove readers for the inputs: one per kind, given its files by a paths file (datatrove deals a
  reader's files over the tasks)."""
  from datatrove.pipeline.readers import JsonlReader, ParquetReader  # pylint: disable=g-import-not-at-top
  by_kind = collections.defaultdict(list)
  for s in sources:
    kind = readers._kind(s.path)  # pylint: disable=protected-access
    if kind == 'txt':
      raise CleanError(f'{s.path}: clean reads parquet and jsonl (.gz) inputs; convert txt to jsonl first')
    by_kind[kind].append(os.path.abspath(s.path))
  out = []
  os.makedirs(work, exist_ok=True)
  for kind, paths in sorted(by_kind.items()):
    root = os.path.commonpath([os.path.dirname(p) for p in paths])
    listing = os.path.join(work, f'inputs-{kind}.txt')
    with open(listing, 'w') as f:
      f.write(''.join(os.path.relpath(p, root) + '\n' for p in paths))
    reader = ParquetReader if kind == 'parquet' else JsonlReader
    out.append(reader(root, paths_file=listing, text_key=text_field))
  return out


def pipelines(sources: list, out: str, *, languages: Sequence[str], lid: str = 'ft176',
              text_field: str = 'text', lid_threshold: float = 0.65) -> list[tuple[str, list, int | None]]:
  """The five stages as (name, datatrove pipeline, tasks or None = the input tasks)."""
  from datatrove.pipeline.dedup import (MinhashDedupBuckets, MinhashDedupCluster,  # pylint: disable=g-import-not-at-top
                                        MinhashDedupFilter, MinhashDedupSignature)
  from datatrove.pipeline.dedup.minhash import MinhashConfig  # pylint: disable=g-import-not-at-top
  from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter,  # pylint: disable=g-import-not-at-top
                                          GopherQualityFilter, GopherRepetitionFilter, LanguageFilter)
  from datatrove.pipeline.readers import JsonlReader  # pylint: disable=g-import-not-at-top
  from datatrove.pipeline.writers import JsonlWriter, ParquetWriter  # pylint: disable=g-import-not-at-top

  work = os.path.join(out, '.work')
  lang = (LanguageFilter(languages=list(languages), language_threshold=lid_threshold) if lid == 'ft176'
          else Py3LangIdFilter(languages, lid_threshold))
  minhash = MinhashConfig()  # 14 buckets x 8 hashes of word 5-grams: FineWeb's (≈ 0.75 Jaccard and up)
  filtered = lambda: JsonlReader(os.path.join(work, 'filtered'))  # noqa: E731  the same sharding in 2 and 5
  return [
      ('filter', [*_readers(sources, text_field, work), lang, GopherRepetitionFilter(), GopherQualityFilter(),
                  C4QualityFilter(filter_no_terminal_punct=False), FineWebQualityFilter(),
                  JsonlWriter(os.path.join(work, 'filtered'))], None),
      ('signature', [filtered(), MinhashDedupSignature(os.path.join(work, 'signatures'), config=minhash)], None),
      ('buckets', [MinhashDedupBuckets(os.path.join(work, 'signatures'), os.path.join(work, 'buckets'),
                                       config=minhash)], minhash.num_buckets),
      ('cluster', [MinhashDedupCluster(os.path.join(work, 'buckets'), os.path.join(work, 'remove_ids'),
                                       config=minhash)], 1),
      ('write', [filtered(), MinhashDedupFilter(os.path.join(work, 'remove_ids')),
                 ParquetWriter(out, output_filename='${rank}.parquet')], None),
  ]


def clean(sources: list, out: str, *, languages: Sequence[str], executor: str = 'local', tasks: int = 0,
          workers: int = 0, lid: str = 'ft176', text_field: str = 'text', slurm: dict | None = None,
          tasks_per_job: int = 1) -> dict:
  """Runs the stages on `executor`; returns the counts of what each kept (datatrove's stats, summed)."""
  _datatrove()
  if executor not in EXECUTORS:
    raise CleanError(f'executor={executor!r} is unknown; use one of {", ".join(EXECUTORS)}')
  if lid not in LIDS:
    raise CleanError(f'lid={lid!r} is unknown; use one of {", ".join(LIDS)}')
  if executor == 'ray':
    try:
      import ray  # pylint: disable=g-import-not-at-top,unused-import
    except ImportError:
      raise CleanError('--executor=ray needs Ray; pip install "jaxlm[ray]"') from None
    _ray_job()
  tasks = tasks or len(sources)
  work = os.path.join(out, '.work')
  previous = None
  for name, pipeline, stage_tasks in pipelines(sources, out, languages=languages, lid=lid, text_field=text_field):
    n = stage_tasks or tasks
    logs = os.path.join(work, 'logs', name)
    if executor == 'local':
      from datatrove.executor import LocalPipelineExecutor  # pylint: disable=g-import-not-at-top
      ex = LocalPipelineExecutor(pipeline, tasks=n, workers=min(workers or os.cpu_count() or 1, n),
                                 logging_dir=logs, start_method='spawn')
      ex.run()
    elif executor == 'ray':
      from datatrove.executor import RayPipelineExecutor  # pylint: disable=g-import-not-at-top
      # tasks_per_job > 1 runs several datatrove tasks in one Ray task: fewer, longer Ray tasks for small inputs.
      ex = RayPipelineExecutor(pipeline, tasks=n, workers=workers or -1, logging_dir=logs, mem_per_cpu_gb=0.25,
                               tasks_per_job=tasks_per_job)
      ex.run()
    else:
      from datatrove.executor import SlurmPipelineExecutor  # pylint: disable=g-import-not-at-top
      # Slurm stages are submitted as jobs that depend on each other; this command returns once they are queued.
      ex = SlurmPipelineExecutor(pipeline, tasks=n, logging_dir=logs, depends=previous, job_name=f'clean-{name}',
                                 **(slurm or {}))
      previous = ex
      if name == 'write':
        ex.run()
  return {} if executor == 'slurm' else _stats(work)


def _stats(work: str) -> dict:
  """Documents in and out of each stage, from datatrove's stats.json files."""
  out = {}
  for name in ('filter', 'write'):
    path = os.path.join(work, 'logs', name, 'stats.json')
    if os.path.exists(path):
      with open(path) as f:
        out[name] = [{'name': s.get('name'), 'stats': {k: v for k, v in s.get('stats', {}).items()
                                                       if isinstance(v, int | float)}} for s in json.load(f)]
  return out


FLAGS = flags.FLAGS


def _define_flags() -> None:
  flags.DEFINE_list('inputs', [], 'parquet / jsonl / jsonl.gz files, directories and globs, comma-separated.')
  flags.DEFINE_string('out', '', 'Output directory: *.parquet with a `text` column (scratch in OUT/.work).')
  flags.DEFINE_list('languages', ['en'], 'Languages to keep (ISO 639-1 codes).')
  flags.DEFINE_enum('executor', 'local', EXECUTORS, 'Where datatrove runs the stages (ray: the cluster Ray '
                    'connects to, e.g. RAY_ADDRESS; slurm: jobs, see --slurm_partition).')
  flags.DEFINE_enum('lid', 'ft176', LIDS, 'Language id: ft176 (datatrove, fastText lid.176) or py3langid (offline).')
  flags.DEFINE_string('text_field', 'text', 'Field (jsonl) or column (parquet) holding the text.')
  flags.DEFINE_integer('tasks', 0, 'datatrove tasks per stage (0 = one per input file).')
  flags.DEFINE_integer('workers', 0, 'Tasks run at once (0 = cores, local; all, ray).')
  flags.DEFINE_integer('ray_tasks_per_job', 1, 'ray: datatrove tasks run in one Ray task (more: less overhead).')
  flags.DEFINE_string('slurm_partition', '', 'slurm: the partition.')
  flags.DEFINE_string('slurm_time', '24:00:00', 'slurm: time limit per job.')


def main(argv: Sequence[str]) -> None:
  """`python -m jaxlm.data.clean`: exit 0 when done, 2 on input or settings it cannot use."""
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not FLAGS.inputs or not FLAGS.out:
    raise CleanError('--inputs and --out are required; e.g. --inputs=raw/ --out=data/clean')
  slurm = {'partition': FLAGS.slurm_partition, 'time': FLAGS.slurm_time} if FLAGS.executor == 'slurm' else None
  stats = clean(readers.expand_inputs(FLAGS.inputs), FLAGS.out, languages=FLAGS.languages,
                executor=FLAGS.executor, tasks=FLAGS.tasks, workers=FLAGS.workers, lid=FLAGS.lid,
                text_field=FLAGS.text_field, slurm=slurm, tasks_per_job=FLAGS.ray_tasks_per_job)
  print(json.dumps(stats), file=sys.stdout)


def console() -> None:
  """The command line (also the console script in pyproject.toml)."""
  cli.run(main, define=_define_flags)


if __name__ == '__main__':
  console()
