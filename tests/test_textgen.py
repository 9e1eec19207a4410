"""Generation metrics (jaxlm/textgen.py) on fixed inputs: hand-counted repetition, and sacrebleu / mauve-text
called directly on the same inputs."""

import math
import os

import numpy as np
import pytest

from jaxlm import textgen
from tests.conftest import made_once, train_tiny


def test_repetition_counts_each_texts_ngrams_and_skips_texts_without_any():
  texts = ['a b a b a', 'c d e', 'x']  # 'x' has no 2-gram; 'c d e' no 4-gram
  r = textgen.repetition(texts, [[1, 2, 1, 2, 1], [3, 4, 5], [9]])
  # 2-grams: text 1 has ab ba ab ba (2 unique of 4), text 2 cd de (2 of 2): 1 - 4/6.
  assert r['rep_2'] == pytest.approx(1 - 4 / 6)
  assert r['rep_3'] == pytest.approx(1 - (2 + 1) / (3 + 1))  # aba bab aba | cde
  assert r['rep_4'] == pytest.approx(1 - 2 / 2)  # abab baba: both unique -> 0
  assert r['diversity'] == pytest.approx((1 - r['rep_2']) * (1 - r['rep_3']) * (1 - r['rep_4']))
  assert r['distinct_1'] == pytest.approx(6 / 9)  # a b c d e x among 9 words
  assert r['distinct_2'] == pytest.approx(4 / 6)  # ab ba cd de
  assert r['seq_rep_4'] == 0.0 and r['skipped'] == 2  # only the first text has a 4-gram
  assert all(r[f'token_{k}'] == r[k] for k in ('rep_2', 'rep_3', 'rep_4', 'distinct_1', 'seq_rep_4'))
  none = textgen.repetition(['x', ''], [[1], []])
  assert none['rep_2'] is None and none['diversity'] is None and none['seq_rep_4'] is None
  assert none['skipped'] == 2  # counted, never divided by
  loop = textgen.repetition(['the the the the the the'])
  assert loop['rep_4'] == pytest.approx(1 - 1 / 3) and loop['seq_rep_4'] == pytest.approx(2 / 3)


def test_likelihood_and_gap():
  lp = [np.log([0.5, 0.25]), np.array([]), np.log([0.125])]
  r = textgen.likelihood(lp)
  nll = -(math.log(0.5) + math.log(0.25) + math.log(0.125)) / 3
  assert r['perplexity'] == pytest.approx(math.exp(nll)) and r['scored_tokens'] == 3 and r['empty'] == 1
  assert r['coherence_loglik'] == pytest.approx(np.mean([np.log([0.5, 0.25]).mean(), math.log(0.125)]))
  assert textgen.perplexity_gap(2.0, 8.0) == pytest.approx(-math.log(4))
  assert textgen.cosine(np.array([[1.0, 0], [1, 1]]), np.array([[2.0, 0], [-1, -1]])) == pytest.approx(0.0)


def test_reference_overlap_equals_sacrebleu_corpus_scores():
  sacrebleu = pytest.importorskip('sacrebleu', reason='pip install -e ".[textgen]"')
  hyps = ['def f(x): return x + 1', 'import os', 'for i in range(10): print(i)', 'x = 1']
  refs = ['def f(x): return x + 2', 'import sys', 'for i in range(10): print(i)', 'y = 2']
  r = textgen.reference_overlap(hyps, refs)
  assert r['bleu'] == sacrebleu.corpus_bleu(hyps, [refs]).score
  assert r['chrf'] == sacrebleu.corpus_chrf(hyps, [refs]).score
  assert r['ter'] == sacrebleu.corpus_ter(hyps, [refs]).score
  assert r['exact_match'] == 0.25
  assert r['bleu_signature'].startswith('nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:')
  assert 'chrF2' in r['chrf_signature'] or 'nc:6' in r['chrf_signature']
  with pytest.raises(textgen.TextgenError, match='one reference each'):
    textgen.reference_overlap(hyps, refs[:2])


