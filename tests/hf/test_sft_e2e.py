"""Fine-tuning end to end: a tiny random Hugging Face Llama with its own byte-level BPE tokenizer (chat template
in tokenizer_config.json) → import_llama → prepare --format=chat with the imported tokenizer → train from
checkpoint.init_from for train.epochs → the assistant-token eval loss falls well below its start → export →
transformers loads it, apply_chat_template gives prepare's ids and the logits match jaxlm's."""

import json
import os

import jax
import numpy as np
import pytest

from jaxlm import model as model_lib
from jaxlm import rundir
from jaxlm.data import chat as chat_lib
from jaxlm.data import pipeline as data_lib
from jaxlm.data import prepare as prepare_lib
from jaxlm.data import tokenizer as tokenizer_lib
from jaxlm.hf import export
from tests.data import chat_fixtures
from tests.helpers import load_config, read_records, run_cli
from tests.hf.test_tokenizer_files import ids_of, tiny_hf_llama

T = 128
EPOCHS = 6


@pytest.fixture(scope='module')
def sft(tmp_path_factory):
  """The whole path, run once: every test below reads its results."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  os.environ['HF_HUB_OFFLINE'] = '1'
  d = tmp_path_factory.mktemp('sft')
  hf_dir = chat_fixtures.make_tokenizer(str(d / 'hf'), post='bos')
  vocab = tokenizer_lib.load(hf_dir).vocab_size
  tiny_hf_llama(transformers, torch, hf_dir, vocab)
  done = run_cli('jaxlm.hf.import_llama', f'--hf_dir={hf_dir}', f'--out={d / "import"}', devices=1, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  lines = done.stdout.splitlines()
  tokenizer = os.path.abspath(d / 'import')
  assert f'  python -m jaxlm.data.prepare --format=chat --tokenizer={tokenizer} --seq_len=256 ' in done.stdout
  assert lines[-2] == 'train with (in a new --workdir):'
  imported = {'tokenizer': tokenizer, 'flags': lines[-1].strip(),
              'checkpoint': os.path.join(tokenizer, 'checkpoints', '0')}
  assert os.path.isfile(os.path.join(tokenizer, 'tokenizer.json'))
  chat_fixtures.write_jsonl(d / 'chat.jsonl', chat_fixtures.conversations(240, seed=1))
  meta = prepare_lib.prepare(prepare_lib.expand_inputs([str(d / 'chat.jsonl')]), str(d / 'chat'),
                             tokenizer=imported['tokenizer'], workers=1, data_format='chat', seq_len=T,
                             eval_fraction=0.1, progress=False)
  workdir = d / 'run'
  out = run_cli('jaxlm.train', '--config=configs/sft_example.py', f'--workdir={workdir}', *imported['flags'].split(),
                f'--config.data.paths={d / "chat"}', f'--config.data.seq_len={T}', f'--config.data.cache_dir={d}',
                '--config.model.dtype=float32', '--config.model.remat=none', f'--config.train.epochs={EPOCHS}',
                '--config.train.batch_size=8', '--config.train.log_every=5', '--config.train.eval_batches=2',
                '--config.optim.lr=3e-3', '--config.optim.warmup_steps=5', '--config.log.tensorboard=False',
                '--config.log.compilation_cache=', timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  export.export(str(workdir), str(d / 'back'))
  return dict(d=d, imported=imported, meta=meta, workdir=workdir, stdout=out.stdout, torch=torch,
              transformers=transformers)


def _assistant_loss(cfg, params, batches) -> float:
  """Mean cross-entropy over the weighted (assistant) tokens of `batches`, computed here with jaxlm's model."""
  model = model_lib.Decoder(model_lib.ModelConfig.from_config(cfg.model))
  apply = jax.jit(model.apply)
  total = count = 0.0
  for b in batches:
    logits = apply({'params': params}, b['inputs'], b['segment_ids'], b['positions'])
    ce = model_lib.loss_fn(logits, b['targets'], b['weights'], 0.0)[1]['loss']
    total, count = total + float(ce) * b['weights'].sum(), count + b['weights'].sum()
  return total / count


