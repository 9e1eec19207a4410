"""lm-evaluation-harness tasks scored by jaxlm itself (jaxlm/harness.py): request by request equal to lm-eval's
Hugging Face backend on the run's export, the `--tasks` command, and the training loop's harness hook."""

import json
import os
import textwrap

import pytest

from tests.helpers import assert_fails_with, load_config, run_cli

# Three tasks in lm-eval's own YAML style, on local jsonl data: a multiple-choice, a rolling (perplexity) and a
# generation task. Contexts share prefixes and lengths differ, so batches mix lengths and buckets.
# No request here shares its context + continuation tokens but the last with another whose split differs (the
# shipped jaxlm_code_mc's included): HFLM's default logits cache keys requests on those tokens and hands one
# request's continuation logits to the other, misaligned when their continuation lengths differ.
MC = [{'q': 'def sub(a, b):\n    return', 'choices': [' a - b', ' a + b', ' None', ' print(a)'], 'gold': 0},
      {'q': 'import', 'choices': [' os', ' sys', ' the', ' 12'], 'gold': 1},
      {'q': 'while True:\n   ', 'choices': [' break', ' pass', ' return'], 'gold': 0},
      {'q': 'class Foo(object):\n    def __init__(self', 'choices': ['):', ', x):', ' = 3'], 'gold': 1},
      {'q': '#', 'choices': [' comment', '!/usr/bin/env python'], 'gold': 1}]
DOCS = [{'text': 'import os\nimport sys\n'},
        {'text': 'def f(x):\n    """Return twice x."""\n    return {"ü": x * 2}  # 日本\n' * 4},
        {'text': 'class A:\n    pass\n'}]
GEN = [{'prompt': 'def main():\n', 'answer': '    pass'}, {'prompt': 'import', 'answer': ' os'},
       {'prompt': 'if __name__ == "__main__":\n    ', 'answer': 'main()'}, {'prompt': 'x = 1\ny =', 'answer': ' 2'}]

TASKS = {
    'h_mc': ('mc.jsonl', MC, """
        output_type: multiple_choice
        doc_to_text: q
        doc_to_choice: choices
        doc_to_target: gold
        target_delimiter: ""
        metric_list:
          - metric: acc
          - metric: acc_norm
        """),
    'h_roll': ('docs.jsonl', DOCS, """
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list:
          - metric: word_perplexity
          - metric: byte_perplexity
          - metric: bits_per_byte
        """),
    'h_gen': ('gen.jsonl', GEN, """
        output_type: generate_until
        doc_to_text: "{{prompt}}"
        doc_to_target: "{{answer}}"
        target_delimiter: ""
        generation_kwargs:
          until: ["\\n"]
          do_sample: false
          max_gen_toks: 8
        metric_list:
          - metric: exact_match
            aggregation: mean
            higher_is_better: true
        """),
}


def write_tasks(folder, tasks=TASKS):
  """Each task's YAML and jsonl in `folder` (absolute data paths: lm-eval runs from any directory)."""
  os.makedirs(folder, exist_ok=True)
  for name, (data, docs, body) in tasks.items():
    with open(os.path.join(folder, data), 'w') as f:
      f.writelines(json.dumps(d) + '\n' for d in docs)
    head = (f'task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: '
            f'{os.path.join(folder, data)}\ntest_split: test\nshould_decontaminate: false\n')
    with open(os.path.join(folder, f'{name}.yaml'), 'w') as f:
      f.write(head + textwrap.dedent(body) + 'metadata:\n  version: 1.0\n')
  return str(folder)


@pytest.fixture(scope='module')
def offline(tmp_path_factory):
  """lm-eval imported offline, with a private datasets cache (the json builder needs no network)."""
  saved = {k: os.environ.get(k) for k in ('HF_DATASETS_OFFLINE', 'HF_HUB_OFFLINE', 'HF_DATASETS_CACHE')}
  os.environ.update(HF_DATASETS_OFFLINE='1', HF_HUB_OFFLINE='1',
                    HF_DATASETS_CACHE=str(tmp_path_factory.mktemp('hf_datasets')))
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


SEQ_LEN = 128  # room for the shipped jaxlm_generations' 64 new tokens after a context


