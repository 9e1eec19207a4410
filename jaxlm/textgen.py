"""Scores for generated text, beside the human text it continues: repetition, diversity, fluency, coherence,
MAUVE and reference overlap.

The protocol is the open-ended generation one (SimCTG, contrastive decoding): prompts are cut from held-out human
text and their human continuations kept; the model continues the same prompts; both sides are scored the same
way, so every number has a human row beside it. Raw numbers fool: a sampler that repeats one token has a far
lower perplexity than human text, so the gap to the human row is what to read.

  rep = textgen.repetition(texts, ids)                     # numpy only
  scorer = textgen.Scorer(model_cfg, params, tokenizer, seq_len=T, mesh=mesh, name=RUN, step=N)
  rows = textgen.score(prompts, model_texts, human_texts, scorer=scorer, ...)

Shared by `python -m jaxlm.tools.eval --generate` and the trainer's `train.gen_eval`. sacrebleu and mauve-text
are optional (`pip install jaxlm[textgen]`), imported where they are used.
"""

import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import math

import numpy as np

from jaxlm import errors

NGRAMS = (2, 3, 4)  # rep-n orders; diversity is the product of (1 - rep-n) over them (SimCTG)


class TextgenError(errors.JaxlmError, ValueError):
  """Samples or settings the generation metrics cannot use; the message says what to change."""
  exit_code = 2


def _require(module: str, package: str):
  """A lazily imported optional package, or one `jaxlm:` line naming the extra that installs it."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise TextgenError(f'{package} is not installed; pip install "jaxlm[textgen]" (or {package} alone)') from e


# ---------------------------------------------------------------------------------------------------------------
# Repetition and diversity (numpy / plain Python: no scorer)

def words(text: str) -> list[str]:
  """Whitespace-separated words, as the published rep-n numbers count them."""
  return text.split()


def _ngrams(units, n: int) -> list[tuple]:
  return [tuple(units[i:i + n]) for i in range(len(units) - n + 1)]


def rep_n(sequences, n: int) -> float | None:
  """1 - unique / total n-grams, each sequence's unique n-grams summed over the corpus (SimCTG's rep-n, as a
  fraction); None when no sequence has an n-gram."""
  unique = total = 0
  for units in sequences:
    grams = _ngrams(list(units), n)
    unique += len(set(grams))
    total += len(grams)
  return 1.0 - unique / total if total else None


def distinct_n(sequences, n: int) -> float | None:
  """Distinct n-grams over the whole corpus / all n-grams (Li et al., 2016); None when there are none."""
  seen, total = set(), 0
  for units in sequences:
    grams = _ngrams(list(units), n)
    seen.update(grams)
    total += len(grams)
  return len(seen) / total if total else None


def seq_rep_n(sequences, n: int = 4) -> tuple[float | None, int]:
  """(mean over sequences of 1 - unique / total n-grams (Welleck et al., 2019), sequences skipped for having
  no n-gram); the mean is None when every one is skipped."""
  values, skipped = [], 0
  for units in sequences:
    grams = _ngrams(list(units), n)
    if not grams:
      skipped += 1
      continue
    values.append(1.0 - len(set(grams)) / len(grams))
  return (float(np.mean(values)) if values else None), skipped


def _diversity(reps: list) -> float | None:
  return None if any(r is None for r in reps) else float(np.prod([1.0 - r for r in reps]))


def repetition(texts: list[str], token_ids: list[list[int]] | None = None) -> dict:
  """rep-2/3/4, diversity, distinct-1/2 and seq-rep-4, on words and (given ids) on tokens (`token_` keys).

  Words compare with published numbers; tokens suit code and text without spaces. Sequences too short for an
  n-gram add nothing; `skipped` counts those without a 4-gram.
  """
  out = {}
  levels = [('', [words(t) for t in texts])]
  if token_ids is not None:
    levels.append(('token_', [list(map(int, ids)) for ids in token_ids]))
  for prefix, seqs in levels:
    reps = [rep_n(seqs, n) for n in NGRAMS]
    out.update({f'{prefix}rep_{n}': r for n, r in zip(NGRAMS, reps)})
    out[f'{prefix}diversity'] = _diversity(reps)
    out[f'{prefix}distinct_1'] = distinct_n(seqs, 1)
    out[f'{prefix}distinct_2'] = distinct_n(seqs, 2)
    out[f'{prefix}seq_rep_4'], out[f'{prefix}skipped'] = seq_rep_n(seqs, 4)
  return out


# ---------------------------------------------------------------------------------------------------------------
# Fluency and coherence under a scorer run

def likelihood(logprobs: list[np.ndarray]) -> dict:
  """Perplexity over all continuation tokens, and coherence: the mean over samples of the mean log-probability
  of a continuation's tokens given its prompt. Empty continuations are skipped (counted)."""
  kept = [np.asarray(x, np.float64) for x in logprobs if len(x)]
  tokens = sum(len(x) for x in kept)
  if not tokens:
    return {'perplexity': None, 'coherence_loglik': None, 'scored_tokens': 0, 'empty': len(logprobs)}
  nll = -sum(float(x.sum()) for x in kept) / tokens
  return {'perplexity': math.exp(min(nll, 700.0)), 'coherence_loglik': float(np.mean([x.mean() for x in kept])),
          'scored_tokens': tokens, 'empty': len(logprobs) - len(kept)}


