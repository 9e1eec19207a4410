"""Evaluate a run's checkpoint: held-out loss, perplexity, bits per byte, and a sample continuation (a preference
run's also its pairs' preference loss, rewards and log-probabilities, as its train step computes them).

  python -m jaxlm.tools.eval --workdir=runs/palm_small [--step=N] [--batches=16] [--prompt='def '] [--max_tokens=64]
                       [--temperature=0]
  python -m jaxlm.tools.eval --workdir=runs/palm_small --documents=FILE_DIR_OR_GLOB[,...] [--text_field=text]
                       [--txt_docs=file] [--max_documents=N]
  python -m jaxlm.tools.eval --workdir=runs/palm_small --write_jsonl=heldout.jsonl [--max_documents=N]
  python -m jaxlm.tools.eval --workdir=runs/palm_small --tasks=T1,T2 [--include_path=DIR] [--num_fewshot=N] [--limit=N]
                       [--apply_chat_template] [--output_path=DIR] [--log_samples]
  python -m jaxlm.tools.eval --workdir=runs/palm_small --generate=heldout|prompts.jsonl [--num_prompts=64]
                       [--prompt_tokens=16] [--max_tokens=64] [--temperature=1 --top_p=0.95] [--seed=0]
                       [--scorer=JUDGE_RUN] [--embedder=DIR] [--mauve_seeds=0,1,2] [--samples_out=FILE] [--json]

The run's own config (saved with every checkpoint) says how to build the model and where its data and tokenizer
are, so no --config is needed. Loss is on the held-out split the run used: the prepared `eval-*` shards, or the
held-out documents of the embedded stdlib corpus.

Bits per byte = total nats / ln 2 / total UTF-8 bytes of the evaluated text, where the text is what the tokenizer
decodes from the evaluated target tokens, one contiguous run per document and row (separators decode to nothing).
Unlike perplexity it does not depend on the tokenizer, so runs with different vocabularies compare. Decoding a run
that starts mid-document can drop one leading space or split a multi-byte character: an error below 0.1% at
typical row lengths.

--documents scores given .txt / .jsonl / .parquet documents instead, read and cleaned as `jaxlm.data.prepare` reads
them, each on its own exactly as lm-evaluation-harness's `loglikelihood_rolling` scores it (`rolling_windows`):
the start token the model was trained with (EOS) then the document's tokens, in windows of the run's sequence
length. Bits per byte there use the documents' own UTF-8 bytes, so the shipped lm-eval task (TASKS_DIR) on the
same jsonl gives the same number. --write_jsonl writes the run's held-out documents as such a jsonl.

--tasks scores lm-evaluation-harness tasks (its registry, jaxlm/lm_eval_tasks, --include_path) with the run's own
model on its mesh (jaxlm/harness.py), no export and no torch: lm-eval's flag names, its results table, and with
--output_path its results JSON (and --log_samples its per-request samples) as `lm_eval` writes them. The numbers
equal those the training loop logs for train.harness_tasks at the same step.

--generate scores what the model writes (jaxlm/textgen.py), beside a human row: `heldout` cuts --num_prompts
prompts of --prompt_tokens tokens from the held-out batches and keeps the next --max_tokens tokens as the human
continuation; a .jsonl of {"prompt": ..., "reference": ...} uses the references as the human side and adds BLEU,
chrF, TER and exact match. The run's sampler (jaxlm/generate.py) continues every prompt on the run's mesh;
perplexity and coherence are under --scorer (a jaxlm run or an import_llama import; default the run itself),
features for MAUVE and the prompt-continuation cosine from --embedder (default the scorer). The samples go to
--samples_out (default <workdir>/generations/step_<N>.jsonl), one JSON line each.
"""

import collections
import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from jaxlm import cli
from jaxlm.data import chat as chat_lib
from jaxlm.data import pipeline as data_lib
from jaxlm import errors
from jaxlm import model as model_lib
from jaxlm import preference as preference_lib
from jaxlm import rundir
from jaxlm import sharding
from jaxlm.data import readers as sources_lib
from jaxlm.tools import load_run
from jaxlm import step as step_lib
from jaxlm import textgen

# lm-evaluation-harness tasks shipped with jaxlm (`lm_eval --include_path`): bits per byte of a jsonl of documents
# and a small multiple-choice check.
TASKS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'lm_eval_tasks')