@pytest.fixture(scope='module')
def harness_run(tmp_path_factory, data_cache, offline):
  """A palm_tiny run trained 4 steps that scored the three tasks in the loop at its end (checkpointed there);
  returns (workdir, tasks folder)."""
  from jaxlm import train
  tasks = write_tasks(tmp_path_factory.mktemp('tasks'))
  cfg = load_config('palm_tiny')
  cfg.data.update(cache_dir=str(data_cache), seq_len=SEQ_LEN)
  cfg.train.update(steps=4, eval_every=0, eval_batches=1, log_every=2, harness_tasks=tuple(TASKS),
                   harness_every=0, harness_limit=0, harness_include_path=tasks)
  cfg.optim.update(warmup_steps=2, ema=0.5)  # the averaged weights are scored too (harness/..._ema)
  cfg.checkpoint.update(every=0, async_save=False)
  cfg.log.update(tensorboard=False, compilation_cache='')
  workdir = str(tmp_path_factory.mktemp('harness_run'))
  train.run(cfg, workdir)
  return workdir, tasks


def _in_loop(workdir: str, step: int = 4, suffix: str = '') -> dict:
  """The harness/* metrics the training loop logged at `step` (metrics.jsonl) of the weights (`_ema`: averaged)."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  [record] = [r for r in records if r['kind'] == 'eval' and r['step'] == step]
  return {k.removesuffix(suffix): v for k, v in record.items()
          if k.startswith('harness/') and k.endswith('_ema') == bool(suffix)}


def flat_responses(resps):
  """A sample's responses as a flat list of floats, bools and strings."""
  out = []
  for r in resps:
    out.extend(flat_responses(r) if isinstance(r, (list, tuple)) else [r])
  return out