def test_mauve_equals_mauve_text_on_the_same_features_and_seeds():
  mauve = pytest.importorskip('mauve', reason='pip install -e ".[textgen]"')
  rng = np.random.default_rng(0)
  p = rng.standard_normal((40, 8)).astype(np.float32)
  q = (rng.standard_normal((40, 8)) + 0.7).astype(np.float32)
  r = textgen.mauve(p, q, seeds=(1, 2))
  with textgen._one_faiss_thread():  # pylint: disable=protected-access  # the same result, faster
    direct = [mauve.compute_mauve(p_features=p, q_features=q, seed=s).mauve for s in (1, 2)]
  assert r['mauve'] == float(np.mean(direct)) and r['mauve_sd'] == float(np.std(direct))
  assert textgen.mauve(p, p, seeds=(1,))['mauve'] > r['mauve']  # the same distribution scores higher


def test_cut_pairs_take_windows_inside_one_document():
  inputs = np.arange(24).reshape(2, 12)
  segments = np.array([[1] * 7 + [2] * 5, [1] * 12])
  pairs = textgen.cut_pairs([{'inputs': inputs, 'segment_ids': segments}], 10, 2, 3)
  assert pairs == [([0, 1], [2, 3, 4]), ([7, 8], [9, 10, 11]), ([12, 13], [14, 15, 16]), ([17, 18], [19, 20, 21])]
  assert len(textgen.cut_pairs([{'inputs': inputs, 'segment_ids': segments}], 2, 2, 3)) == 2


# ---------------------------------------------------------------------------------------------------------------
# Two small runs trained once per session (a model and a judge), and the orders the metrics must put samplers in

P, N, PROMPTS = 8, 24, 64  # prompt and continuation tokens, prompts (palm_tiny's sequences are 64 tokens)


@pytest.fixture(scope='session')
def textgen_runs(tmp_path_factory, data_cache, trained_tiny):
  """(model workdir, judge workdir): palm_tiny on the stdlib corpus, and as judge the suite's palm_tiny trained
  longer on another seed (tests/conftest.py: trained_tiny). Trained once for the whole run (every xdist worker
  included)."""
  with made_once(tmp_path_factory, 'textgen_runs') as (path, done):
    model = path / 'textgen_model'
    if not done:
      # The model scores its own generations at steps 100 and 200 (train.gen_eval).
      train_tiny(model, data_cache, 200, 0, eval_every=100, gen_eval=1, gen_eval_prompts=16,
                 gen_eval_prompt_tokens=P, gen_eval_tokens=N)
  return str(model), trained_tiny


@pytest.fixture(scope='session')
def scored(textgen_runs):
  """Held-out prompts continued by four samplers, each scored under the judge beside the human continuations."""
  from jaxlm import generate as generate_lib
  from jaxlm import sharding
  from jaxlm import step as step_lib
  from jaxlm.data import pipeline as data_lib
  from jaxlm.hf import export as export_lib
  from jaxlm.tools import eval as eval_lib
  model_dir, judge_dir = textgen_runs
  own, judge = eval_lib.load_scorer(model_dir), eval_lib.load_scorer(judge_dir)
  cfg = export_lib.read_config(export_lib.step_dir(model_dir))
  batches = data_lib.eval_batches(cfg.data, batch_size=8, num_batches=8, vocab_size=cfg.model.vocab_size)
  pairs = textgen.cut_pairs(batches, PROMPTS, P, N)
  assert len(pairs) == PROMPTS
  tok = own.tokenizer
  prompt_ids, human_ids = [p for p, _ in pairs], [h for _, h in pairs]
  prompts, human = [tok.decode(p) for p in prompt_ids], [tok.decode(h) for h in human_ids]
  with sharding.activate(own.mesh):
    init = step_lib.build_program(cfg, own.mesh).init().params  # the trained run's own initialisation

  def sample(params, sampling):
    return generate_lib.generate(own.model_cfg, params, prompt_ids, N, sampling=sampling, seed=0,
                                 eos_id=tok.separator_id, mesh=own.mesh, max_len=cfg.data.seq_len).tokens

  top_p = generate_lib.Sampling(temperature=1.0, top_p=0.95)
  samples = {'top_p': sample(own.params, top_p), 'init': sample(init, top_p),
             'greedy': sample(own.params, generate_lib.Sampling()),
             'repeat': [[p[-1]] * N for p in prompt_ids]}  # a degenerate sampler: the last prompt token, N times
  results = {name: textgen.score(prompts, [tok.decode(t) for t in ids], human, model_ids=ids, human_ids=human_ids,
                                 scorer=judge, mauve_seeds=(0, 1, 2)) for name, ids in samples.items()}
  return {'results': results, 'prompts': prompts, 'human': human, 'judge': judge, 'own': own}


