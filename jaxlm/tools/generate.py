"""Sample text from a run's checkpoint with the KV-cache sampler (jaxlm/generate.py).

  python -m jaxlm.tools.generate --workdir=RUN [--step=N] (--prompt=TEXT | --prompts=FILE) [--max_new_tokens=128]
      [--temperature=0.8] [--top_k=0] [--top_p=1.0] [--seed=0] [--num_samples=1] [--chat] [--output=FILE.jsonl]

--prompts: a text file, one prompt per line (blank lines skipped), or a .jsonl file of {"prompt": ...} records, or
of {"messages": [{"role": ..., "content": ...}, ...]} with --chat. --chat renders each prompt (a "prompt" becomes
one user message) through the run's chat template, ending with the assistant's turn. Without --chat a prompt is
continued after the start token every training document begins with (EOS), as `jaxlm.tools.eval --prompt` does.
--temperature=0 is greedy. All prompts × --num_samples go through the sampler as one batch; each completion is
printed and, with --output, written as one JSON line: prompt, sample, completion, completion_ids, finish_reason
(eos | length). A sample ends at any of the model's end-of-sequence ids (the imported generation_config.json's
eos_token_id list, the tokenizer's eos and its document separator). The last lines give prefill and decode tokens/s.

The run's own config says how to build the model and where its tokenizer is; the checkpoint is restored as
`jaxlm.tools.eval` restores it (jaxlm.tools.load_run), onto the run's mesh when it fits here (a pipelined run's
stages and context parallelism's sequence split become fsdp: sampling splits the batch, not the sequence).
"""

import json
import os

import jax
from absl import flags

from jaxlm import cli
from jaxlm import generate as generate_lib
from jaxlm import rundir
from jaxlm import sharding
from jaxlm.tools import load_run

GenerateError = generate_lib.GenerateError


def read_prompts(path: str, chat: bool) -> list:
  """Prompts from a text file (one per line) or a .jsonl file: strings, or message lists (with `chat`)."""
  try:
    with open(os.path.expanduser(path), encoding='utf-8') as f:
      lines = [line.rstrip('\n') for line in f]
  except OSError as e:
    raise GenerateError(f'cannot read --prompts={path} ({e.strerror or e}); give a text or .jsonl file') from e
  if not path.endswith('.jsonl'):
    return [line for line in lines if line.strip()]
  prompts = []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise GenerateError(f'{path}:{n} is not JSON ({e.msg}); write one {{"prompt": ...}} object per line') from e
    if isinstance(record, dict) and isinstance(record.get('prompt'), str):
      prompts.append(record['prompt'])
    elif isinstance(record, dict) and isinstance(record.get('messages'), list):
      if not chat:
        raise GenerateError(f'{path}:{n} has "messages", which only a chat template can render; add --chat')
      prompts.append(record['messages'])
    else:
      raise GenerateError(f'{path}:{n} has neither a "prompt" string nor a "messages" list; give one of them')
  return prompts


def _chat_renderer(tokenizer):
  """A function rendering a prompt (text or messages) through the run's chat template, ready for the reply."""
  try:
    from jaxlm.data import chat as chat_lib  # pylint: disable=g-import-not-at-top  # chat runs only
  except ImportError:
    chat_lib = None
  template = chat_lib.template_of(tokenizer) if chat_lib is not None else None
  if template is None:
    raise GenerateError('--chat: this run has no chat template (its tokenizer carries none); drop --chat to '
                        'continue plain text, or sample a run fine-tuned with one')
  def render(prompt):
    messages = [{'role': 'user', 'content': prompt}] if isinstance(prompt, str) else prompt
    return chat_lib.render(messages, template, add_generation_prompt=True, special_tokens=tokenizer.special_tokens)
  return render


def _mesh_cfg(cfg):
  """eval's mesh (the run's if it fits, stages as fsdp), with a context split folded into fsdp as well."""
  mesh_cfg = load_run.mesh_cfg(cfg)
  if mesh_cfg.get('context', 1) > 1 or mesh_cfg.get('dcn_context', 1) > 1:
    mesh_cfg = mesh_cfg.copy_and_resolve_references()
    mesh_cfg.update(context=1, dcn_context=1, fsdp=-1)
    mesh_cfg = sharding.single_host_mesh_cfg(mesh_cfg, jax.device_count(), jax.process_count())
  return mesh_cfg