def perplexity_gap(model_ppl: float | None, human_ppl: float | None) -> float | None:
  """ln(model perplexity) - ln(human perplexity): nats per token; below 0 the text is more predictable than
  human text (repetition, greedy), above 0 less (noise)."""
  if not model_ppl or not human_ppl:
    return None
  return math.log(model_ppl) - math.log(human_ppl)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
  """Mean cosine similarity of the rows of `a` and `b` (pairs: prompt and continuation features)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
  return float(np.mean((a * b).sum(-1) / np.maximum(norms, 1e-12)))


# ---------------------------------------------------------------------------------------------------------------
# MAUVE (mauve-text on precomputed features)

def mauve(p_features: np.ndarray, q_features: np.ndarray, seeds=(0, 1, 2), num_buckets='auto') -> dict:
  """MAUVE of the model's features `p` against the human's `q` (mauve-text), mean and sd over k-means seeds."""
  mauve_lib = _require('mauve', 'mauve-text')
  p, q = np.asarray(p_features, np.float32), np.asarray(q_features, np.float32)
  if len(p) < 2 or len(q) < 2:
    raise TextgenError(f'MAUVE needs at least 2 samples on each side (got {len(p)} and {len(q)}); generate more')
  with _one_faiss_thread():
    scores = [float(mauve_lib.compute_mauve(p_features=p, q_features=q, num_buckets=num_buckets, seed=s,
                                            verbose=False).mauve) for s in seeds]
  return {'mauve': float(np.mean(scores)), 'mauve_sd': float(np.std(scores)), 'mauve_seeds': list(seeds)}


@contextlib.contextmanager
def _one_faiss_thread():
  """faiss's k-means on one thread: on the few hundred points an evaluation has, its OpenMP threads spin far
  longer than the clustering takes (on a busy host, by orders of magnitude); the result is the same."""
  faiss = _require('faiss', 'faiss-cpu')
  threads = faiss.omp_get_max_threads()
  faiss.omp_set_num_threads(1)
  try:
    yield
  finally:
    faiss.omp_set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------------------
# Reference overlap (sacrebleu)

def reference_overlap(hypotheses: list[str], references: list[str]) -> dict:
  """Corpus BLEU, chrF and TER (sacrebleu, default settings, one reference each) with their signatures, and
  exact match (the share of hypotheses equal to their reference, as lm-eval's exact_match with no options)."""
  if len(hypotheses) != len(references):
    raise TextgenError(f'{len(hypotheses)} samples but {len(references)} references; give one reference each')
  sacrebleu = _require('sacrebleu', 'sacrebleu')
  out = {}
  for name, metric in (('bleu', sacrebleu.BLEU()), ('chrf', sacrebleu.CHRF()), ('ter', sacrebleu.TER())):
    out[name] = float(metric.corpus_score(hypotheses, [references]).score)
    out[f'{name}_signature'] = str(metric.get_signature())
  out['exact_match'] = float(np.mean([h == r for h, r in zip(hypotheses, references)])) if hypotheses else None
  return out


# ---------------------------------------------------------------------------------------------------------------
# The scorer: a jaxlm run (or an import_llama import) giving log-probabilities and final hidden states

def _bucket(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


@dataclasses.dataclass
class Scorer:
  """A run that scores text: its model config, parameters, tokenizer, and what identifies it in a signature.

  Each (context, continuation) pair is one row, right-padded (segment 0, never attended to); a context longer
  than what leaves the continuation room in `seq_len` keeps its last tokens.
  """
  model_cfg: object
  params: object
  tokenizer: object
  seq_len: int
  mesh: object = None
  name: str = ''
  step: int | None = None
  batch_size: int = 8

  def encode_pairs(self, prompts: list[str], continuations: list[str]) -> list[tuple[list[int], list[int]]]:
    """(context ids, continuation ids): the start token every training document begins with, then the prompt."""
    start = [self.tokenizer.separator_id] if self.tokenizer.separator_id >= 0 else []
    return [(start + self.tokenizer.encode(p), self.tokenizer.encode(c)) for p, c in zip(prompts, continuations)]

  def _rows(self, pairs):
    """Packed arrays (rows, L) and each row's (context length, continuation length) after truncation."""
    kept = []
    for ctx, cont in pairs:
      cont = list(cont)[:self.seq_len - 1]
      ctx = list(ctx)[-(self.seq_len - len(cont)):] or [0]
      kept.append((ctx, cont))
    L = min(_bucket(max(len(c) + len(x) for c, x in kept)), self.seq_len)
    ways = 1 if self.mesh is None else _batch_ways(self.mesh)
    B = math.ceil(min(self.batch_size, len(kept)) / ways) * ways
    n = math.ceil(len(kept) / B) * B
    tokens = np.zeros((n, L), np.int32)
    segments = np.zeros((n, L), np.int32)
    for r, (ctx, cont) in enumerate(kept):
      ids = ctx + cont
      tokens[r, :len(ids)] = ids
      segments[r, :len(ids)] = 1
    return tokens, segments, [(len(c), len(x)) for c, x in kept], B

  def _forward(self, pairs, what: str):
    """Per batch of rows: the program's outputs (log-probs of the next tokens, or final hidden states)."""
    import jax  # pylint: disable=g-import-not-at-top  # the numpy metrics above need no JAX
    from jaxlm import sharding  # pylint: disable=g-import-not-at-top
    tokens, segments, lengths, B = self._rows(pairs)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    fn = _program(self.model_cfg, what)
    outs = []
    context = sharding.activate(self.mesh) if self.mesh is not None else _no_rules()
    with context:
      for b in range(0, len(tokens), B):
        batch = (tokens[b:b + B], segments[b:b + B], np.ascontiguousarray(positions[b:b + B]))
        if self.mesh is not None:
          batch = jax.device_put(batch, _row_sharding(self.mesh))
        outs.append(np.asarray(fn(self.params, *batch)))
    return np.concatenate(outs), tokens, lengths

  def token_logprobs(self, pairs) -> list[np.ndarray]:
    """Float32 log-probabilities of each continuation's tokens given its context (one array per pair)."""
    if not pairs:
      return []
    logp, tokens, lengths = self._forward(pairs, 'logprobs')  # (rows, L): log p(token t+1 | tokens <= t)
    return [logp[r, c - 1:c - 1 + n].astype(np.float32) for r, (c, n) in enumerate(lengths)]

  def features(self, pairs) -> np.ndarray:
    """(pairs, D) float32: the final hidden states (after the final norm) averaged over each continuation's
    tokens, read in the context of its prompt; an empty continuation gets its context's last state."""
    hidden, _, lengths = self._forward(pairs, 'hidden')  # (rows, L, D)
    out = [hidden[r, c:c + n].mean(0) if n else hidden[r, c - 1] for r, (c, n) in enumerate(lengths)]
    return np.stack(out).astype(np.float32)

  def signature(self) -> dict:
    return {'scorer': self.name, 'scorer_step': self.step}


class _no_rules:
  def __enter__(self):
    import flax.linen as nn  # pylint: disable=g-import-not-at-top
    self._ctx = nn.logical_axis_rules(())
    return self._ctx.__enter__()

  def __exit__(self, *exc):
    return self._ctx.__exit__(*exc)


def _batch_ways(mesh) -> int:
  from jaxlm import generate  # pylint: disable=g-import-not-at-top
  from jaxlm import sharding  # pylint: disable=g-import-not-at-top
  return sharding.ways(mesh, generate._batch_axes(mesh))  # pylint: disable=protected-access


def _row_sharding(mesh):
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from jaxlm import generate  # pylint: disable=g-import-not-at-top
  return NamedSharding(mesh, P(generate._batch_axes(mesh)))  # pylint: disable=protected-access


@functools.lru_cache(maxsize=16)
def _program(model_cfg, what: str):
  """The jitted scoring forward of one model (cached: one compile per model, kind and shape)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxlm import generate  # pylint: disable=g-import-not-at-top
  model = generate.inference_model(model_cfg)

  def logprobs(params, tokens, segments, positions):
    logits = model.apply({'params': params}, tokens, segments, positions).astype(jnp.float32)  # (B, L, V)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]  # (B, L-1)

  def hidden(params, tokens, segments, positions):
    _, state = model.apply({'params': params}, tokens, segments, positions,
                           capture_intermediates=lambda mdl, _: mdl.name == 'final_norm', mutable=['intermediates'])
    return state['intermediates']['final_norm']['__call__'][0].astype(jnp.float32)  # (B, L, D)

  return jax.jit({'logprobs': logprobs, 'hidden': hidden}[what])


# ---------------------------------------------------------------------------------------------------------------
# Prompts cut from held-out text, and the whole table

def cut_pairs(batches, num: int, prompt_tokens: int, new_tokens: int) -> list[tuple[list[int], list[int]]]:
  """Up to `num` (prompt ids, human continuation ids) from held-out batches: from each document run in a row
  (one segment), consecutive non-overlapping windows of prompt_tokens + new_tokens, taken in reading order."""
  pairs = []
  width = prompt_tokens + new_tokens
  for batch in batches:
    inputs, segments = np.asarray(batch['inputs']), np.asarray(batch['segment_ids'])
    for row in range(inputs.shape[0]):
      for seg in np.unique(segments[row][segments[row] > 0]):
        ids = inputs[row][segments[row] == seg].tolist()
        for s in range(0, len(ids) - width + 1, width):
          pairs.append((ids[s:s + prompt_tokens], ids[s + prompt_tokens:s + width]))
          if len(pairs) == num:
            return pairs
  return pairs


def versions() -> dict:
  """Versions of what the numbers depend on (signatures)."""
  out = {}
  for name in ('jaxlm', 'numpy', 'sacrebleu', 'mauve-text'):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def signature(**parts) -> dict:
  """What a number was measured with (scorer run and step, sampling, lengths, samples, package versions), so
  that numbers are compared only like with like."""
  return {**parts, 'versions': versions()}


def score(prompts: list[str], model_texts: list[str], human_texts: list[str], *, model_ids=None, human_ids=None,
          scorer: Scorer | None = None, embedder: Scorer | None = None, mauve_seeds=(0, 1, 2),
          references: list[str] | None = None, sig: dict | None = None) -> dict:
  """The model row and the human row of one evaluation: {'model': {...}, 'human': {...}, 'signature': {...}}.

  scorer: perplexity and coherence likelihood; embedder (default the scorer): features for MAUVE and the
  prompt–continuation cosine. references: switches on BLEU / chrF / TER / exact match (model row only).
  """
  if not (len(prompts) == len(model_texts) == len(human_texts)):
    raise TextgenError(f'{len(prompts)} prompts, {len(model_texts)} samples and {len(human_texts)} human '
                       f'continuations; give one of each per prompt')
  rows = {'model': repetition(model_texts, model_ids), 'human': repetition(human_texts, human_ids)}
  for name, texts in (('model', model_texts), ('human', human_texts)):
    rows[name]['samples'] = len(texts)
    rows[name]['mean_words'] = float(np.mean([len(words(t)) for t in texts])) if texts else 0.0
  embedder = embedder or scorer
  if scorer is not None:
    for name, texts in (('model', model_texts), ('human', human_texts)):
      rows[name].update(likelihood(scorer.token_logprobs(scorer.encode_pairs(prompts, texts))))
    rows['model']['perplexity_gap'] = perplexity_gap(rows['model']['perplexity'], rows['human']['perplexity'])
    rows['human']['perplexity_gap'] = 0.0
  if embedder is not None:
    # Prompt and continuation each on its own (after the start token): read together, the continuation's states
    # would carry the prompt and the cosine would say little.
    prompt_features = embedder.features(embedder.encode_pairs([''] * len(prompts), prompts))
    feats = {}
    for name, texts in (('model', model_texts), ('human', human_texts)):
      alone = embedder.encode_pairs([''] * len(texts), texts)  # the continuation on its own: start token only
      rows[name]['coherence_cosine'] = cosine(prompt_features, embedder.features(alone))
      feats[name] = embedder.features(embedder.encode_pairs(prompts, texts))
    if mauve_seeds and len(prompts) >= 2:
      rows['model'].update(mauve(feats['model'], feats['human'], seeds=mauve_seeds))
  if references is not None:
    rows['model'].update(reference_overlap(model_texts, references))
    rows['human'].update(reference_overlap(human_texts, references))
  return {**rows, 'signature': signature(**(sig or {}), samples=len(prompts),
                                         **(scorer.signature() if scorer is not None else {}),
                                         **({'embedder': embedder.name} if embedder is not None else {}),
                                         mauve_seeds=list(mauve_seeds) if embedder is not None else None)}


def warnings(model: dict, human: dict, tolerance: float = 0.1) -> list[str]:
  """Where repetition or diversity leaves the human range (the human value ± `tolerance`), in words."""
  out = []
  for key, worse in (('token_rep_4', 'more'), ('rep_4', 'more'), ('token_seq_rep_4', 'more'),
                     ('diversity', 'less'), ('token_diversity', 'less')):
    m, h = model.get(key), human.get(key)
    if m is None or h is None:
      continue
    if abs(m - h) > tolerance:
      direction = 'above' if m > h else 'below'
      out.append(f'{key} {m:.3f} is {direction} the human {h:.3f}'
                 + (' (degenerate repetition?)' if (direction == 'above') == (worse == 'more') else ''))
  return out


def table(result: dict) -> str:
  """The model and human rows as an aligned table."""
  from jaxlm import metrics  # pylint: disable=g-import-not-at-top
  model, human = result['model'], result['human']
  keys = [k for k in model if not k.endswith('_signature') and k != 'mauve_seeds']
  fmt = lambda v: '-' if v is None else (f'{v:.4f}' if isinstance(v, float) else str(v))  # noqa: E731
  return metrics.format_table([(k, fmt(model.get(k)), fmt(human.get(k))) for k in keys],
                              header=('metric', 'model', 'human'), right=(False, True, True), rule=True)



# ---------------------------------------------------------------------------------------------------------------
# During training: train.gen_eval

class GenEval:
  """The trainer's generation metrics (train.gen_eval): fixed prompts cut once from the held-out batches, the
  human side's texts and repetition cached, the run itself as the scorer (and, with train.gen_eval_mauve, the
  feature source for MAUVE: a yardstick that moves with training, unlike `eval --generate --scorer=JUDGE`)."""

  def __init__(self, train_cfg, eval_batches, tokenizer, model_cfg, *, seq_len: int, mesh=None):
    t = train_cfg
    self.every, self.tokenizer, self.model_cfg, self.seq_len, self.mesh = t.gen_eval, tokenizer, model_cfg, \
        seq_len, mesh
    self.new_tokens, self.seed = t.gen_eval_tokens, t.seed
    from jaxlm import generate  # pylint: disable=g-import-not-at-top  # the sampler; runs with gen_eval only
    self.sampling = generate.Sampling(temperature=t.gen_eval_temperature, top_p=t.gen_eval_top_p)
    self.mauve_seeds = (0, 1, 2) if t.gen_eval_mauve else ()
    pairs = cut_pairs(eval_batches, t.gen_eval_prompts, t.gen_eval_prompt_tokens, t.gen_eval_tokens)
    if not pairs:
      raise TextgenError(f'no held-out document run holds train.gen_eval_prompt_tokens + train.gen_eval_tokens = '
                         f'{t.gen_eval_prompt_tokens + t.gen_eval_tokens} tokens; lower them')
    self.prompt_ids = [p for p, _ in pairs]
    self.prompts = [tokenizer.decode(p) for p in self.prompt_ids]
    self.human_ids = [h for _, h in pairs]
    self.human = [tokenizer.decode(h) for h in self.human_ids]
    self.human_repetition = repetition(self.human, self.human_ids)  # cached: the human side never changes

  def due(self, step: int, eval_every: int, last_step: int) -> bool:
    """Every `every`-th evaluation, and at the last step."""
    index = step // eval_every if eval_every else 1
    return bool(self.every) and (index % self.every == 0 or step == last_step)

  def __call__(self, params) -> tuple[dict, list[dict]]:
    """(the gen record: the model's metrics, human ones as human_*; a few samples) for `params`."""
    from jaxlm import generate  # pylint: disable=g-import-not-at-top
    eos = self.tokenizer.separator_id if self.tokenizer.separator_id >= 0 else None
    out = generate.generate(self.model_cfg, params, self.prompt_ids, self.new_tokens, sampling=self.sampling,
                            seed=self.seed, eos_id=eos, mesh=self.mesh, max_len=self.seq_len)
    texts = [self.tokenizer.decode(t) for t in out.tokens]
    scorer = Scorer(self.model_cfg, params, self.tokenizer, seq_len=self.seq_len, mesh=self.mesh,
                    name='the run itself')
    sig = {'sampling': dataclasses.asdict(self.sampling), 'seed': self.seed,
           'prompt_tokens': len(self.prompt_ids[0]), 'max_new_tokens': self.new_tokens}
    result = score(self.prompts, texts, self.human, model_ids=out.tokens, human_ids=self.human_ids,
                   scorer=scorer, mauve_seeds=self.mauve_seeds, sig=sig)
    record = {k: v for k, v in result['model'].items() if isinstance(v, (int, float))}
    record['signature'] = json.dumps(result['signature'], sort_keys=True)  # a string: TensorBoard skips it
    record.update({f'human_{k}': v for k, v in result['human'].items() if isinstance(v, (int, float))})
    samples = [{'prompt': p, 'completion': c, 'human': h} for p, c, h in zip(self.prompts, texts, self.human)][:3]
    return record, samples