class EvalError(errors.JaxlmError, ValueError):
  """Documents or settings that the evaluation cannot use; the message says what to change."""
  exit_code = 2


@functools.partial(jax.jit, static_argnums=0)
def _next_logits(model, params, tokens, n):
  """Float32 logits (V,) after the first `n` tokens of `tokens` (1, T); the rest is padding (segment 0)."""
  T = tokens.shape[1]
  segment_ids = (jnp.arange(T) < n).astype(jnp.int32)[None]  # (1, T)
  positions = jnp.arange(T, dtype=jnp.int32)[None]  # (1, T)
  logits = model.apply({'params': params}, tokens, segment_ids, positions)  # (1, T, V)
  return jax.lax.dynamic_index_in_dim(logits[0], n - 1, keepdims=False).astype(jnp.float32)


def generate(model, params, prompt, max_tokens: int, *, temperature: float = 0.0, seed: int = 0,
             stop_id: int | None = None) -> list[int]:
  """Continues `prompt` (token ids) by up to `max_tokens` tokens: greedy at temperature 0, else sampled.

  Re-runs the full forward each step (no KV cache) over a fixed-length buffer whose unwritten tail is padding
  that causal attention never lets the written tokens see: one compile per model and length.
  """
  prompt = [int(t) for t in prompt]
  tokens = np.zeros((1, len(prompt) + max_tokens), np.int32)
  tokens[0, :len(prompt)] = prompt
  key = jax.random.PRNGKey(seed)
  out = []
  for n in range(len(prompt), tokens.shape[1]):
    logits = _next_logits(model, params, tokens, n)
    if temperature == 0.0:
      token = int(np.argmax(logits))
    else:
      token = int(jax.random.categorical(jax.random.fold_in(key, n), logits / temperature))
    out.append(token)
    tokens[0, n] = token
    if token == stop_id:
      break
  return out


def text_bytes(batch: dict, decode) -> int:
  """UTF-8 bytes of the text the evaluated targets (weight > 0) decode to, one run per (row, document)."""
  total = 0
  targets, weights, segments = batch['targets'], batch['weights'], batch['segment_ids']
  for row in range(targets.shape[0]):
    keep = weights[row] > 0
    for segment in np.unique(segments[row][keep]):
      ids = targets[row][keep & (segments[row] == segment)]
      total += len(decode(ids.tolist()).encode('utf-8'))
  return total


def summarize(nats: float, tokens: float, num_bytes: int) -> dict:
  """Loss per token, perplexity and bits per byte from totals."""
  loss = nats / max(tokens, 1.0)
  return {'loss': loss, 'perplexity': math.exp(min(loss, 700.0)), 'tokens': int(tokens), 'bytes': num_bytes,
          'bits_per_byte': nats / math.log(2) / num_bytes if num_bytes else float('nan')}


def _reference(path: str, program):
  """preference.reference=copy: the frozen copy the run saved, placed as the program expects; else {} (under
  `base` the reference is the parameters with their adapters off, `cached` is in the batches, SimPO has none)."""
  abstract, shardings = program.abstract_state.reference, program.state_shardings.reference
  if not abstract:
    return {}
  saved = rundir.read_reference(path)
  return jax.device_put(jax.tree.map(lambda a, w: np.asarray(a, w.dtype), saved, abstract), shardings)


def _nats_and_tokens(program, params, batches) -> tuple[float, float]:
  """Summed cross-entropy (nats) and weighted target count of `batches` under `params`."""
  totals = [program.eval_step(params, step_lib.global_batch(b, program.batch_sharding)) for b in batches]
  return sum(float(x['loss_sum']) for x in totals), sum(float(x['tokens']) for x in totals)


