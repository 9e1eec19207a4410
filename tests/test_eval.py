"""Evaluation: bits per byte from decoded text, sampling, and the real entry points on a tiny trained run."""

import json
import math
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxlm import eval as eval_lib
from jaxlm import model as model_lib
from tests.helpers import load_config, train_env
from tests.conftest import ROOT


def test_text_bytes_decodes_each_document_run_and_skips_padding():
  pieces = {1: 'a', 2: 'é', 3: '日', 4: ''}  # 1, 2 and 3 UTF-8 bytes; 4 is a separator that decodes to nothing
  decode = lambda ids: ''.join(pieces[i] for i in ids)
  batch = {'targets': np.array([[1, 2, 4, 3, 1, 1]]), 'segment_ids': np.array([[1, 1, 1, 2, 2, 0]]),
           'weights': np.array([[1, 1, 1, 1, 1, 0]], np.float32)}
  assert eval_lib.text_bytes(batch, decode) == 1 + 2 + 0 + 3 + 1  # the padded last target is not counted


def test_summarize():
  r = eval_lib.summarize(nats=100 * math.log(2), tokens=50, num_bytes=25)
  assert r['loss'] == pytest.approx(2 * math.log(2))
  assert r['perplexity'] == pytest.approx(4.0)
  assert r['bits_per_byte'] == pytest.approx(4.0)


def test_generate_greedy_is_the_argmax_of_the_full_forward_and_sampling_is_seeded():
  cfg = load_config('palm_tiny')
  cfg.model.update(vocab_size=61, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=24)
  model = model_lib.Decoder(model_lib.ModelConfig.from_config(cfg.model))
  prompt = [5, 9, 2]
  seq = np.array([prompt + [0] * 6], np.int32)
  shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.PRNGKey(0), seq, seq + 1, seq)['params']))
  rng = np.random.default_rng(0)  # numpy draws: a compiled init costs seconds here
  params = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32) * 0.3, shapes)
  out = eval_lib.generate(model, params, prompt, 6)
  seq = np.array([prompt + out], np.int32)
  logits = jax.jit(model.apply)({'params': params}, seq, np.ones_like(seq), np.arange(seq.shape[1])[None])
  assert out == np.asarray(logits)[0, len(prompt) - 1:-1].argmax(-1).tolist()
  sampled = eval_lib.generate(model, params, prompt, 6, temperature=1.0, seed=3)
  assert sampled == eval_lib.generate(model, params, prompt, 6, temperature=1.0, seed=3)
  assert sampled != eval_lib.generate(model, params, prompt, 6, temperature=1.0, seed=4)
  stop = out[1]
  assert eval_lib.generate(model, params, prompt, 6, stop_id=stop) == out[:out.index(stop) + 1]  # stops after it


@pytest.fixture(scope='module')
def tiny_run(tmp_path_factory, data_cache):
  """A palm_tiny run trained for a few steps by the real trainer (stdlib corpus); returns (workdir, metrics)."""
  from jaxlm import train
  cfg = load_config('palm_tiny')
  cfg.data.cache_dir = str(data_cache)
  cfg.train.update(steps=6, eval_batches=2, log_every=3)
  cfg.optim.warmup_steps = 2
  cfg.checkpoint.update(every=0, async_save=False)
  cfg.log.update(tensorboard=False, compilation_cache='')
  workdir = tmp_path_factory.mktemp('tiny_run')
  return str(workdir), train.run(cfg, str(workdir))


def test_eval_entry_point_reproduces_the_trainers_held_out_loss(tiny_run):
  workdir, trained = tiny_run
  out = subprocess.run([sys.executable, '-m', 'jaxlm.eval', f'--workdir={workdir}', '--json', '--prompt=def ',
                        '--max_tokens=8'], cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert r['step'] == 6 and r['batches'] == 2
  assert r['loss'] == pytest.approx(trained['eval_loss'], rel=1e-4)  # same held-out batches, same params
  assert r['perplexity'] == pytest.approx(math.exp(r['loss']), rel=1e-6)
  # A byte-fallback SentencePiece model on source code: a few bytes per token, so bpb is well below loss/ln2.
  assert 1.0 < r['bytes'] / r['tokens'] < 8
  assert r['bits_per_byte'] == pytest.approx(r['loss'] * r['tokens'] / math.log(2) / r['bytes'], rel=1e-6)
  assert isinstance(r['continuation'], str)


def test_export_entry_point_ships_the_runs_tokenizer(tiny_run, tmp_path):
  workdir, _ = tiny_run
  out = subprocess.run([sys.executable, '-m', 'jaxlm.export', f'--workdir={workdir}', f'--out={tmp_path}'],
                       cwd=ROOT, env=train_env(1), capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'CohereForCausalLM' in out.stdout
  for name in ('model.safetensors', 'config.json', 'tokenizer.model', 'tokenizer_config.json'):
    assert (tmp_path / name).exists(), (name, out.stdout)
