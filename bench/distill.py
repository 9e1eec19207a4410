"""Distillation against hard labels at a small size: held-out loss, tokens/s, memory per device.

  python bench/distill.py [--workdir=runs/bench_distill] [--teacher=palm_small] [--teacher_steps=300]
                          [--student_steps=60] [--lora_steps=30]

Trains a teacher once (--teacher=palm_small: the demo model, 4 layers, D 256, vocabulary 4096, on the demo corpus,
the stdlib; --teacher=palm_tiny: D 64, 2 layers, vocabulary 512), then the same palm_tiny-sized student (D 64,
2 layers, the teacher's vocabulary, rows of 64 tokens, batch 8, seed 1) for --student_steps steps on the same
batches: on hard labels (train.objective=lm), and distilled (train.objective=distill) with beta 0 (forward KL),
0.5 and 1 on the full vocabulary and beta 0 with top_k=64. Then a LoRA student (rank 8 on the hard-label student's
final weights, checkpoint.init_from) for --lora_steps more steps, on hard labels and distilled (beta 0). Each
through `jaxlm.train.run` on a mesh of 8 fake CPU devices, as the tests run it (tests/test_distill_train.py checks
the beta-0 ordering). Prints one row per student: held-out cross-entropy, median tokens/s over the logged steps
(the teacher's forward included), the compiled train step's bytes per device (without the teacher: its
parameters are held beside the step) and the teacher's parameter bytes per device. --cache_k=16,64,512 measures
the bytes on disk per cached token of jaxlm.tools.teacher's cache instead (cache_bytes).
"""

import os
import pathlib
import shutil
import statistics
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
sys.path.insert(0, str(pathlib.Path(__file__).absolute().parents[1]))
import jaxlm  # noqa: E402,F401  first, as in `python -m jaxlm.train` (malloc settings)
from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import ml_collections  # noqa: E402

from jaxlm import cli, config as config_lib, distill, rundir, sharding, train  # noqa: E402
from jaxlm.metrics import format_table  # noqa: E402

flags.DEFINE_string('workdir', 'runs/bench_distill', 'Where the teacher and the students write their runs.')
flags.DEFINE_enum('teacher', 'palm_small', ['palm_small', 'palm_tiny'], 'The teacher\'s config (configs/<name>.py).')
flags.DEFINE_integer('teacher_steps', 300, 'Teacher training steps.')
flags.DEFINE_integer('student_steps', 60, 'Student training steps (every student the same).')
flags.DEFINE_integer('lora_steps', 30, 'LoRA student steps on the hard-label student (0: no LoRA rows).')
flags.DEFINE_string('cache_k', '', 'Instead: the bytes on disk per token of jaxlm.tools.teacher caches at these K '
                    '(e.g. 16,64,512), over the tests\' 48 synthetic conversations (tests/data/chat_fixtures.py).')
FLAGS = flags.FLAGS
ROOT = pathlib.Path(__file__).absolute().parents[1]
STUDENTS = (('hard labels', 'lm', {}), ('beta 0 (forward KL)', 'distill', dict(beta=0.0)),
            ('beta 0.5 (JSD)', 'distill', dict(beta=0.5)), ('beta 1 (reverse KL)', 'distill', dict(beta=1.0)),
            ('beta 0, top_k 64', 'distill', dict(beta=0.0, top_k=64)))
LORA = (('LoRA r8, hard labels', 'lm', {}), ('LoRA r8, beta 0', 'distill', dict(beta=0.0)))


def _config(name: str, **sections):
  c = cli.load_file(ROOT / 'configs' / f'{name}.py')
  c.checkpoint.update(every=0, async_save=False)
  c.log.tensorboard = False
  for section, values in sections.items():
    c[section].update(values)
  config_lib.validate(c, jax.device_count())
  return c


def _student(teacher: pathlib.Path, vocab: int, cap: float, objective: str, how: dict, steps: int, **extra):
  """The palm_tiny-sized student of the teacher's vocabulary and corpus cap (so its tokenizer); `extra`: more
  settings per section."""
  sections = dict(data=dict(seq_len=64, stdlib_max_mb=cap), model=dict(vocab_size=vocab, dtype='float32'),
                  train=dict(objective=objective, steps=steps, batch_size=8, log_every=1, eval_every=0,
                             eval_batches=4, seed=1),
                  optim=dict(lr=1e-2, warmup_steps=5), distill=dict(dict(teacher=str(teacher), top_k=0), **how))
  for section, values in extra.items():
    sections[section] = dict(sections.get(section, {}), **values)
  return _config('palm_tiny', **sections)