@pytest.mark.e2e  # a trained run and torch's HF backend: the full suite runs it, the fast loop keeps unit tests
def test_requests_equal_lm_evals_hf_backend_on_the_export(harness_run, tmp_path, monkeypatch):
  """Every request's log-likelihood (1e-4 absolute), is_greedy flag and generated string, and every task metric,
  as lm-eval's Hugging Face backend gives them on the run's export (float32 on both sides): the three tasks above
  and two that ship in jaxlm/lm_eval_tasks (their data paths are relative to the directory lm-eval runs in)."""
  from lm_eval.models.huggingface import HFLM
  from jaxlm import harness
  from jaxlm.hf import export as export_lib
  from jaxlm.tools import eval as eval_lib
  workdir, tasks = harness_run
  os.makedirs(tmp_path / 'jaxlm')
  os.symlink(harness.TASKS_DIR, tmp_path / 'jaxlm' / 'lm_eval_tasks')
  eval_lib.write_jsonl(str(tmp_path / 'documents.jsonl'), [d['text'] for d in DOCS])
  with open(tmp_path / 'prompts.jsonl', 'w') as f:  # the shipped generation task's file: greedy to 64 tokens
    f.writelines(json.dumps({'prompt': g['prompt'], 'reference': g['answer']}) + '\n' for g in GEN[:3])
  monkeypatch.chdir(tmp_path)
  lm, step = eval_lib.harness_lm(workdir)
  assert step == 4
  shipped = ['jaxlm_code_mc', 'jaxlm_documents', 'jaxlm_generations']
  ours = harness.evaluate(lm, [*TASKS, *shipped], include_path=tasks, log_samples=True)
  export_lib.export(workdir, str(tmp_path / 'hf'))
  theirs = {}
  # The start token once before every context (add_bos_token=True); rolling documents get it from lm-eval's
  # prefix token, so there the tokenizer must not add it (add_bos_token=False), as jaxlm's rolling does.
  for add_bos, names in ((True, ['h_mc', 'h_gen', 'jaxlm_code_mc', 'jaxlm_generations']),
                         (False, ['h_roll', 'jaxlm_documents'])):
    hf = HFLM(pretrained=str(tmp_path / 'hf'), dtype='float32', add_bos_token=add_bos, batch_size=8, device='cpu')
    out = harness.evaluate(hf, names, include_path=tasks, log_samples=True)
    theirs.update({k: (out['results'][k], out['samples'][k]) for k in names})
    if add_bos:  # --apply_chat_template: the text transformers renders for HFLM (a ChatML template here)
      from jaxlm.data import chat as chat_lib
      chat = harness.JaxlmLM(lm.scoring, chat_template=chat_lib.BUILTIN['chatml'])
      hf.tokenizer.chat_template = chat_lib.BUILTIN['chatml']
      history = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'def f():\n  '},
                 {'role': 'assistant', 'content': 'return 1 '}]
      for prompt, turns in ((True, history[:2]), (False, history)):
        assert chat.apply_chat_template(turns, prompt) == hf.apply_chat_template(turns, prompt), (prompt, turns)
      # Whole tasks rendered through the template (`--apply_chat_template`): the same requests, the same answers.
      chats = [harness.evaluate(m, ['h_mc', 'h_gen'], include_path=tasks, log_samples=True, apply_chat_template=True)
               for m in (chat, hf)]
      for task in ('h_mc', 'h_gen'):
        mine, samples = chats[0]['samples'][task], chats[1]['samples'][task]
        assert [s['arguments'] for s in mine] == [s['arguments'] for s in samples]
        assert '<|im_start|>user' in str(mine[0]['arguments']), mine[0]['arguments']
        for a, b in zip(mine, samples):
          fa, fb = flat_responses(a['resps']), flat_responses(b['resps'])
          assert [x if isinstance(x, float) else None for x in fa] == pytest.approx(
              [y if isinstance(y, float) else None for y in fb], abs=1e-4), (task, fa, fb)
          assert [x for x in fa if not isinstance(x, float)] == [y for y in fb if not isinstance(y, float)]
        assert chats[0]['results'][task] == pytest.approx(chats[1]['results'][task], rel=1e-5, abs=1e-6)
  worst, counts = 0.0, {}
  for task, (results, samples) in theirs.items():
    mine = ours['samples'][task]
    assert [s['doc_id'] for s in mine] == [s['doc_id'] for s in samples]
    assert len(mine) == len(TASKS[task][1]) if task in TASKS else len(mine) >= 3
    for a, b in zip(mine, samples):
      fa, fb = flat_responses(a['resps']), flat_responses(b['resps'])
      assert len(fa) == len(fb) and [type(x) for x in fa] == [type(x) for x in fb], (task, fa, fb)
      for x, y in zip(fa, fb):
        if isinstance(x, float):
          assert x == pytest.approx(y, abs=1e-4), (task, a['doc_id'], fa, fb)
          worst = max(worst, abs(x - y))
        else:  # is_greedy flags, generated strings
          assert x == y, (task, a['doc_id'], fa, fb)
      counts[task] = counts.get(task, 0) + len(fa)
    for metric, value in results.items():
      if isinstance(value, float) and '_stderr' not in metric:
        assert ours['results'][task][metric] == pytest.approx(value, rel=1e-5, abs=1e-6), (task, metric)
  logged = _in_loop(workdir)
  # The loop scored the three tasks alone; here their windows share batches (and padded lengths) with the shipped
  # tasks' requests, so float rounding differs: equal to 1e-6 here, exactly in the command test (same tasks).
  assert logged == pytest.approx({k: v for k, v in harness.metrics(ours).items() if k.split('/')[1] in TASKS},
                                 rel=1e-6)
  assert len(logged) == 6  # the loop's step-4 scores: the same, exactly
  print(f'\nresponses compared per task {counts}; largest log-likelihood difference {worst:.2e}')
  assert counts['h_mc'] == 2 * sum(len(d['choices']) for d in MC)  # (log-likelihood, is_greedy) per choice
  # The averaged weights the loop scored beside them: jaxlm.tools.eval --weights=ema's numbers, exactly.
  ema, _ = eval_lib.harness_lm(workdir, weights='ema')
  assert _in_loop(workdir, suffix='_ema') == harness.metrics(harness.evaluate(ema, TASKS, include_path=tasks))
  assert _in_loop(workdir, suffix='_ema') != logged
  gens = [s['resps'][0][0] for s in ours['samples']['h_gen']]
  assert any(gens), gens  # the sampler wrote something, cut at the task's stop sequence
  assert all('\n' not in g for g in gens)
  # Requests are padded to power-of-two lengths in fixed batches: a handful of compiled shapes for all three tasks.
  assert harness._score_program(lm.scoring.model_cfg, lm.scoring.mesh)._cache_size() <= 7


