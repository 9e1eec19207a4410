"""Sampling speed: jaxlm's KV-cache sampler against decoding without a cache and against transformers' generate.

  python bench/generate.py [--config=configs/palm_small.py] [--batches=1,8] [--new=256] [--prompt_len=32]
                           [--repeats=3] [--no-transformers] [--json=FILE]

For each batch size, greedy decoding of `--new` tokens after random prompts of `--prompt_len` tokens (random
parameters in the config's shape, float32, no end-of-text so every row runs to the end), in one process:
  jaxlm cached   jaxlm.generate.generate: prefill tokens/s, decode tokens/s, and end to end (prefill + decode)
  no cache       jaxlm.generate.generate_without_cache: the full forward over the whole sequence for each token
  transformers   `generate(do_sample=False)` on the same weights' Hugging Face export (PyTorch, CPU)
Each is timed `--repeats` times (no cache: `--nocache_repeats`) after a first, compiling call (jaxlm's compile
time is reported apart); the median is shown. transformers runs in a child process (see transformers_generate). Ratios are end-to-end new tokens/s of the cached sampler over each baseline, and the greedy
tokens of all three are checked to agree.
"""

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxlm import cli  # noqa: E402
from jaxlm import generate as generate_lib  # noqa: E402
from jaxlm import model as model_lib  # noqa: E402
from jaxlm.hf import export as export_lib  # noqa: E402
from jaxlm.hf import import_llama  # noqa: E402


def random_params(cfg, seed: int = 0):
  """Parameters in the model's tree, drawn in numpy (embeddings N(0, 1) as PaLM's, matrices N(0, 1/D))."""
  m = model_lib.ModelConfig.from_config(cfg.model)
  x = np.zeros((1, 8), np.int32)
  shapes = jax.eval_shape(lambda: nn.unbox(model_lib.Decoder(m).init(jax.random.PRNGKey(0), x, x + 1, x)['params']))
  rng = np.random.default_rng(seed)

  def draw(path, s):
    name = jax.tree_util.keystr(path)
    if 'scale' in name:
      return np.ones(s.shape, np.float32)
    std = 1.0 if 'embedding' in name else cfg.model.d_model ** -0.5
    return (std * rng.standard_normal(s.shape)).astype(np.float32)
  return m, jax.tree_util.tree_map_with_path(draw, shapes)


def timed(fn, repeats: int):
  """(median seconds, last result) of `repeats` calls after one warm-up call."""
  fn()
  times, result = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    result = fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), result


_TRANSFORMERS = r"""
import json, os, statistics, sys, time
os.environ['HF_HUB_OFFLINE'] = '1'
import torch, transformers
hf_dir, prompts, new, repeats = json.loads(sys.argv[1])
model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
model.generation_config.eos_token_id = None  # random weights: never stop early
model.generation_config.pad_token_id = 0
ids = torch.tensor(prompts)
run = lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
times = []
with torch.no_grad():
  out = run()
  for _ in range(repeats):
    start = time.perf_counter()
    out = run()
    times.append(time.perf_counter() - start)
print(json.dumps({'seconds': statistics.median(times), 'tokens': out[:, ids.shape[1]:].tolist(),
                  'torch': f'{torch.__version__} ({torch.get_num_threads()} threads)'}))
"""