def evaluate_run(workdir: str, *, step: int | None = None, batches: int | None = None,
                 batch_size: int | None = None, prompt: str | None = None, max_tokens: int = 64,
                 temperature: float = 0.0, seed: int = 0, weights: str = 'raw') -> dict:
  """Held-out metrics (and a sample, if `prompt` is given) of a run's checkpoint, as a dict."""
  path = rundir.step_dir(workdir, step)
  cfg = rundir.read_config(path)
  t = cfg.train
  batch_size = batch_size or t.batch_size
  batches = batches or t.eval_batches
  mesh = sharding.make_mesh(load_run.mesh_cfg(cfg))
  vocab = cfg.model.vocab_size
  with jax.sharding.set_mesh(mesh):
    with nn.logical_axis_rules(sharding.RULES):
      program, params = load_run.restore(path, cfg, mesh, weights)
      preference = program.preference_eval_step is not None  # train.objective=preference: pairs, and their metrics
      eval_data = data_lib.eval_batches(cfg.data, batch_size=batch_size, num_batches=batches, vocab_size=vocab,
                                        reference_logps=preference and preference_lib.reads_cached(t, cfg.preference))
      nats, tokens = _nats_and_tokens(program, params, eval_data)
      if preference:
        pref = step_lib.evaluate_preference(program, params, _reference(path, program), eval_data)
    tokenizer = rundir.load_tokenizer(cfg)
    result = summarize(nats, tokens, sum(text_bytes(b, tokenizer.decode) for b in eval_data))
    result.update(step=int(os.path.basename(path)), batches=len(eval_data), batch_size=batch_size, weights=weights)
    if preference:  # the train step's names (TRL's), over the held-out pairs; `loss` stays the LM loss
      result.update({k.removeprefix('eval_'): v for k, v in pref.items() if k != 'eval_loss'},
                    preference_loss=pref['eval_loss'])
    if prompt is not None:
      # The separator (EOS for SentencePiece) starts every document in training (data.py).
      ids = [tokenizer.separator_id] + tokenizer.encode(prompt)
      stop = tokenizer.separator_id if tokenizer.separator_id >= 0 else None
      model = model_lib.Decoder(model_lib.inference_config(program.model.config))  # fp8 runs: no fp8 state here
      out = generate(model, params, ids, max_tokens, temperature=temperature, seed=seed, stop_id=stop)
      result.update(prompt=prompt, continuation=tokenizer.decode(out))
  return result


def read_documents(specs: Sequence[str], *, text_field: str = 'text', txt_docs: str = 'file',
                   max_documents: int | None = None) -> list[str]:
  """Texts of the documents in `specs` (files, directories, globs), read and cleaned as `prepare` reads them."""
  if txt_docs not in sources_lib.TXT_DOCS:
    raise EvalError(f'txt_docs={txt_docs!r} is unknown; use one of {", ".join(sources_lib.TXT_DOCS)}.')
  if not any(spec.strip() for spec in specs):
    raise EvalError('no documents given; pass --documents=FILE_DIR_OR_GLOB[,...]')
  try:
    sources = sources_lib.expand_inputs(specs)
  except sources_lib.PrepareError as e:
    raise EvalError(f'{str(e).rstrip(".")}; pass .txt / .jsonl / .parquet files, directories or globs '
                    f'that exist') from e
  counts = collections.Counter()
  texts = []
  for source in sources:
    for _, text in sources_lib.read_documents(source, counts, text_field=text_field, txt_docs=txt_docs):
      texts.append(text)
      if max_documents and len(texts) == max_documents:
        return texts
  if not texts:
    dropped = ', '.join(f'{v} {k.removeprefix("dropped_")}' for k, v in sorted(counts.items()) if v)
    raise EvalError(f'{",".join(specs)} holds no documents{f" (dropped: {dropped})" if dropped else ""}; give '
                    f'non-empty .txt files, or .jsonl / .parquet with the text in --text_field={text_field}')
  return texts


def heldout_documents(cfg, *, max_documents: int | None = None) -> list[str]:
  """The run's held-out documents as text, decoded from its prepared eval shards in the order evaluation reads."""
  import grain  # pylint: disable=g-import-not-at-top  # data.py's reader of the shards
  vocab = cfg.model.vocab_size
  tokenizer = rundir.load_tokenizer(cfg)
  texts = []
  for path in data_lib.dataset_dirs(cfg.data, vocab):
    prepared = data_lib.open_prepared(path, vocab)
    shards = prepared.shards('eval')
    if not shards:
      continue
    records = grain.sources.ArrayRecordDataSource(shards)
    for i in range(len(records)):
      # Stored documents carry no BOS/EOS, and SentencePiece decodes control tokens to nothing anyway.
      if prepared.meta.get('content') == 'chat':  # a conversation: its ids, then its loss weights
        ids = chat_lib.from_record(records[i], prepared.meta['dtype'])[0]
      else:
        ids = np.frombuffer(records[i], dtype=prepared.meta['dtype'])
      texts.append(tokenizer.decode(ids.tolist()))
      if max_documents and len(texts) == max_documents:
        return texts
  if not texts:
    raise EvalError('the run\'s data has no held-out documents; prepare it with a larger --eval_fraction')
  return texts