def test_assistant_eval_loss_falls_well_below_its_start(sft):
  cfg = rundir.read_config(rundir.step_dir(str(sft['workdir'])))
  assert cfg.train.steps == -(-EPOCHS * data_lib.steps_for_epochs(cfg.data, cfg.train, cfg.model.vocab_size)[1]
                              // cfg.train.batch_size)
  assert f'train.epochs={EPOCHS}' in sft['stdout'] and 'epoch ' in sft['stdout']  # the progress line shows it
  assert 'warm start: parameters from' in sft['stdout']
  batches = data_lib.eval_batches(cfg.data, batch_size=cfg.train.batch_size, num_batches=cfg.train.eval_batches,
                                  vocab_size=cfg.model.vocab_size, process_index=0, process_count=1)
  start = _assistant_loss(cfg, rundir.read_params(sft['imported']['checkpoint']), batches)
  end = _assistant_loss(cfg, rundir.read_params(rundir.step_dir(str(sft['workdir']))), batches)
  evals = read_records(sft['workdir'], 'eval')
  np.testing.assert_allclose(evals[-1]['eval_loss'], end, rtol=1e-4)  # eval reports the assistant-token loss
  assert read_records(sft['workdir'])[-1]['epoch'] == pytest.approx(EPOCHS, abs=1.0)
  print(f'\nassistant-token eval loss: {start:.3f} at the warm start -> {end:.3f} after {EPOCHS} epochs')
  assert end < 0.5 * start, (start, end)


def test_export_loads_in_transformers_with_the_same_chat_ids_and_logits(sft):
  torch, transformers, d = sft['torch'], sft['transformers'], sft['d']
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(d / 'back'))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(d / 'back')).float().eval()
  ours = tokenizer_lib.load(str(d / 'chat'))
  cfg = rundir.read_config(rundir.step_dir(str(sft['workdir'])))
  cfg.model.dtype = 'float32'
  model = model_lib.Decoder(model_lib.ModelConfig.from_config(cfg.model))
  params = rundir.read_params(rundir.step_dir(str(sft['workdir'])))
  worst = 0.0
  apply = jax.jit(model.apply)  # one program per length, not one per op
  for record in chat_fixtures.conversations(4, seed=7):
    messages = chat_lib.messages_of(record)
    ids, _, _ = chat_lib.encode(ours, chat_lib.template_of(ours), messages)
    assert ids_of(hf_tok.apply_chat_template(messages, tokenize=True)) == ids.tolist()
    tokens = ids[None].astype(np.int32)
    with torch.no_grad():
      theirs = hf_model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    mine = np.asarray(apply({'params': params}, tokens, np.ones_like(tokens),
                            np.arange(tokens.shape[1], dtype=np.int32)[None]))
    worst = max(worst, float(np.abs(mine - theirs).max()))
  print(f'\nmax |logits(jaxlm) - logits(transformers)| after fine-tuning: {worst:.2e}')
  assert worst <= 1e-4
  # The held-out text encodes to what prepare stores, and generation stops at the end of a turn.
  assert hf_tok('Ada has 3 pianos.', add_special_tokens=False)['input_ids'] == ours.encode('Ada has 3 pianos.')
  generation = json.loads((d / 'back' / 'generation_config.json').read_text())
  assert ours.token_to_id('<|eot_id|>') in generation['eos_token_id']


def test_generate_chat_replies_equal_transformers_greedy_on_the_export(sft):
  # `jaxlm.tools.generate --chat` renders the run's chat template with the generation prompt and stops at every
  # id of the model's end-of-sequence list, as transformers does with apply_chat_template + generate on the
  # export (its generation_config.json).
  from jaxlm import generate as generate_lib
  from jaxlm.tools import generate as tool
  torch, transformers, d = sft['torch'], sft['transformers'], sft['d']
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(d / 'back'))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(d / 'back')).float().eval()
  stops = json.loads((d / 'back' / 'generation_config.json').read_text())['eos_token_id']
  assert stops == tokenizer_lib.load(str(d / 'chat')).stop_ids and len(stops) == 2
  chats = [[m for m in chat_lib.messages_of(record) if m['role'] != 'assistant'][:2]
           for record in chat_fixtures.conversations(3, seed=11)]
  # The three chats in one call, as a --prompts file gives them: one restore and one set of compiled programs.
  records, _ = tool.run(str(sft['workdir']), chats, max_new_tokens=16, sampling=generate_lib.Sampling(0.0),
                        chat=True)
  assert [r['prompt'] for r in records] == chats
  for messages, record in zip(chats, records):
    prompt = ids_of(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    with torch.no_grad():
      out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=stops[0])
    theirs = out[0, len(prompt):].tolist()
    mine = record['completion_ids']
    assert mine == theirs[:len(mine)] and theirs[len(mine):] in [[]] + [[i] for i in stops], (mine, theirs)
    assert record['finish_reason'] == ('eos' if set(stops) & set(theirs) else 'length')