def _row(name: str, cfg, out: pathlib.Path) -> list:
  """Trains `cfg` into `out` from step 0 and measures it."""
  shutil.rmtree(out, ignore_errors=True)
  last = train.run(cfg, str(out))
  records = rundir.read_metrics(str(out))
  speeds = [r['tokens_per_s'] for r in records if r.get('kind') == 'train' and r['step'] > 1]
  memory = next(r['total_bytes'] for r in records if r.get('kind') == 'system' and 'total_bytes' in r)
  held = '-'
  if cfg.train.objective == 'distill':
    mesh = sharding.make_mesh(cfg.mesh)
    t = distill.Teacher(ml_collections.ConfigDict(dict(cfg.distill)), mesh, sharding.batch_sharding(mesh))
    held = f'{sharding.bytes_per_device(t.abstract, t.shardings):,}'
  return [name, f'{last["eval_loss"]:.4f}', f'{statistics.median(speeds):,.0f}', f'{memory:,}', held]


def _slug(name: str) -> str:
  return ''.join(ch for ch in name.replace(' ', '_') if ch.isalnum() or ch == '_')


def cache_bytes(work: pathlib.Path, ks: list[int]) -> None:
  """Prepares the tests' chat conversations (a byte-level BPE of ~400 entries, 20% held out), trains a palm_tiny-
  sized teacher 3 steps on them, caches its top-K for each K and prints the shards' bytes per cached position."""
  from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
  from jaxlm.data import pipeline as data_lib, prepare as prepare_lib  # pylint: disable=import-outside-toplevel
  from jaxlm.tools import teacher as teacher_tool  # pylint: disable=import-outside-toplevel
  from tests.data import chat_fixtures  # pylint: disable=import-outside-toplevel
  shutil.rmtree(work, ignore_errors=True)
  work.mkdir(parents=True)
  path = chat_fixtures.write_jsonl(work / 'chats.jsonl', chat_fixtures.conversations(48))
  data = str(work / 'data')
  prepare_lib.prepare(prepare_lib.expand_inputs([str(path)]), data, workers=1, eval_fraction=0.2, progress=False,
                      data_format='chat', tokenizer=chat_fixtures.make_tokenizer(str(work / 'tok')), seq_len=64)
  train.run(_config('palm_tiny', data=dict(source='prepared', paths=data), train=dict(steps=3, eval_batches=1),
                    optim=dict(warmup_steps=0)), str(work / 'teacher'))
  rows = []
  for k in ks:
    out = work / f'cache_{k}'
    teacher_tool.compute(str(work / 'teacher'), data, str(out), top_k=k)
    shards = [f for f in out.iterdir() if f.name != data_lib.TEACHER_MANIFEST]
    positions = 0
    for shard in shards:
      reader = array_record_module.ArrayRecordReader(str(shard), 'readahead_buffer_size:0')
      positions += sum(len(r) for r in reader.read_all()) // (4 * (2 * k + 1))  # teacher_record: n·4·(2K+1)
      reader.close()
    size = sum(f.stat().st_size for f in shards)
    rows.append([str(k), f'{positions:,}', f'{size:,}', f'{size / positions:,.1f}', f'{4 * (2 * k + 1):,}'])
  print(format_table(rows, header=['K', 'positions', 'shard bytes', 'bytes/position', '4(2K+1)'],
                     right=(True,) * 5))


def main(argv):
  del argv
  work = pathlib.Path(FLAGS.workdir)
  if FLAGS.cache_k:
    cache_bytes(work / 'cache', [int(k) for k in FLAGS.cache_k.split(',')])
    return
  teacher = work / 'teacher'
  if not (teacher / 'checkpoints').exists():
    train.run(_config(FLAGS.teacher, train=dict(steps=FLAGS.teacher_steps, eval_every=0)), str(teacher))
  saved = rundir.read_config(rundir.step_dir(str(teacher)))
  vocab, cap = saved.model.vocab_size, saved.data.stdlib_max_mb
  rows = []
  for name, objective, how in STUDENTS:
    cfg = _student(teacher, vocab, cap, objective, how, FLAGS.student_steps)
    rows.append(_row(name, cfg, work / _slug(name)))
  base = rundir.step_dir(str(work / _slug(STUDENTS[0][0])))  # the hard-label student's final weights
  for name, objective, how in LORA if FLAGS.lora_steps else ():
    cfg = _student(teacher, vocab, cap, objective, how, FLAGS.lora_steps, model=dict(lora=dict(rank=8)),
                   checkpoint=dict(init_from=base))
    rows.append(_row(name, cfg, work / _slug(name)))
  teacher_loss = [r for r in rundir.read_metrics(str(teacher)) if r.get('kind') == 'eval'][-1]['eval_loss']
  print(f'teacher {FLAGS.teacher}: held-out loss {teacher_loss:.4f} (rows of {saved.data.seq_len} tokens) after '
        f'{FLAGS.teacher_steps} steps')
  print(format_table(rows, header=['student', 'held-out loss', 'tokens/s', 'step bytes/device', 'teacher bytes/device'],
                     right=(False, True, True, True, True)))


if __name__ == '__main__':
  app.run(main)