def run(workdir: str, prompts: list, *, step: int | None = None, max_new_tokens: int = 128,
        sampling: generate_lib.Sampling = generate_lib.Sampling(0.8), seed: int = 0, num_samples: int = 1,
        chat: bool = False) -> tuple[list[dict], generate_lib.Output]:
  """One record per (prompt, sample) and the sampler's output, for a run's checkpoint."""
  if not prompts:
    raise GenerateError('no prompts given; pass --prompt=TEXT or a --prompts file with at least one')
  for p in prompts:
    if (not p.strip()) if isinstance(p, str) else not p:
      raise GenerateError('an empty prompt has nothing to continue; give each prompt some text')
  if num_samples < 1:
    raise GenerateError(f'--num_samples={num_samples}: give at least 1')
  path = rundir.step_dir(workdir, step)
  cfg = rundir.read_config(path)
  tokenizer = rundir.load_tokenizer(cfg, workdir)
  # Sampling stops at every id of the model's end-of-sequence list (generation_config.json's, as import copied it),
  # the end-of-turn token (the tokenizer's eos) and the separator that follows every document in training.
  eos = tokenizer.stop_ids or None
  if chat:
    render = _chat_renderer(tokenizer)
    ids = [tokenizer.encode(render(p)) for p in prompts]
  else:
    start = tokenizer.separator_id
    ids = [([start] if start >= 0 else []) + tokenizer.encode(p) for p in prompts]
  generate_lib.check_lengths(ids, max_new_tokens, cfg.data.seq_len)  # before any device work
  mesh = sharding.make_mesh(_mesh_cfg(cfg))
  with sharding.activate(mesh):
    program, params = load_run.restore(path, cfg, mesh)
  print(f'decode cache: {generate_lib.cache_bytes_per_token(program.model.config, params):,} bytes per token')
  out = generate_lib.generate(program.model.config, params, [i for i in ids for _ in range(num_samples)],
                              max_new_tokens, sampling=sampling, seed=seed, eos_id=eos, mesh=mesh,
                              max_len=cfg.data.seq_len)
  records = []
  for row, (tokens, reason) in enumerate(zip(out.tokens, out.finish_reasons)):
    prompt = prompts[row // num_samples]
    records.append({'prompt': prompt, 'sample': row % num_samples, 'completion': tokenizer.decode(tokens),
                    'completion_ids': tokens, 'finish_reason': reason})
  return records, out


def summary(out: generate_lib.Output) -> str:
  """Prefill and decode throughput, one line each."""
  rate = lambda n, s: f'{n / s:,.0f} tokens/s' if s > 0 else 'n/a'
  return (f'prefill: {out.prompt_tokens:,} tokens in {out.prefill_seconds:.3f} s ({rate(out.prompt_tokens, out.prefill_seconds)})\n'
          f'decode: {out.generated_tokens:,} tokens in {out.decode_seconds:.3f} s '
          f'({rate(out.generated_tokens, out.decode_seconds)}); compile {out.compile_seconds:.1f} s')


FLAGS = flags.FLAGS


def _define_flags() -> None:
  # Defined only when run as a program (importing this module defines no flags).
  flags.DEFINE_string('workdir', None, 'Run directory (holds checkpoints/).')
  flags.DEFINE_integer('step', None, 'Checkpoint step (default: the newest).')
  flags.DEFINE_string('prompt', None, 'Text to continue.')
  flags.DEFINE_string('prompts', None, 'A file of prompts: text, one per line, or .jsonl ("prompt" or "messages").')
  flags.DEFINE_integer('max_new_tokens', 128, 'Most tokens to generate per sample.')
  flags.DEFINE_float('temperature', 0.8, 'Sampling temperature; 0 = greedy.')
  flags.DEFINE_integer('top_k', 0, 'Sample from the k most likely tokens only; 0 = all.')
  flags.DEFINE_float('top_p', 1.0, 'Sample from the smallest set of tokens whose probability reaches p; 1 = all.')
  flags.DEFINE_integer('seed', 0, 'Sampling seed.')
  flags.DEFINE_integer('num_samples', 1, 'Samples per prompt.')
  flags.DEFINE_bool('chat', False, 'Render prompts through the run\'s chat template.')
  flags.DEFINE_string('output', None, 'Write one JSON record per sample to this .jsonl file.')


def main(argv):
  del argv
  if (FLAGS.prompt is None) == (FLAGS.prompts is None):
    given = 'both --prompt and --prompts' if FLAGS.prompt is not None else 'neither --prompt nor --prompts'
    raise GenerateError(f'{given} given; give exactly one of --prompt=TEXT and --prompts=FILE')
  if FLAGS.temperature < 0 or FLAGS.top_k < 0 or not 0 < FLAGS.top_p <= 1:
    raise GenerateError(f'--temperature={FLAGS.temperature} --top_k={FLAGS.top_k} --top_p={FLAGS.top_p}: the '
                        f'temperature and top_k must be >= 0 and top_p in (0, 1]')
  prompts = [FLAGS.prompt] if FLAGS.prompt is not None else read_prompts(FLAGS.prompts, FLAGS.chat)
  sampling = generate_lib.Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
  records, out = run(FLAGS.workdir, prompts, step=FLAGS.step, max_new_tokens=FLAGS.max_new_tokens,
                     sampling=sampling, seed=FLAGS.seed, num_samples=FLAGS.num_samples, chat=FLAGS.chat)
  for r in records:
    shown = r['prompt'] if isinstance(r['prompt'], str) else json.dumps(r['prompt'], ensure_ascii=False)
    print(f'--- sample {r["sample"]} ({r["finish_reason"]}) ---')
    print(shown + r['completion'])
  if FLAGS.output:
    try:
      with open(os.path.expanduser(FLAGS.output), 'w', encoding='utf-8') as f:
        for r in records:
          f.write(json.dumps(r, ensure_ascii=False) + '\n')
    except OSError as e:
      raise GenerateError(f'cannot write --output={FLAGS.output} ({e.strerror or e}); check the path') from e
  print(summary(out))


def console() -> None:
  """The command line (also the console script in pyproject.toml)."""
  cli.run(main, define=_define_flags, required=('workdir',))


if __name__ == '__main__':
  console()
