"""Distillation against hard labels at a small size: held-out loss, tokens/s, memory per device.

  python bench/distill.py [--workdir=runs/bench_distill] [--teacher_steps=150] [--student_steps=30]

Trains a teacher (palm_tiny: D 64, 2 layers, vocabulary 512, on the stdlib corpus) once, then the same student
(D 32, 1 layer, rows of 32 tokens, seed 1) for --student_steps steps on the same batches: on hard labels
(train.objective=lm), and distilled (train.objective=distill) with beta 0 (forward KL), 0.5 and 1 on the full
vocabulary and beta 0 with top_k=16. Each through `jaxlm.train.run` on a mesh of 8 fake CPU devices, as the tests
run it (tests/test_distill_train.py checks the beta-0 ordering). Prints one row per student: held-out
cross-entropy, median tokens/s over the logged steps (the teacher's forward included), the compiled step's bytes
per device, and the teacher's parameter bytes per device (held beside the step, not inside it).
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
flags.DEFINE_integer('teacher_steps', 150, 'Teacher training steps.')
flags.DEFINE_integer('student_steps', 30, 'Student training steps (every student the same).')
FLAGS = flags.FLAGS
ROOT = pathlib.Path(__file__).absolute().parents[1]
STUDENTS = (('hard labels', 'lm', {}), ('beta 0 (forward KL)', 'distill', dict(beta=0.0)),
            ('beta 0.5 (JSD)', 'distill', dict(beta=0.5)), ('beta 1 (reverse KL)', 'distill', dict(beta=1.0)),
            ('beta 0, top_k 16', 'distill', dict(beta=0.0, top_k=16)))


def _config(**sections):
  c = cli.load_file(ROOT / 'configs' / 'palm_tiny.py')
  c.checkpoint.update(every=0, async_save=False)
  c.log.tensorboard = False
  for name, values in sections.items():
    c[name].update(values)
  config_lib.validate(c, jax.device_count())
  return c


def main(argv):
  del argv
  work = pathlib.Path(FLAGS.workdir)
  teacher = work / 'teacher'
  if not (teacher / 'checkpoints').exists():
    train.run(_config(train=dict(steps=FLAGS.teacher_steps, log_every=50, eval_every=0, eval_batches=2),
                      optim=dict(lr=1e-2, warmup_steps=10)), str(teacher))
  rows = []
  for name, objective, how in STUDENTS:
    cfg = _config(data=dict(seq_len=32), model=dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=64),
                  train=dict(objective=objective, steps=FLAGS.student_steps, batch_size=8, log_every=1, eval_every=0,
                             eval_batches=4, seed=1),
                  optim=dict(lr=1e-2, warmup_steps=5), distill=dict(dict(teacher=str(teacher), top_k=0), **how))
    out = work / name.replace(' ', '_').replace('(', '').replace(')', '').replace(',', '')
    shutil.rmtree(out, ignore_errors=True)  # every student from step 0
    last = train.run(cfg, str(out))
    records = rundir.read_metrics(str(out))
    speeds = [r['tokens_per_s'] for r in records if r.get('kind') == 'train' and r['step'] > 1]
    memory = next(r['total_bytes'] for r in records if r.get('kind') == 'system' and 'total_bytes' in r)
    held = '-'
    if objective == 'distill':
      mesh = sharding.make_mesh(cfg.mesh)
      t = distill.Teacher(ml_collections.ConfigDict(dict(cfg.distill)), mesh, sharding.batch_sharding(mesh))
      held = f'{sharding.bytes_per_device(t.abstract, t.shardings):,}'
    rows.append([name, f'{last["eval_loss"]:.4f}', f'{statistics.median(speeds):,.0f}', f'{memory:,}', held])
  teacher_loss = [r for r in rundir.read_metrics(str(teacher)) if r.get('kind') == 'eval'][-1]['eval_loss']
  print(f'teacher: held-out loss {teacher_loss:.4f} (rows of 64 tokens) after {FLAGS.teacher_steps} steps')
  print(format_table(rows, header=['student', 'held-out loss', 'tokens/s', 'step bytes/device', 'teacher bytes/device'],
                     right=(False, True, True, True, True)))


if __name__ == '__main__':
  app.run(main)