def write_jsonl(path: str, texts: Sequence[str]) -> int:
  """Writes one {"text": ...} line per document (what the shipped lm-eval task reads); returns the text's bytes."""
  path = os.path.expanduser(path)
  if os.path.dirname(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    for text in texts:
      f.write(json.dumps({'text': text}, ensure_ascii=False) + '\n')
  return sum(len(t.encode('utf-8')) for t in texts)


def rolling_windows(ids: Sequence[int], start_id: int, seq_len: int) -> list[tuple[list[int], list[int], int]]:
  """lm-eval's `loglikelihood_rolling` windows of one document: (inputs, targets, how many last targets count)."""
  # The same windows as lm-eval (lm_eval.utils.get_rolling_token_windows with context_len=1), so the two tools
  # agree on any document: the first window is the start token then the first tokens; each later one predicts
  # the next seq_len tokens (fewer at the end) from a full window of the tokens before them, so every token is
  # scored once and, past the first window, with as much context as fits.
  ids = [int(t) for t in ids]
  n = min(seq_len, len(ids))
  windows = [([start_id] + ids[:n - 1], ids[:n], n)] if ids else []
  done = n
  while done < len(ids):
    k = min(len(ids) - done, seq_len)
    end = done + k
    lo = max(end - seq_len - 1, 0)
    windows.append((ids[lo:end - 1], ids[lo + 1:end], k))
    done = end
  return windows


def window_batches(windows, seq_len: int, batch_size: int) -> list[dict]:
  """Windows packed into rows of seq_len (each its own segment, positions from 0), batch_size rows per batch."""
  # Segments keep the windows sharing a row from attending to each other: each scores as if it were alone.
  rows, fill = [], seq_len
  for inputs, targets, scored in windows:
    if fill + len(inputs) > seq_len:
      rows.append({k: np.zeros(seq_len, np.int32) for k in ('inputs', 'targets', 'segment_ids', 'positions')})
      rows[-1]['weights'] = np.zeros(seq_len, np.float32)
      fill = 0
    row, n, segment = rows[-1], len(inputs), int(rows[-1]['segment_ids'].max()) + 1
    row['inputs'][fill:fill + n] = inputs
    row['targets'][fill:fill + n] = targets
    row['segment_ids'][fill:fill + n] = segment
    row['positions'][fill:fill + n] = np.arange(n)
    row['weights'][fill + n - scored:fill + n] = 1.0  # only the window's last `scored` targets are new
    fill += n
  batches = []
  for b in range(0, len(rows), batch_size):
    chunk = rows[b:b + batch_size]
    chunk += [{k: np.zeros_like(v) for k, v in rows[0].items()}] * (batch_size - len(chunk))  # segment 0: padding
    batches.append({k: np.stack([r[k] for r in chunk]) for k in rows[0]})
  return batches


def score_documents(workdir: str, texts: Sequence[str], *, step: int | None = None,
                    batch_size: int | None = None, weights: str = 'raw') -> dict:
  """Loss per token, perplexity and bits per byte of `texts` under a run's checkpoint, as a dict."""
  path = rundir.step_dir(workdir, step)
  cfg = rundir.read_config(path)
  batch_size = batch_size or cfg.train.batch_size
  tokenizer = rundir.load_tokenizer(cfg)
  seq_len = cfg.data.seq_len
  # The start token every training document begins with (data.py): what lm-eval's rolling prefix is for an export.
  windows = [w for text in texts for w in rolling_windows(tokenizer.encode(text), tokenizer.separator_id, seq_len)]
  batches = window_batches(windows, seq_len, batch_size)
  mesh = sharding.make_mesh(load_run.mesh_cfg(cfg))
  with jax.sharding.set_mesh(mesh):
    with nn.logical_axis_rules(sharding.RULES):
      nats, tokens = _nats_and_tokens(*load_run.restore(path, cfg, mesh, weights), batches)
  result = summarize(nats, tokens, sum(len(text.encode('utf-8')) for text in texts))
  result.update(step=int(os.path.basename(path)), documents=len(texts), windows=len(windows), seq_len=seq_len)
  return result


def harness_lm(workdir: str, *, step: int | None = None, weights: str = 'raw', batch_size: int | None = None):
  """(a run's checkpoint as an lm-eval model (jaxlm/harness.py): its parameters on its mesh, its tokenizer; step)."""
  from jaxlm import harness  # pylint: disable=g-import-not-at-top  # lm_eval: --tasks only
  path = rundir.step_dir(workdir, step)
  cfg = rundir.read_config(path)
  mesh = sharding.make_mesh(load_run.mesh_cfg(cfg))
  with sharding.activate(mesh):
    program, params = load_run.restore(path, cfg, mesh, weights)
  # The run's batch size, as the training loop's harness hook uses: the same shapes, so the same numbers.
  scoring = harness.Scoring(program.model.config, params, rundir.load_tokenizer(cfg, workdir), cfg.data.seq_len,
                            mesh, batch_size or cfg.train.batch_size)
  return harness.JaxlmLM(scoring), int(os.path.basename(path))


def _tasks_main() -> None:
  """--tasks: lm-eval's results table; with --output_path its results JSON (and samples) as lm_eval writes them."""
  from jaxlm import harness  # pylint: disable=g-import-not-at-top  # lm_eval: --tasks only
  from lm_eval import utils as lm_eval_utils  # pylint: disable=g-import-not-at-top
  from lm_eval.loggers import EvaluationTracker  # pylint: disable=g-import-not-at-top
  tasks = [t.strip() for t in FLAGS.tasks if t.strip()]
  harness.check_tasks(tasks, FLAGS.include_path)  # before the checkpoint is read: a bad name fails in seconds
  lm, step = harness_lm(FLAGS.workdir, step=FLAGS.step, weights=FLAGS.weights, batch_size=FLAGS.batch_size)
  tracker = EvaluationTracker(output_path=FLAGS.output_path)
  results = harness.evaluate(lm, tasks, include_path=FLAGS.include_path, num_fewshot=FLAGS.num_fewshot,
                             limit=FLAGS.limit, apply_chat_template=FLAGS.apply_chat_template,
                             log_samples=FLAGS.log_samples, tracker=tracker,
                             model_args=f'pretrained={os.path.abspath(FLAGS.workdir)}/step_{step}')
  samples = results.pop('samples', None)
  if jax.process_index():  # every process scored the same requests as one SPMD program: process 0 reports
    return
  if FLAGS.output_path:
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in (results['configs'] if samples else ()):
      tracker.save_results_samples(task_name=task, samples=samples[task])
  print(f'jaxlm ({FLAGS.workdir}, step {step}, weights {FLAGS.weights}), limit: {FLAGS.limit}, num_fewshot: '
        f'{FLAGS.num_fewshot}, batch_size: {lm.scoring.batch_size}')
  print(lm_eval_utils.make_table(results))
  if 'groups' in results:
    print(lm_eval_utils.make_table(results, 'groups'))


def load_scorer(workdir: str, *, step: int | None = None, batch_size: int = 8) -> textgen.Scorer:
  """A run (or an import_llama import) as a textgen.Scorer: its checkpoint on its mesh, with its tokenizer."""
  path = rundir.step_dir(workdir, step)
  cfg = rundir.read_config(path)
  mesh = sharding.make_mesh(load_run.mesh_cfg(cfg))
  with sharding.activate(mesh):
    program, params = load_run.restore(path, cfg, mesh)
  return textgen.Scorer(program.model.config, params, rundir.load_tokenizer(cfg, workdir),
                        seq_len=cfg.data.seq_len, mesh=mesh, name=os.path.abspath(os.path.expanduser(workdir)),
                        step=int(os.path.basename(path)), batch_size=batch_size)


def read_prompt_references(path: str) -> tuple[list[str], list[str]]:
  """(prompts, references) from a .jsonl of {"prompt": ..., "reference": ...} lines."""
  prompts, references = [], []
  try:
    with open(os.path.expanduser(path), encoding='utf-8') as f:
      lines = f.read().splitlines()
  except OSError as e:
    raise EvalError(f'cannot read --generate={path} ({e.strerror or e}); give "heldout" or a .jsonl of '
                    f'{{"prompt": ..., "reference": ...}} lines') from e
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise EvalError(f'{path}:{n} is not JSON ({e.msg}); write one {{"prompt": ..., "reference": ...}} object '
                      f'per line') from e
    if not (isinstance(record, dict) and isinstance(record.get('prompt'), str) and record['prompt'].strip()
            and isinstance(record.get('reference'), str)):
      raise EvalError(f'{path}:{n} needs a non-empty "prompt" string and a "reference" string; give both')
    prompts.append(record['prompt'])
    references.append(record['reference'])
  if not prompts:
    raise EvalError(f'{path} holds no prompts; give one {{"prompt": ..., "reference": ...}} object per line')
  return prompts, references


def generate_and_score(workdir: str, source: str = 'heldout', *, step: int | None = None, num_prompts: int = 64,
                       prompt_tokens: int = 16, max_tokens: int = 64,
                       sampling=None, seed: int = 0, scorer: str | None = None, embedder: str | None = None,
                       mauve_seeds=(0, 1, 2), samples_out: str | None = None) -> dict:
  """Continues held-out (or given) prompts with the run's sampler and scores them beside the human text.

  Returns textgen.score's {'model', 'human', 'signature'}, plus where the samples were written.
  """
  from jaxlm import generate as generate_lib  # pylint: disable=g-import-not-at-top
  sampling = sampling or generate_lib.Sampling()
  references = None
  if source != 'heldout':  # a bad file fails before any device work
    prompts, references = read_prompt_references(source)
    prompts, references = prompts[:num_prompts], references[:num_prompts]
  own = load_scorer(workdir, step=step)
  path = rundir.step_dir(workdir, step)
  cfg = rundir.read_config(path)
  tok, seq_len = own.tokenizer, cfg.data.seq_len
  start = [tok.separator_id] if tok.separator_id >= 0 else []
  if source == 'heldout':
    if prompt_tokens < 1 or prompt_tokens + max_tokens > seq_len:
      raise EvalError(f'--prompt_tokens={prompt_tokens} + --max_tokens={max_tokens} must fit the run\'s '
                      f'{seq_len}-token sequences (prompt >= 1); lower them')
    batches = data_lib.eval_batches(cfg.data, batch_size=cfg.train.batch_size,
                                    num_batches=max(cfg.train.eval_batches, 1), vocab_size=cfg.model.vocab_size)
    pairs = textgen.cut_pairs(batches, num_prompts, prompt_tokens, max_tokens)
    if not pairs:
      raise EvalError(f'no held-out document run holds {prompt_tokens + max_tokens} tokens; lower --prompt_tokens '
                      f'or --max_tokens')
    prompt_ids = [p for p, _ in pairs]
    human_ids = [h for _, h in pairs]
    prompts = [tok.decode(p) for p in prompt_ids]
    human = [tok.decode(h) for h in human_ids]
  else:
    prompt_ids = [start + tok.encode(p) for p in prompts]
    human, human_ids = references, [tok.encode(r) for r in references]
  generate_lib.check_lengths(prompt_ids, max_tokens, seq_len)
  eos = tok.separator_id if tok.separator_id >= 0 else None
  out = generate_lib.generate(own.model_cfg, own.params, prompt_ids, max_tokens, sampling=sampling, seed=seed,
                              eos_id=eos, mesh=own.mesh, max_len=seq_len)
  texts = [tok.decode(t) for t in out.tokens]
  judge = own if scorer is None else load_scorer(scorer)
  features = judge if embedder is None else load_scorer(embedder)
  sig = {'run': own.name, 'step': own.step, 'source': source if source == 'heldout' else os.path.abspath(source),
         'sampling': dataclasses.asdict(sampling), 'seed': seed, 'prompt_tokens': prompt_tokens,
         'max_new_tokens': max_tokens}
  result = textgen.score(prompts, texts, human, model_ids=out.tokens, human_ids=human_ids, scorer=judge,
                         embedder=features, mauve_seeds=tuple(mauve_seeds), references=references, sig=sig)
  samples_out = samples_out or os.path.join(workdir, 'generations', f'step_{own.step}.jsonl')
  records = [{'prompt': p, 'completion': c, 'human': h, 'finish_reason': r, 'completion_ids': ids}
             for p, c, h, r, ids in zip(prompts, texts, human, out.finish_reasons, out.tokens)]
  write_records(samples_out, records)
  result['samples_out'] = samples_out
  return result


def write_records(path: str, records) -> None:
  """One JSON line per record."""
  path = os.path.expanduser(path)
  if os.path.dirname(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w', encoding='utf-8') as f:
    for r in records:
      f.write(json.dumps(r, ensure_ascii=False) + '\n')


FLAGS = flags.FLAGS


def _define_flags() -> None:
  # Defined only when run as a program (importing this module defines no flags).
  flags.DEFINE_string('workdir', None, 'Run directory (holds checkpoints/).')
  flags.DEFINE_integer('step', None, 'Checkpoint step (default: the newest).')
  flags.DEFINE_enum('weights', 'raw', ('raw', 'ema'), 'raw: the trained weights; ema: their moving average '
                    '(runs with optim.ema).')
  flags.DEFINE_integer('batches', None, 'Held-out batches (default: the run\'s train.eval_batches).')
  flags.DEFINE_integer('batch_size', None, 'Sequences per batch (default: the run\'s).')
  flags.DEFINE_string('prompt', None, 'Text to continue; no sample if unset.')
  flags.DEFINE_integer('max_tokens', 64, 'Tokens to generate after the prompt.')
  flags.DEFINE_float('temperature', 0.0, 'Sampling temperature; 0 = greedy.')
  flags.DEFINE_integer('seed', 0, 'Sampling seed.')
  flags.DEFINE_bool('json', False, 'Print the result as one JSON line instead of a table.')
  flags.DEFINE_list('documents', [], 'Score these .txt / .jsonl / .parquet files, directories and globs '
                    '(comma-separated) instead of the held-out split.')
  flags.DEFINE_string('text_field', 'text', 'Field (jsonl) or column (parquet) holding the document text.')
  flags.DEFINE_enum('txt_docs', 'file', sources_lib.TXT_DOCS, 'What one document is in a .txt file.')
  flags.DEFINE_integer('max_documents', None, 'Read at most this many documents (--documents, --write_jsonl).')
  flags.DEFINE_string('generate', None, 'Score generations: "heldout" (prompts cut from the held-out split) or a '
                      '.jsonl of {"prompt": ..., "reference": ...} lines.')
  flags.DEFINE_integer('num_prompts', 64, '--generate: most prompts.')
  flags.DEFINE_integer('prompt_tokens', 16, '--generate=heldout: tokens per prompt.')
  flags.DEFINE_integer('top_k', 0, '--generate: sample from the k most likely tokens only; 0 = all.')
  flags.DEFINE_float('top_p', 1.0, '--generate: nucleus sampling; 1 = all.')
  flags.DEFINE_string('scorer', None, '--generate: the run (or import) whose perplexity scores the text; default '
                      'the run itself.')
  flags.DEFINE_string('embedder', None, '--generate: the run (or import) whose final hidden states are the MAUVE and '
                      'cosine features; default the scorer.')
  flags.DEFINE_list('mauve_seeds', ['0', '1', '2'], '--generate: k-means seeds MAUVE is averaged over.')
  flags.DEFINE_string('samples_out', None, '--generate: where the samples go (default '
                      '<workdir>/generations/step_<N>.jsonl).')
  flags.DEFINE_list('tasks', [], 'lm-evaluation-harness tasks to score (comma-separated), jaxlm/harness.py.')
  flags.DEFINE_string('include_path', None, '--tasks: more task YAML folders (comma-separated).')
  flags.DEFINE_integer('num_fewshot', None, '--tasks: few-shot examples per request (default: each task\'s).')
  flags.DEFINE_float('limit', None, '--tasks: examples per task (a fraction if below 1).')
  flags.DEFINE_bool('apply_chat_template', False, '--tasks: render requests with the tokenizer\'s chat template.')
  flags.DEFINE_string('output_path', None, '--tasks: folder (or .json file) for the results JSON.')
  flags.DEFINE_bool('log_samples', False, '--tasks: also write every request and its response (with '
                    '--output_path).')
  flags.DEFINE_string('write_jsonl', None, 'Write the run\'s held-out documents to this jsonl ({"text": ...} per '
                      'line, what the shipped lm-eval task reads) and exit.')


def main(argv):
  del argv
  try:
    if FLAGS.write_jsonl:
      cfg = rundir.read_config(rundir.step_dir(FLAGS.workdir, FLAGS.step))
      texts = heldout_documents(cfg, max_documents=FLAGS.max_documents)
      num_bytes = write_jsonl(FLAGS.write_jsonl, texts)
      print(f'wrote {len(texts):,} held-out documents ({num_bytes:,} bytes) to {FLAGS.write_jsonl}; score them '
            f'with --documents={FLAGS.write_jsonl}')
      return
    if FLAGS.generate:
      _generate_main()
      return
    if FLAGS.tasks:
      _tasks_main()
      return
    if FLAGS.documents:
      texts = read_documents(FLAGS.documents, text_field=FLAGS.text_field, txt_docs=FLAGS.txt_docs,
                             max_documents=FLAGS.max_documents)
      r = score_documents(FLAGS.workdir, texts, step=FLAGS.step, batch_size=FLAGS.batch_size, weights=FLAGS.weights)
    else:
      r = evaluate_run(FLAGS.workdir, step=FLAGS.step, batches=FLAGS.batches, batch_size=FLAGS.batch_size,
                       prompt=FLAGS.prompt, max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature,
                       seed=FLAGS.seed, weights=FLAGS.weights)
  except OSError as e:  # an unwritable --write_jsonl, a document file that vanished while being read
    if isinstance(e, errors.JaxlmError):
      raise
    where = f': {e.filename}' if e.filename else ''
    raise EvalError(f'{e.strerror or e}{where}; check the path and its permissions') from e
  if FLAGS.json:
    print(json.dumps(r))
    return
  if FLAGS.documents:
    print(f'step {r["step"]}: {r["documents"]:,} documents, {r["tokens"]:,} tokens, {r["bytes"]:,} bytes '
          f'({r["windows"]:,} windows of up to {r["seq_len"]} tokens)')
  else:
    print(f'step {r["step"]}: {r["batches"]} held-out batches of {r["batch_size"]}, {r["tokens"]:,} tokens, '
          f'{r["bytes"]:,} bytes')
  print(f'  loss           {r["loss"]:.4f} nats/token')
  print(f'  perplexity     {r["perplexity"]:.2f}')
  print(f'  bits per byte  {r["bits_per_byte"]:.4f}')
  if 'preference_loss' in r:
    print(f'preference, {r["pairs"]:.0f} held-out pairs: loss {r["preference_loss"]:.4f}, reward accuracy '
          f'{r["rewards/accuracies"]:.3f}, margin {r["rewards/margins"]:.4f} (chosen {r["rewards/chosen"]:.4f}, '
          f'rejected {r["rewards/rejected"]:.4f}), log-probs chosen {r["logps/chosen"]:.2f} rejected '
          f'{r["logps/rejected"]:.2f}')
  if 'continuation' in r:
    print(f'sample ({"greedy" if FLAGS.temperature == 0 else f"temperature {FLAGS.temperature}"}):')
    print(r['prompt'] + r['continuation'])


def _generate_main() -> None:
  from jaxlm import generate as generate_lib  # pylint: disable=g-import-not-at-top
  if FLAGS.temperature < 0 or FLAGS.top_k < 0 or not 0 < FLAGS.top_p <= 1:
    raise EvalError(f'--temperature={FLAGS.temperature} --top_k={FLAGS.top_k} --top_p={FLAGS.top_p}: the '
                    f'temperature and top_k must be >= 0 and top_p in (0, 1]')
  try:
    seeds = tuple(int(x) for x in FLAGS.mauve_seeds)
  except ValueError as e:
    raise EvalError(f'--mauve_seeds={",".join(FLAGS.mauve_seeds)}: give integers, comma-separated') from e
  r = generate_and_score(FLAGS.workdir, FLAGS.generate, step=FLAGS.step, num_prompts=FLAGS.num_prompts,
                         prompt_tokens=FLAGS.prompt_tokens, max_tokens=FLAGS.max_tokens,
                         sampling=generate_lib.Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p),
                         seed=FLAGS.seed, scorer=FLAGS.scorer, embedder=FLAGS.embedder, mauve_seeds=seeds,
                         samples_out=FLAGS.samples_out)
  if FLAGS.json:
    print(json.dumps(r, sort_keys=True))
    return
  sig = r['signature']
  print(f'step {sig["step"]}: {sig["samples"]} prompts ({sig["source"]}), sampling {sig["sampling"]}, seed '
        f'{sig["seed"]}; scorer {sig.get("scorer")} step {sig.get("scorer_step")}')
  print(textgen.table(r))
  for warning in textgen.warnings(r['model'], r['human']):
    print(f'WARNING {warning}')
  print(f'samples: {r["samples_out"]}')


def console() -> None:
  """The command line (also the console script in pyproject.toml)."""
  cli.run(main, define=_define_flags, required=('workdir',))


if __name__ == '__main__':
  console()
