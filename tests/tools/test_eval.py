"""Evaluation: bits per byte from decoded text, sampling, scoring given documents, the real entry points on a tiny
trained run, and lm-evaluation-harness on its export against jaxlm's own numbers (e2e, needs `.[eval]`)."""

import json
import math
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from jaxlm.data import pipeline as data_lib
from jaxlm.tools import eval as eval_lib
from jaxlm.hf import export as export_lib
from jaxlm import model as model_lib
from tests.helpers import assert_fails_with, load_config, run_cli
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


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
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


def train_tiny_run(workdir, data_cache, sample_prompts=()):
  """palm_tiny trained 6 steps by the real trainer (stdlib corpus), every step logged, evaluated on 2 held-out
  batches at steps 3 and 6; with `sample_prompts`, greedy samples at each evaluation (and TensorBoard)."""
  from jaxlm import train
  cfg = load_config('palm_tiny')
  cfg.data.cache_dir = str(data_cache)
  cfg.train.update(steps=6, eval_every=3, eval_batches=2, log_every=1, sample_prompts=tuple(sample_prompts),
                   sample_tokens=8)
  cfg.optim.warmup_steps = 2
  cfg.checkpoint.update(every=0, async_save=False)
  cfg.log.update(tensorboard=bool(sample_prompts), compilation_cache='')
  return train.run(cfg, str(workdir))


def shared_tiny_run(tmp_path_factory, data_cache) -> tuple[str, dict]:
  """(workdir, its last eval record) of train_tiny_run without samples, made once for the whole run (every xdist
  worker included): this module's run and tests/tools/test_generate.py's run without samples."""
  from tests.conftest import made_once
  from tests.helpers import read_records
  with made_once(tmp_path_factory, 'tools_tiny_run') as (path, done):
    if not done:
      train_tiny_run(path, data_cache)
  return str(path), read_records(path, 'eval')[-1]


@pytest.fixture(scope='module')
def tiny_run(tmp_path_factory, data_cache):
  """A palm_tiny run trained for a few steps by the real trainer (stdlib corpus); returns (workdir, the metrics of
  its last evaluation)."""
  return shared_tiny_run(tmp_path_factory, data_cache)