def test_mauve_under_the_judge_ranks_trained_top_p_above_init_greedy_and_repetition(scored):
  mauve = {k: r['model']['mauve'] for k, r in scored['results'].items()}
  sd = scored['results']['top_p']['model']['mauve_sd']
  for other in ('init', 'greedy', 'repeat'):
    assert mauve['top_p'] > mauve[other] + 2 * sd + 0.1, mauve


def test_perplexity_gap_is_small_only_for_trained_top_p(scored):
  gap = {k: r['model']['perplexity_gap'] for k, r in scored['results'].items()}
  assert scored['results']['top_p']['human']['perplexity_gap'] == 0.0
  assert gap['greedy'] < 0 < gap['init']  # greedy text is more predictable than human text, noise less
  for other in ('init', 'greedy', 'repeat'):
    assert abs(gap['top_p']) < abs(gap[other]), gap


def test_token_rep_4_high_for_repetition_and_near_human_for_trained_top_p(scored):
  results = scored['results']
  human = results['top_p']['human']['token_rep_4']
  assert results['repeat']['model']['token_rep_4'] > 0.9
  assert abs(results['top_p']['model']['token_rep_4'] - human) < 0.05
  assert results['greedy']['model']['token_rep_4'] > human + 0.3  # greedy loops
  assert any(w.startswith('token_rep_4') for w in textgen.warnings(results['greedy']['model'],
                                                                    results['greedy']['human']))
  assert not any('rep' in w for w in textgen.warnings(results['top_p']['model'], results['top_p']['human']))


def test_corrupted_human_continuations_move_coherence_and_perplexity_the_right_way(scored):
  prompts, human, judge = scored['prompts'], scored['human'], scored['judge']
  base = scored['results']['top_p']['human']
  half = len(human) // 2  # consecutive prompts often come from one file: pair each with a far one instead
  other = textgen.score(prompts, human[half:] + human[:half], human, scorer=judge, mauve_seeds=())['model']
  assert other['coherence_loglik'] < base['coherence_loglik']
  assert other['coherence_cosine'] < base['coherence_cosine']
  rng = np.random.default_rng(0)
  shuffled = [' '.join(rng.permutation(t.split(' '))) for t in human]
  assert textgen.score(prompts, shuffled, human, scorer=judge, mauve_seeds=())['model']['perplexity'] > \
      1.3 * base['perplexity']


def test_continuation_logprobs_equal_transformers_log_softmax_on_the_export(scored, textgen_runs, tmp_path):
  torch = pytest.importorskip('torch', reason='pip install -e ".[test]"')
  transformers = pytest.importorskip('transformers', reason='pip install -e ".[test]"')
  from jaxlm.hf import export as export_lib
  export_lib.export(textgen_runs[0], str(tmp_path))
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
  own = scored['own']
  pairs = own.encode_pairs(scored['prompts'][:5], scored['human'][:5])
  ours = own.token_logprobs(pairs)
  for (ctx, cont), lp in zip(pairs, ours):
    with torch.no_grad():
      logits = hf(torch.tensor([ctx + cont])).logits[0].double()
    ref = torch.log_softmax(logits, -1)[len(ctx) - 1:-1].gather(-1, torch.tensor(cont)[:, None])[:, 0].numpy()
    assert len(cont) > 5 and np.abs(lp - ref).max() < 1e-5