@pytest.mark.e2e  # a subprocess
def test_tasks_command_equals_the_in_loop_scores_and_writes_lm_evals_files(harness_run, tmp_path):
  """The real entry point on the step-4 checkpoint: lm-eval's table, its results JSON and samples, and the numbers
  the loop logged at step 4, exactly; jaxlm's side imports no torch."""
  from tests.helpers import train_env
  workdir, tasks = harness_run
  env = {**train_env(8), 'PYTHONPROFILEIMPORTTIME': '1', 'HF_DATASETS_OFFLINE': '1', 'HF_HUB_OFFLINE': '1',
         'HF_DATASETS_CACHE': str(tmp_path / 'datasets')}
  out = run_cli('jaxlm.tools.eval', f'--workdir={workdir}', '--step=4', f'--tasks={",".join(TASKS)}',
                f'--include_path={tasks}', f'--output_path={tmp_path / "out"}', '--log_samples', env=env,
                timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  imported = {line.rsplit('|', 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith('import time')}
  assert {'jax', 'lm_eval'} <= imported, sorted(imported)[:50]
  assert not {'torch', 'transformers'} & imported, 'jaxlm --tasks imported torch'
  assert '|h_mc' in out.stdout.replace(' ', '') and 'acc_norm' in out.stdout and 'bits_per_byte' in out.stdout
  [results] = list((tmp_path / 'out').rglob('results_*.json'))
  with open(results) as f:
    written = json.load(f)
  from jaxlm import harness
  assert harness.metrics(written) == _in_loop(workdir)
  for task, (_, docs, _) in TASKS.items():
    [samples] = list((tmp_path / 'out').rglob(f'samples_{task}_*.jsonl'))
    assert len(samples.read_text().splitlines()) == len(docs)


@pytest.mark.e2e  # two processes (launch/local.sh)
def test_two_processes_score_a_task_once_as_one_process_does(harness_run, tmp_path, data_cache):
  """A multi-process run scores a task in its loop as one SPMD program over every process's devices and logs one
  result: the in-process run's numbers (the fixture: the same training on one process of 8 devices; it scored the
  multiple-choice task beside two others, so batches differ and the numbers agree to float rounding)."""
  import subprocess
  import sys
  from tests.conftest import ROOT
  from tests.helpers import train_env
  workdir, tasks = harness_run
  run = tmp_path / 'two'
  argv = ['launch/local.sh', '-n', '2', '-d', '4', '--', sys.executable, '-m', 'jaxlm.train', '--config=configs/palm_tiny.py',
          f'--workdir={run}', f'--config.data.cache_dir={data_cache}', f'--config.data.seq_len={SEQ_LEN}',
          '--config.train.steps=4',
          '--config.train.eval_every=0', '--config.train.eval_batches=1', '--config.train.log_every=2',
          "--config.train.harness_tasks=('h_mc',)", '--config.train.harness_every=0',
          '--config.train.harness_limit=0', f'--config.train.harness_include_path={tasks}',
          '--config.optim.warmup_steps=2', '--config.checkpoint.every=0',
          '--config.checkpoint.async_save=False', '--config.log.tensorboard=False', '--config.log.compilation_cache=',
          '--config.dist.peer_timeout_s=60']
  env = {**train_env(4), 'HF_DATASETS_OFFLINE': '1', 'HF_HUB_OFFLINE': '1',
         'HF_DATASETS_CACHE': str(tmp_path / 'datasets')}
  out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  with open(run / 'metrics.jsonl') as f:
    assert sum(json.loads(line)['kind'] == 'eval' for line in f) == 1  # one record, from process 0
  two = _in_loop(str(run))
  one = {k: v for k, v in _in_loop(workdir).items() if k.startswith('harness/h_mc/')}  # the EMA is off here
  assert set(two) == {'harness/h_mc/acc', 'harness/h_mc/acc_norm'} and two == pytest.approx(one, rel=1e-6, abs=1e-7)


@pytest.mark.e2e  # two short in-process runs
@pytest.mark.parametrize('kind', ['lora', 'moe'])
def test_tasks_on_a_lora_or_moe_checkpoint_equal_the_in_loop_scores(tmp_path, data_cache, offline, kind):
  """`--tasks` from any run's checkpoint: a LoRA run (its adapters on the base it holds) and a mixture of experts
  score what their loop scored at that step, exactly."""
  from jaxlm import harness, train
  from jaxlm.tools import eval as eval_lib
  tasks = write_tasks(tmp_path / 'tasks', {'h_mc': TASKS['h_mc']})
  cfg = load_config('moe_tiny' if kind == 'moe' else 'palm_tiny')
  if kind == 'lora':
    cfg.model.lora.update(rank=4, alpha=8.0)
  cfg.data.cache_dir = str(data_cache)
  cfg.train.update(steps=2, eval_every=0, eval_batches=1, harness_tasks=('h_mc',), harness_every=0,
                   harness_limit=0, harness_include_path=tasks)
  cfg.optim.update(warmup_steps=1, lr=3e-2)  # large enough that two steps move the adapters off zero
  cfg.checkpoint.update(every=0, async_save=False)
  cfg.log.update(tensorboard=False, compilation_cache='')
  workdir = str(tmp_path / kind)
  train.run(cfg, workdir)
  logged = _in_loop(workdir, step=2)
  assert set(logged) == {'harness/h_mc/acc', 'harness/h_mc/acc_norm'}, logged
  lm, step = eval_lib.harness_lm(workdir)
  model_cfg = lm.scoring.model_cfg  # the run's own model, read back from its checkpoint
  assert step == 2 and (model_cfg.moe.experts == 4 if kind == 'moe' else model_cfg.lora.rank == 4)
  scored = harness.evaluate(lm, ['h_mc'], include_path=tasks, log_samples=True)
  assert harness.metrics(scored) == logged
  if kind == 'lora':  # the adapters count: the base alone answers otherwise
    from jaxlm import lora as lora_lib
    base = eval_lib.harness_lm(workdir)[0]
    base.scoring.params = lora_lib.adapters_off(base.scoring.params)
    plain = harness.evaluate(base, ['h_mc'], include_path=tasks, log_samples=True)
    assert plain['samples']['h_mc'][0]['resps'] != scored['samples']['h_mc'][0]['resps']


def test_a_task_that_cannot_run_offline_is_refused_before_step_0(tmp_path, data_cache, offline):
  """A task whose data is not on this machine: one line naming it, before any training step or checkpoint. (An
  unknown name is refused the same way, after indexing lm-eval's whole registry: too slow for the suite.)"""
  from jaxlm import harness, train
  missing = write_tasks(tmp_path / 'tasks', {'h_gone': TASKS['h_mc']})
  os.remove(os.path.join(missing, 'mc.jsonl'))
  for tasks, says in ((('h_gone',), 'harness task h_gone: its dataset cannot be loaded offline'),):
    cfg = load_config('palm_tiny')
    cfg.data.cache_dir = str(data_cache)
    cfg.train.update(steps=2, harness_tasks=tasks, harness_include_path=missing)
    cfg.optim.warmup_steps = 1
    cfg.log.update(tensorboard=False, compilation_cache='')
    workdir = tmp_path / f'run_{tasks[0]}'
    with pytest.raises(harness.HarnessError) as e:
      train.run(cfg, str(workdir))
    message = str(e.value)
    assert says in message and '; ' in message and '\n' not in message, message
    assert not (workdir / 'checkpoints').exists() and not (workdir / 'metrics.jsonl').exists()  # before any step


def test_harness_config_is_validated_naming_the_field(tmp_path):
  from jaxlm import config as config_lib
  from jaxlm import errors
  cfg = load_config('palm_tiny')
  cfg.train.update(harness_tasks=('a',), eval_every=10, harness_every=15, harness_include_path=str(tmp_path / 'no'))
  with pytest.raises(errors.ConfigError) as e:
    config_lib.validate(cfg, 8)
  assert 'train.harness_every=15 must be a multiple of train.eval_every=10' in str(e.value)
  assert 'train.harness_include_path' in str(e.value)
  cfg.train.update(harness_tasks=('',), harness_every=20, harness_include_path='')
  with pytest.raises(errors.ConfigError, match='train.harness_tasks'):
    config_lib.validate(cfg, 8)


@pytest.mark.e2e  # the trained run of the fixture
def test_report_shows_and_plots_the_harness_metrics(harness_run, tmp_path, capsys):
  from jaxlm.tools import report
  workdir, _ = harness_run
  report.report(workdir, str(tmp_path / 'report.png'))
  out = capsys.readouterr().out
  assert 'Harness (train.harness_tasks' in out and 'h_mc/acc_norm' in out and 'h_roll/bits_per_byte' in out
  logged = _in_loop(workdir)
  assert f'{logged["harness/h_roll/bits_per_byte"]:.4f}' in out
  assert (tmp_path / 'report.png').stat().st_size > 10_000


@pytest.mark.e2e  # a subprocess
def test_tasks_command_refuses_a_task_without_its_data_in_one_line(tmp_path):
  from tests.helpers import train_env
  missing = write_tasks(tmp_path / 'tasks', {'h_gone': TASKS['h_mc']})
  os.remove(os.path.join(missing, 'mc.jsonl'))
  env = {**train_env(8), 'HF_DATASETS_OFFLINE': '1', 'HF_HUB_OFFLINE': '1',
         'HF_DATASETS_CACHE': str(tmp_path / 'datasets')}
  out = run_cli('jaxlm.tools.eval', f'--workdir={tmp_path}', '--tasks=h_gone', f'--include_path={missing}', env=env,
                timeout=120)
  assert_fails_with(out, 2, 'harness task h_gone: its dataset cannot be loaded offline')