def test_eval_entry_point_reproduces_the_trainers_held_out_loss(tiny_run):
  workdir, trained = tiny_run
  out = run_cli('jaxlm.tools.eval', f'--workdir={workdir}', '--json', '--prompt=def ', '--max_tokens=8', timeout=300)
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
  out = run_cli('jaxlm.hf.export', f'--workdir={workdir}', f'--out={tmp_path}', devices=1, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'CohereForCausalLM' in out.stdout
  for name in ('model.safetensors', 'config.json', 'tokenizer.model', 'tokenizer_config.json'):
    assert (tmp_path / name).exists(), (name, out.stdout)


def test_rolling_windows_score_every_token_once_after_one_start_token():
  S = 99  # the start token
  assert eval_lib.rolling_windows(list(range(1, 11)), S, 4) == [
      ([S, 1, 2, 3], [1, 2, 3, 4], 4),
      ([4, 5, 6, 7], [5, 6, 7, 8], 4),
      ([6, 7, 8, 9], [7, 8, 9, 10], 2)]  # the last window keeps a full context; only its 2 new targets count
  assert eval_lib.rolling_windows([7, 8], S, 4) == [([S, 7], [7, 8], 2)]
  assert eval_lib.rolling_windows(list(range(1, 9)), S, 4)[1] == ([4, 5, 6, 7], [5, 6, 7, 8], 4)


def test_window_batches_give_each_window_its_own_segment_and_pad_the_last_batch():
  windows = eval_lib.rolling_windows(list(range(1, 11)), 99, 4) + eval_lib.rolling_windows([7, 8], 99, 4)
  batches = eval_lib.window_batches(windows, 4, batch_size=3)
  assert len(batches) == 2 and batches[0]['inputs'].shape == (3, 4)
  assert sum(float(b['weights'].sum()) for b in batches) == 10 + 2  # every document token once
  rows = np.concatenate([b['segment_ids'] for b in batches])
  assert rows[:3].tolist() == [[1] * 4, [1] * 4, [1] * 4] and rows[3].tolist() == [1, 1, 0, 0]
  assert not rows[4:].any()  # padding rows
  third = {k: np.concatenate([b[k] for b in batches])[2] for k in ('targets', 'weights', 'positions')}
  assert third['weights'].tolist() == [0, 0, 1, 1] and third['targets'][2:].tolist() == [9, 10]
  assert third['positions'].tolist() == [0, 1, 2, 3]
  # Short windows share a row, each a separate segment with positions from 0.
  packed = eval_lib.window_batches([([9, 1], [1, 2], 2), ([9, 3], [3, 4], 2)], 4, batch_size=1)[0]
  assert packed['segment_ids'].tolist() == [[1, 1, 2, 2]] and packed['positions'].tolist() == [[0, 1, 0, 1]]


def test_read_documents_reads_txt_jsonl_and_parquet_as_prepare_does(tmp_path):
  (tmp_path / 'a.txt').write_bytes(b'\xef\xbb\xbfline one\r\nline two\r\n')
  records = [{'body': 'def f():\n  return 1\n'}, {'body': '  '}]
  (tmp_path / 'b.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
  assert eval_lib.read_documents([str(tmp_path / 'a.txt'), str(tmp_path / 'b.jsonl')], text_field='body') == [
      'line one\nline two\n', 'def f():\n  return 1\n']  # BOM and CRLF cleaned, the blank record dropped
  assert eval_lib.read_documents([str(tmp_path / 'a.txt')], txt_docs='lines') == ['line one', 'line two']
  assert eval_lib.read_documents([str(tmp_path)], max_documents=1) == ['line one\nline two\n']  # a dir, sorted
  pq = pytest.importorskip('pyarrow.parquet', reason='pyarrow is not installed: pip install -e ".[test]"')
  import pyarrow as pa
  pq.write_table(pa.table({'text': ['x = 1\n', 'y = "é"\n']}), str(tmp_path / 'c.parquet'))
  assert eval_lib.read_documents([str(tmp_path / '*.parquet')]) == ['x = 1\n', 'y = "é"\n']
  with pytest.raises(eval_lib.EvalError, match='holds no documents'):
    eval_lib.read_documents([str(tmp_path / 'b.jsonl')])  # no 'text' field


def test_score_documents_equals_each_window_scored_alone(tiny_run):
  """Packed windows (several per row, as segments) give the same nats as one plain forward per window."""
  workdir, _ = tiny_run
  path = export_lib.step_dir(workdir)
  cfg = export_lib.read_config(path)
  texts = ['import os\n', 'def f(x):\n    return {"ü": x * 2}  # 日本\n' * 6, 'print("hi")\n']
  r = eval_lib.score_documents(workdir, texts)
  tok = data_lib.load_tokenizer(cfg.data, cfg.model.vocab_size)
  T = cfg.data.seq_len
  windows = [w for t in texts for w in eval_lib.rolling_windows(tok.encode(t), tok.eos_id, T)]
  assert r['windows'] == len(windows) > len(texts)  # the long text needs several windows
  model = model_lib.Decoder(model_lib.ModelConfig.from_config(cfg.model))
  params = export_lib.read_params(path)
  apply = jax.jit(model.apply)
  nats = 0.0
  for inputs, targets, scored in windows:
    x = np.array([inputs], np.int32)
    logits = np.asarray(apply({'params': params}, x, np.ones_like(x), np.arange(len(inputs))[None]), np.float64)
    top = logits[0].max(-1, keepdims=True)
    logp = logits[0] - top - np.log(np.exp(logits[0] - top).sum(-1, keepdims=True))
    nats -= sum(logp[i, targets[i]] for i in range(len(inputs) - scored, len(inputs)))
  assert r['tokens'] == sum(len(tok.encode(t)) for t in texts) and r['documents'] == 3
  assert r['bytes'] == sum(len(t.encode('utf-8')) for t in texts)
  assert r['loss'] * r['tokens'] == pytest.approx(nats, rel=1e-5)
  assert r['bits_per_byte'] == pytest.approx(nats / math.log(2) / r['bytes'], rel=1e-5)


def _eval_cli(*args, timeout=300):
  return run_cli('jaxlm.tools.eval', *args, devices=1, timeout=timeout)


def test_documents_and_write_jsonl_entry_points(tiny_run, tmp_path):
  workdir, _ = tiny_run
  out = _eval_cli(f'--workdir={workdir}', f'--write_jsonl={tmp_path}/heldout.jsonl', '--max_documents=2')
  assert out.returncode == 0, out.stderr[-3000:]
  lines = (tmp_path / 'heldout.jsonl').read_text(encoding='utf-8').splitlines()
  assert len(lines) == 2 and all(json.loads(line)['text'].strip() for line in lines)
  assert f'--documents={tmp_path}/heldout.jsonl' in out.stdout
  (tmp_path / 'more.txt').write_text('for i in range(3):\n    print(i)\n')
  out = _eval_cli(f'--workdir={workdir}', f'--documents={tmp_path}/heldout.jsonl,{tmp_path}/*.txt', '--json')
  assert out.returncode == 0, out.stderr[-3000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  texts = [json.loads(line)['text'] for line in lines] + ['for i in range(3):\n    print(i)\n']
  assert r['documents'] == 3 and r['bytes'] == sum(len(t.encode('utf-8')) for t in texts)
  assert r['perplexity'] == pytest.approx(math.exp(r['loss']), rel=1e-6)
  assert r['bits_per_byte'] == pytest.approx(r['loss'] * r['tokens'] / math.log(2) / r['bytes'], rel=1e-6)


@pytest.mark.parametrize('make, args, says', [
    (None, ['--documents=/nonexistent/docs.jsonl'], 'neither a file'),
    (('empty.jsonl', '{"body": "x"}\n'), ['--documents={}'], 'holds no documents'),
    (None, ['--write_jsonl=out.jsonl'], 'holds no checkpoint'),
])
def test_eval_user_errors_end_with_one_line_and_exit_2(tmp_path, make, args, says):
  file = ''
  if make:
    file = str(tmp_path / make[0])
    (tmp_path / make[0]).write_text(make[1])
  workdir = tmp_path / 'no_run'
  out = _eval_cli(f'--workdir={workdir}', *[a.format(file) for a in args], timeout=120)
  assert_fails_with(out, 2, says)


@pytest.fixture(scope='module')
def lm_eval_api(tmp_path_factory):
  """(lm_eval, HFLM, TaskManager), imported offline with a private datasets cache; skipped without `.[eval]`."""
  saved = {k: os.environ.get(k) for k in ('HF_DATASETS_OFFLINE', 'HF_HUB_OFFLINE', 'HF_DATASETS_CACHE')}
  # Before `datasets` is imported: it reads these once. The json builder needs no network.
  os.environ.update(HF_DATASETS_OFFLINE='1', HF_HUB_OFFLINE='1',
                    HF_DATASETS_CACHE=str(tmp_path_factory.mktemp('hf_datasets')))
  reason = 'lm-evaluation-harness is not installed: pip install -e ".[eval]"'
  try:
    lm_eval = pytest.importorskip('lm_eval', reason=reason)
    pytest.importorskip('accelerate', reason=reason)
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    yield lm_eval, HFLM, TaskManager
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


@pytest.mark.e2e
def test_lm_eval_on_the_export_agrees_with_jaxlm_eval(lm_eval_api, tiny_run, tmp_path, monkeypatch):
  """The README's lm-eval recipe, offline: the shipped tasks on an export, bits per byte as jaxlm.tools.eval's."""
  lm_eval, HFLM, TaskManager = lm_eval_api
  workdir, _ = tiny_run
  export_lib.export(workdir, str(tmp_path / 'hf'))
  cfg = export_lib.read_config(export_lib.step_dir(workdir))
  texts = eval_lib.heldout_documents(cfg, max_documents=3)
  eval_lib.write_jsonl(str(tmp_path / 'documents.jsonl'), texts)  # where the shipped task reads it (cwd)
  ours = eval_lib.score_documents(workdir, texts)
  assert ours['windows'] > len(texts)  # held-out files are longer than one window: rolling windows are exercised
  # jaxlm's shipped tasks alone, as jaxlm.harness indexes them: lm-eval's registry of thousands of YAMLs (two
  # thirds of this test's CPU time) holds none of them.
  tasks = TaskManager(include_path=eval_lib.TASKS_DIR, include_defaults=False)
  tok = data_lib.load_tokenizer(cfg.data, cfg.model.vocab_size)

  # Bits per byte: lm-eval puts the start token (the exported BOS = EOS) before each document itself, so the
  # tokenizer must not (add_bos_token=False); then both sides score [EOS] + the document in the same windows.
  lm = HFLM(pretrained=str(tmp_path / 'hf'), dtype='float32', add_bos_token=False, batch_size=8, device='cpu')
  assert lm.prefix_token_id == tok.eos_id and lm.max_length == cfg.data.seq_len
  assert lm.tok_encode(texts[0]) == tok.encode(texts[0])  # no second start token
  monkeypatch.chdir(tmp_path)
  out = lm_eval.simple_evaluate(model=lm, tasks=['jaxlm_documents'], task_manager=tasks, bootstrap_iters=0)
  theirs = out['results']['jaxlm_documents']['bits_per_byte,none']
  print(f'\nbits per byte on {len(texts)} held-out documents: lm-eval {theirs:.6f}, jaxlm.tools.eval '
        f'{ours["bits_per_byte"]:.6f} (relative difference {abs(theirs / ours["bits_per_byte"] - 1):.1e})')
  assert theirs == pytest.approx(ours['bits_per_byte'], rel=1e-2)
  # Same windows and start token, float32 on both sides: they agree far closer than 1% (float rounding only).
  # A doubled start token can move the total by less than 1%; the tok_encode check above is what rules it out.
  assert theirs == pytest.approx(ours['bits_per_byte'], rel=1e-5)

  # Multiple choice: a non-empty context is encoded with the tokenizer's start token, so add_bos_token=True
  # gives exactly one. The task's data path is relative to the repository root.
  lm = HFLM(pretrained=str(tmp_path / 'hf'), dtype='float32', add_bos_token=True, batch_size=8, device='cpu')
  assert lm.tok_encode('import os') == [tok.eos_id] + tok.encode('import os')
  monkeypatch.chdir(ROOT)
  out = lm_eval.simple_evaluate(model=lm, tasks=['jaxlm_code_mc'], task_manager=tasks, bootstrap_iters=0)
  with open(os.path.join(eval_lib.TASKS_DIR, 'jaxlm_code_mc.jsonl')) as f:
    questions = [json.loads(line) for line in f]
  samples = out['samples']['jaxlm_code_mc']
  assert len(samples) == len(questions) >= 4
  assert all(s['acc'] in (0.0, 1.0) and len(s['resps']) == len(q['choices']) for s, q in zip(samples, questions))
  assert 0.0 <= out['results']['jaxlm_code_mc']['acc,none'] <= 1.0
