"""Mixture of experts: tokens/s and active-parameter MFU of a MoE config, against its dense twin, in one run.

  python bench/moe.py --config=configs/moe_1b.py --steps=10 --warmup=2 [--config.model.x=y ...]

Four rows, each the real train step (bench/mfu.py's `measure`) on random batches:
  dropless   the config as given (tokens sorted by expert, grouped GEMMs through ragged_dot)
  capacity   the same with model.moe_capacity_factor=1.0: fixed per-expert buffers; at the near-balanced routing
             of a freshly initialised router, what dropless costs over it is the price of ragged groups
  one-hot    the same with model.moe_impl=dense: every expert on every token, a one-hot combine (X/k times the
             routed FLOPs in plain einsums; the test reference, and on a CPU the faster path: see RESULTS)
  dense      the dense model with the same active parameters: one SwiGLU as wide as k experts (plus the shared
             ones), the router gone
MFU counts active parameters (model.flops_per_token). On a device with no known peak (a CPU) MFU is n/a and the
table says so; tokens/s and the ratios still compare the rows, measured in the same process.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).absolute().parent))
import mfu  # noqa: E402  (bench/mfu.py: imports jaxlm first, as the trainer does)

from absl import app, flags  # noqa: E402

from jaxlm import model as model_lib  # noqa: E402

_CONFIG = mfu._CONFIG  # --config (a MoE config: model.moe_experts > 0), defined once by bench/mfu.py
flags.DEFINE_integer('steps', 10, 'Timed steps per row.')
flags.DEFINE_integer('warmup', 2, 'Untimed steps per row first.')
FLAGS = flags.FLAGS


def rows(cfg) -> dict:
  """{'dropless', 'capacity', 'one-hot', 'dense'}: result, for the MoE config `cfg`."""
  m = cfg.model
  capacity = cfg.copy_and_resolve_references()
  capacity.model.moe_capacity_factor = 1.0
  one_hot = cfg.copy_and_resolve_references()
  one_hot.model.moe_impl = 'dense'
  dense = cfg.copy_and_resolve_references()
  width = (m.moe_top_k + m.moe_shared_experts) * (m.moe_mlp_dim or model_lib.mlp_dim(m))
  dense.model.update(moe_experts=0, mlp_dim=width)
  return {name: mfu.measure(c, FLAGS.steps, FLAGS.warmup) for name, c in
          (('dropless', cfg), ('capacity', capacity), ('one-hot', one_hot), ('dense', dense))}


def main(argv):
  del argv
  cfg = _CONFIG.value
  if cfg is None or not cfg.model.moe_experts:
    raise app.UsageError('--config must be a mixture of experts (model.moe_experts > 0).')
  results = rows(cfg)
  first = results['dropless']
  on = f'{first["num_devices"]} × {first["device_kind"]} ({first["platform"]})'
  print(f'{cfg.name} on {on}, batch {first["batch_size"]} × {first["seq_len"]}'
        + ('   [CPU: no peak, MFU n/a; ratios only]' if first['platform'] == 'cpu' else ''))
  header = f'{"row":<10} {"params":>14} {"tokens/s":>12} {"active MFU":>11} {"step ms":>9} {"vs dense":>9}'
  print(header)
  dense_tps = results['dense']['tokens_per_s']
  for name, r in results.items():
    print(f'{name:<10} {r["params"]:>14,} {r["tokens_per_s"]:>12,.0f} {mfu._percent(r["mfu"]):>11} '
          f'{r["step_s"] * 1e3:>9.1f} {r["tokens_per_s"] / dense_tps:>8.2f}×')
  print(f'dropless overhead over capacity 1.0: '
        f'{results["capacity"]["tokens_per_s"] / first["tokens_per_s"] - 1:+.1%} tokens/s')


if __name__ == '__main__':
  app.run(main)
