"""The pre-flight table of bench/RESULTS.md: each reference config compiled for its intended TPU target on this
machine (libtpu's compile-only devices; pip install 'jax[tpu]'), with the cheapest remat/microbatch setting that
fits (jaxlm.tools.size --fit's search).

  python bench/preflight.py [--only=palm_1b] [--fit]

One markdown row per target: mesh, remat, microbatches, bytes per chip, HBM, fits, compile time.
"""

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxlm import cli, perf, sharding  # noqa: E402
from jaxlm.tools import size  # noqa: E402

# (config, target, slices, chips named as sold[, mesh (data, fsdp, tensor[, expert]) per slice, batch size])
ROWS = [
    ('palm_1b', 'v5e:2x4', 1, 'v5e-8'),
    ('palm_1b', 'v5p:2x2x1', 1, 'v5p-8'),
    ('palm_1b', 'v6e:2x4', 1, 'v6e-8'),
    ('palm_8b', 'v4:4x4x2', 1, 'v4-64'),
    ('palm_8b', 'v5p:4x4x2', 1, 'v5p-64'),
    ('palm_62b', 'v4:8x8x8', 1, 'v4-1024'),
    # 1536 hosts: the batch must be a multiple of them (the config's 3072 is); 256000 vocab splits 16 ways, not 12.
    ('palm_540b', 'v4:16x16x12', 2, '2 × v4-6144 (PaLM)', (1, 192, 16)),
    # The families of #59 and #62 (their presets' own batch 16 and sequence length).
    ('gemma3_1b', 'v5e:2x4', 1, 'v5e-8'),
    ('olmo2_1b', 'v5e:2x4', 1, 'v5e-8'),
    ('mistral_7b', 'v5p:2x2x1', 1, 'v5p-8'),
    # 20.9B parameters: v5p-16's 8 chips need 112 GiB each for the step, whatever --fit tries (2026-12-02).
    ('gpt_oss_20b', 'v5p:2x2x4', 1, 'v5p-32'),
    ('deepseek_small', 'v5p:2x2x2', 1, 'v5p-16'),
    # 671B parameters and their Adam state are ~10.7 TB in float32. On v5p-512 (256 chips, 64 hosts: batch 64)
    # neither 32 fsdp × 8 tensor ways (124 GiB a chip) nor fsdp 4 × expert 8 × tensor 8 (102 GiB) fits
    # (2026-12-02); v5p-1024 halves the state a chip holds. Each of its 128 hosts reads one row.
    ('deepseek_v3', 'v5p:8x8x8', 1, 'v5p-1024', (1, 8, 8, 8), 128),
]


def row(name: str, target: str, slices: int, label: str, mesh=None, batch_size=None, *, fit: bool) -> str:
  cfg = cli.load_file(str(ROOT / 'configs' / f'{name}.py'))
  if mesh:
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.mesh.expert = (*mesh, 1)[:4]
  if batch_size:
    cfg.train.batch_size = batch_size
  started = time.perf_counter()
  devices = size.tpu_devices(target, slices)
  size.target_config(cfg, devices, slices)
  report = size.compile_step(cfg, devices)
  setting = {'remat': cfg.model.remat, 'microbatches': cfg.train.microbatches}
  if report['fits'] is False and fit:
    found, tried = size.fit_search(cfg, devices)
    if found:
      setting, report = found, tried[-1][1]
  sizes = sharding.MeshShape.resolve(cfg.mesh, len(devices)).sizes
  b = perf.format_bytes
  expert = f' (expert {cfg.mesh.expert})' if cfg.mesh.get('expert', 1) > 1 else ''
  where = f'{label} (`{target}`{f" ×{slices}" if slices > 1 else ""})'
  fits = 'yes' if report['fits'] else '**no**'
  return (f'| {name} | {where} | {sizes[0]}×{sizes[1]}×{sizes[2]}{expert} | {setting["remat"]} '
          f'| {setting["microbatches"]} | {b(report["memory"]["total_bytes"])} | {b(report["limit_bytes"])} '
          f'| {fits} | {report["kernel"]} | {report["compile_s"]:.0f} s | {time.perf_counter() - started:.0f} s |')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--only', default='', help='config name or target substring to run')
  parser.add_argument('--fit', action='store_true', help='search remat/microbatches when a row does not fit')
  args = parser.parse_args()
  print('| config | target | mesh d×f×t | remat | microbatches | step bytes/chip | HBM/chip | fits | attention '
        '| compile | wall (with --fit) |')
  print('| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |')
  for r in ROWS:
    if args.only and args.only not in r[0] and args.only not in r[1]:
      continue
    print(row(*r, fit=args.fit), flush=True)


if __name__ == '__main__':
  main()