@pytest.mark.slow(reason='generates and scores held-out continuations twice (MAUVE features included) to show the JSON repeats')
def test_generate_heldout_gives_a_human_row_and_the_same_json_twice(textgen_runs, tmp_path):
  import json
  from jaxlm import generate as generate_lib
  from jaxlm.tools import eval as eval_lib
  model_dir, judge_dir = textgen_runs
  kwargs = dict(num_prompts=16, prompt_tokens=P, max_tokens=N, seed=3, scorer=judge_dir, mauve_seeds=(0, 1),
                sampling=generate_lib.Sampling(temperature=1.0, top_p=0.95))
  first = eval_lib.generate_and_score(model_dir, 'heldout', samples_out=str(tmp_path / 'a.jsonl'), **kwargs)
  second = eval_lib.generate_and_score(model_dir, 'heldout', samples_out=str(tmp_path / 'a.jsonl'), **kwargs)
  assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
  sig = first['signature']
  assert sig['scorer'].endswith(os.path.basename(judge_dir)) and sig['scorer_step'] == 300 and sig['samples'] == 16
  assert sig['sampling'] == {'temperature': 1.0, 'top_k': 0, 'top_p': 0.95} and sig['seed'] == 3
  assert sig['versions']['sacrebleu'] == '2.6.0' and sig['versions']['mauve-text'] == '0.4.0'
  assert 0 < first['model']['mauve'] <= 1 and first['human']['perplexity'] > 1
  records = [json.loads(line) for line in (tmp_path / 'a.jsonl').read_text().splitlines()]
  assert len(records) == 16 and {'prompt', 'completion', 'human', 'finish_reason'} <= set(records[0])
  assert [r['human'] for r in records] == scored_human(model_dir, 16)


def scored_human(model_dir, num):
  """The human continuations the held-out cut gives, decoded independently of eval."""
  from jaxlm.data import pipeline as data_lib
  from jaxlm.hf import export as export_lib
  cfg = export_lib.read_config(export_lib.step_dir(model_dir))
  batches = data_lib.eval_batches(cfg.data, batch_size=cfg.train.batch_size, num_batches=cfg.train.eval_batches,
                                  vocab_size=cfg.model.vocab_size)
  tok = data_lib.load_tokenizer(cfg.data, cfg.model.vocab_size)
  return [tok.decode(h) for _, h in textgen.cut_pairs(batches, num, P, N)]