def transformers_generate(hf_dir: str, prompts, new: int, repeats: int) -> dict:
  """transformers' greedy generate timed in a child process: PyTorch under glibc's default malloc and threads,
  not jaxlm's (bench/cpu_step.py's TorchProcess does the same; in this process it ran several times slower)."""
  out = subprocess.run([sys.executable, '-c', _TRANSFORMERS, json.dumps([hf_dir, prompts, new, repeats])],
                       capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--config', default=str(ROOT / 'configs' / 'palm_small.py'))
  p.add_argument('--batches', default='1,8')
  p.add_argument('--new', type=int, default=256)
  p.add_argument('--prompt_len', type=int, default=32)
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--nocache_repeats', type=int, default=1)  # slow: one timed run after the compiling one
  p.add_argument('--transformers', action=argparse.BooleanOptionalAction, default=True)
  p.add_argument('--json', default=None)
  args = p.parse_args()

  cfg = cli.load_file(args.config)
  cfg.data.seq_len = max(cfg.data.seq_len, args.prompt_len + args.new)  # the export's max positions
  m, params = random_params(cfg)
  params = jax.device_put(params)
  hf_dir = None
  if args.transformers:
    tmp = tempfile.mkdtemp(prefix='jaxlm_bench_generate_')
    state = {'step': np.int32(1), 'params': jax.device_get(params), 'opt_state': {},
             'rng': np.asarray(jax.random.key_data(jax.random.PRNGKey(0)))}
    import_llama.write_checkpoint(os.path.join(tmp, 'run'), state, cfg.to_dict(), step=1)
    hf_dir = os.path.join(tmp, 'hf')
    export_lib.export(os.path.join(tmp, 'run'), hf_dir)

  rows, results, torch_version = [], [], None
  rng = np.random.default_rng(1)
  for batch in [int(b) for b in args.batches.split(',')]:
    prompts = rng.integers(1, m.vocab_size, (batch, args.prompt_len)).tolist()
    B, new = batch, args.new
    compile_s = generate_lib.generate(m, params, prompts, new).compile_seconds  # the first call compiles
    outs = []
    cached_s, out = timed(lambda: outs.append(generate_lib.generate(m, params, prompts, new)) or outs[-1],
                          args.repeats)
    # Medians of the timed calls' phases: prefill's logits give the first new token, the loop the rest.
    prefill_tps = B * args.prompt_len / statistics.median(o.prefill_seconds for o in outs[1:])
    decode_tps = B * (new - 1) / statistics.median(o.decode_seconds for o in outs[1:])
    cached_tps = B * new / cached_s
    nocache_s, ref = timed(lambda: generate_lib.generate_without_cache(m, params, prompts, new),
                           args.nocache_repeats)
    r = dict(batch=B, prompt_len=args.prompt_len, new=new, compile_s=compile_s,
             prefill_tokens_per_s=prefill_tps, decode_tokens_per_s=decode_tps, cached_tokens_per_s=cached_tps,
             no_cache_tokens_per_s=B * new / nocache_s, agree_no_cache=out.tokens == ref.tolist())
    if hf_dir is not None:
      hf = transformers_generate(hf_dir, prompts, new, args.repeats)
      torch_version = hf['torch']
      r.update(transformers_tokens_per_s=B * new / hf['seconds'], agree_transformers=out.tokens == hf['tokens'])
    results.append(r)
    ratio = lambda key: f'{cached_tps / r[key]:.1f}×' if key in r else 'n/a'
    rows.append((str(B), f'{prefill_tps:,.0f}', f'{decode_tps:,.0f}', f'{cached_tps:,.0f}',
                 f'{r["no_cache_tokens_per_s"]:,.0f}', ratio('no_cache_tokens_per_s'),
                 f'{r["transformers_tokens_per_s"]:,.0f}' if 'transformers_tokens_per_s' in r else 'n/a',
                 ratio('transformers_tokens_per_s'),
                 'yes' if r['agree_no_cache'] and r.get('agree_transformers', True) else 'NO'))
    print(f'batch {B} done', flush=True)

  device = jax.devices()[0]
  print(f'\n{cfg.get("name", args.config)}: {model_lib.param_count(m):,} parameters, prompt {args.prompt_len} + '
        f'{args.new} new tokens, greedy; {device.platform} ({device.device_kind}, {os.cpu_count()} cores, '
        f'{platform.processor() or platform.machine()}), JAX {jax.__version__}'
        + (f', torch {torch_version} in a child process' if torch_version else ''))
  header = ('batch', 'prefill tok/s', 'decode tok/s', 'cached end-to-end tok/s', 'no-cache tok/s',
            'cached / no-cache', 'transformers tok/s', 'cached / transformers', 'same tokens')
  print('| ' + ' | '.join(header) + ' |\n|' + ' --- |' * len(header))
  print('\n'.join('| ' + ' | '.join(row) + ' |' for row in rows))
  print('jaxlm compile (prefill + decode, per batch): ' + ', '.join(f'{r["compile_s"]:.1f}s' for r in results))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == '__main__':
  main()