def test_generate_with_references_equals_sacrebleu_and_lm_eval_on_the_same_samples(textgen_runs, tmp_path,
                                                                                   monkeypatch):
  """A prompts jsonl: BLEU / chrF / TER / exact match as sacrebleu gives them, and as lm-eval's generate_until
  through the shipped task (jaxlm_generations) scores the same samples."""
  import json
  sacrebleu = pytest.importorskip('sacrebleu')
  from jaxlm.tools import eval as eval_lib
  model_dir, _ = textgen_runs
  prompts = ['import os\n', 'def f(x):\n', 'class A:\n', 'for i in range(', 'if __name__', 'return self.']

  def run(references, name):
    (tmp_path / name).write_text(''.join(json.dumps({'prompt': p, 'reference': r}) + '\n'
                                         for p, r in zip(prompts, references)))
    r = eval_lib.generate_and_score(model_dir, str(tmp_path / name), max_tokens=16, mauve_seeds=(),
                                    samples_out=str(tmp_path / 's.jsonl'))
    return r, [json.loads(x)['completion'] for x in (tmp_path / 's.jsonl').read_text().splitlines()]

  _, greedy = run(['x'] * len(prompts), 'first.jsonl')
  # References that the greedy samples match exactly (even rows) or in part (odd rows: a word dropped).
  refs = [g if i % 2 == 0 else ' '.join(g.split(' ')[1:]) for i, g in enumerate(greedy)]
  r, texts = run(refs, 'prompts.jsonl')
  assert texts == greedy  # greedy: the same samples again
  assert r['model']['bleu'] == sacrebleu.corpus_bleu(texts, [refs]).score > 0
  assert r['model']['chrf'] == sacrebleu.corpus_chrf(texts, [refs]).score
  assert r['model']['ter'] == sacrebleu.corpus_ter(texts, [refs]).score
  assert r['model']['exact_match'] == pytest.approx(sum(t == x for t, x in zip(texts, refs)) / len(refs))
  assert r['human']['chrf'] == 100.0 and r['human']['exact_match'] == 1.0  # the references against themselves

  # lm-eval, offline (its json builder), on the same samples: a model that answers generate_until with them.
  monkeypatch.setenv('HF_DATASETS_OFFLINE', '1')
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'hf_datasets'))
  lm_eval = pytest.importorskip('lm_eval', reason='pip install -e ".[eval]"')
  from lm_eval.api.model import LM
  from lm_eval.tasks import TaskManager
  answers = dict(zip(prompts, texts))

  class Samples(LM):
    def generate_until(self, requests):
      return [answers[req.args[0]] for req in requests]

    def loglikelihood(self, requests):
      raise NotImplementedError

    def loglikelihood_rolling(self, requests):
      raise NotImplementedError

  monkeypatch.chdir(tmp_path)
  out = lm_eval.simple_evaluate(model=Samples(), tasks=['jaxlm_generations'],
                                task_manager=TaskManager(include_path=eval_lib.TASKS_DIR, include_defaults=False),
                                bootstrap_iters=0)  # the shipped task alone: no index of lm-eval's registry
  theirs = out['results']['jaxlm_generations']
  assert theirs['bleu,none'] == r['model']['bleu']
  assert theirs['chrf,none'] == r['model']['chrf']
  assert theirs['ter,none'] == r['model']['ter']
  assert theirs['exact_match,none'] == r['model']['exact_match']


def test_generate_refuses_a_bad_prompts_file_before_any_device_work(tmp_path):
  from jaxlm.tools import eval as eval_lib
  (tmp_path / 'p.jsonl').write_text('{"prompt": "x"}\n')
  # The run directory does not exist: the file is read (and refused) before any checkpoint is looked for.
  with pytest.raises(eval_lib.EvalError, match=r'p.jsonl:1 needs a non-empty "prompt" string and a "reference" '
                                               r'string; give both') as e:
    eval_lib.generate_and_score(str(tmp_path / 'no_run'), str(tmp_path / 'p.jsonl'))
  assert e.value.exit_code == 2


def test_gen_eval_logs_gen_records_that_equal_scoring_the_checkpoint(textgen_runs, capsys):
  import json
  from jaxlm import checkpoint as checkpoint_lib
  from jaxlm.data import pipeline as data_lib
  from jaxlm.hf import export as export_lib
  from jaxlm.tools import eval as eval_lib
  from jaxlm.tools import report as report_lib
  from tests.helpers import read_records
  model_dir, _ = textgen_runs
  gens = read_records(model_dir, 'gen')
  assert [r['step'] for r in gens] == [100, 200]
  assert gens[0]['samples'] == 16 and gens[0]['human_perplexity'] != gens[1]['human_perplexity']  # a moving scorer
  assert gens[0]['human_token_rep_4'] == gens[1]['human_token_rep_4']  # the human side: the same prompts
  samples = [r for r in read_records(model_dir, 'event') if r['event'] == 'gen_sample']
  assert len(samples) == 6 and samples[-1]['step'] == 200
  # The last record again, from the checkpoint, outside the trainer: the same numbers.
  cfg = export_lib.read_config(export_lib.step_dir(model_dir))
  own = eval_lib.load_scorer(model_dir)
  batches = data_lib.eval_batches(cfg.data, batch_size=cfg.train.batch_size, num_batches=cfg.train.eval_batches,
                                  vocab_size=cfg.model.vocab_size)
  gen = textgen.GenEval(cfg.train, batches, own.tokenizer, own.model_cfg, seq_len=cfg.data.seq_len, mesh=own.mesh)
  record, again = gen(own.params)
  assert {k: v for k, v in gens[1].items() if k in record} == record
  assert json.loads(record['signature'])['sampling'] == {'temperature': 1.0, 'top_k': 0, 'top_p': 0.95}
  assert [s['completion'] for s in samples[-3:]] == [s['completion'] for s in again]
  # Goodput counts it as evaluation: the eval bucket holds both evaluations' time.
  system = [r for r in read_records(model_dir, 'system') if 'eval_s' in r]
  assert system and system[-1]['eval_s'] > 0
  report_lib.report(model_dir, str(model_dir) + '/report.png')
  out = capsys.readouterr().out
  assert 'Generations' in out and 'human' in out and samples[-1]['completion'][:10].strip() in out


def test_gen_eval_settings_are_checked_in_config_validation():
  from jaxlm import config as config_lib
  from jaxlm import errors
  from tests.helpers import load_config
  cfg = load_config('palm_tiny')
  cfg.train.update(gen_eval=1, gen_eval_prompt_tokens=40, gen_eval_tokens=40, gen_eval_top_p=0.0)
  with pytest.raises(errors.ConfigError) as e:
    config_lib.validate(cfg, 8)
  assert 'train.gen_eval_prompt_tokens + train.gen_eval_tokens = 80 must fit data.seq_len=64' in str(e.value)
  assert 'gen_eval_top_p in (0, 1]' in str(e.value)
  # Each process would cut prompts from its own held-out rows, where the sampler needs one set: one process only.
  cfg.train.update(gen_eval_prompt_tokens=16, gen_eval_tokens=32, gen_eval_top_p=0.95)
  config_lib.validate(cfg, 8)
  with pytest.raises(errors.ConfigError) as e:
    config_lib.validate(cfg, 8, num_processes=2)
  assert 'train.gen_eval runs on one process only, not 2' in str(e.value)


@pytest.mark.slow(reason='the eval command in a subprocess generates and scores what the in-process call does')
def test_the_generate_command_prints_the_table_of_the_scores_it_computes(textgen_runs, tmp_path):
  import json
  from jaxlm.tools import eval as eval_lib
  from tests.helpers import run_cli
  model_dir, _ = textgen_runs
  prompts = ['import os\n', 'def f(x):\n', 'class A:\n', 'for i in range(']
  path = tmp_path / 'prompts.jsonl'
  path.write_text(''.join(json.dumps({'prompt': p, 'reference': p[::-1]}) + '\n' for p in prompts))
  out = run_cli('jaxlm.tools.eval', f'--workdir={model_dir}', f'--generate={path}', '--max_tokens=12',
                '--mauve_seeds=', f'--samples_out={tmp_path / "cli.jsonl"}', devices=8, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  r = eval_lib.generate_and_score(str(model_dir), str(path), max_tokens=12, mauve_seeds=(),
                                  samples_out=str(tmp_path / 'call.jsonl'))
  assert textgen.table(r) in out.stdout and 'model' in textgen.table(r) and 'human' in textgen.table(r)
  assert out.stdout.splitlines()[-1] == f'samples: {tmp_path / "cli.jsonl"}'
  assert (tmp_path / 'cli.jsonl').read_text() == (tmp_path / 'call.jsonl').read_text()
