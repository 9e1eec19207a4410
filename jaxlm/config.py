"""Cross-field checks and derived values of a config, run before any device work.

A user's mistake must end in one line that names the field and the fix, never in a traceback from deep inside
JAX. `validate` collects every problem it finds, so one run shows them all.
"""

import math
import os

import ml_collections
import numpy as np

from jaxlm import attention
from jaxlm import distributed
from jaxlm import lora as lora_lib
from jaxlm import mla
from jaxlm import mtp
from jaxlm import model
from jaxlm import moe
from jaxlm import optimizer
from jaxlm import policy
from jaxlm import pipeline as pipeline_lib
from jaxlm import preflight
from jaxlm import sharding
from jaxlm import stability
from jaxlm import step as step_lib
from jaxlm.data import chat as chat_lib
from jaxlm.data import pipeline
from jaxlm import locations
from jaxlm.errors import ConfigError  # noqa: F401

# Each list of allowed values is declared once, in the module that acts on it; validation reads it there.
DTYPES = model.DTYPES
MATMUL_DTYPES = model.MATMUL_DTYPES
ROPE_SCALINGS = model.ROPE_SCALINGS
REMAT_POLICIES = (*model.REMAT_CHOICES, preflight.REMAT_AUTO)
ATTENTION_IMPLS = attention.IMPLS
DATA_SOURCES = pipeline.SOURCES
STABILITY_POLICIES = stability.POLICIES
PIPELINE_SCHEDULES = pipeline_lib.SCHEDULES
QK_NORMS = model.QK_NORMS
MOE_ROUTERS = moe.ROUTERS
MOE_IMPLS = moe.IMPLS
MOE_TRANSPORTS = moe.TRANSPORTS
MOE_AUX_LOSS_FORMS = moe.AUX_LOSS_FORMS

def _model_errors(m) -> list[str]:
  e = []
  for key in ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads'):
    if m[key] <= 0:
      e.append(f'model.{key} is {m[key]}; it must be a positive integer.')
  for key in ('head_dim', 'mlp_dim'):
    if m[key] < 0:
      e.append(f'model.{key} is {m[key]}; use a positive size, or 0 for the default.')
  if e:
    return e
  if m.num_heads % m.num_kv_heads:
    e.append(f'model.num_kv_heads={m.num_kv_heads} does not divide model.num_heads={m.num_heads}; pick a '
             f'divisor of num_heads (1 = multi-query, num_heads = multi-head).')
  if not m.head_dim and m.d_model % m.num_heads:
    e.append(f'model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; change one, '
             f'or set model.head_dim explicitly.')
  elif model.head_dim(m) % 2:
    e.append(f'model.head_dim resolves to {model.head_dim(m)}; rotary embeddings need an even head size.')
  for key in ('dtype', 'param_dtype'):
    if m[key] not in DTYPES:
      e.append(f'model.{key}={m[key]!r} is unknown; use one of {", ".join(DTYPES)}.')
  if m.remat not in REMAT_POLICIES:
    e.append(f'model.remat={m.remat!r} is unknown; use one of {", ".join(REMAT_POLICIES)}.')
  if m.attention not in ATTENTION_IMPLS:
    e.append(f'model.attention={m.attention!r} is unknown; use one of {", ".join(ATTENTION_IMPLS)}.')
  if not 0.0 <= m.dropout_rate < 1.0:
    e.append(f'model.dropout_rate={m.dropout_rate} must be in [0, 1).')
  if m.z_loss < 0:
    e.append(f'model.z_loss={m.z_loss} must be >= 0 (0 turns it off).')
  if m.rope_theta <= 0 or m.norm_eps <= 0:
    e.append('model.rope_theta and model.norm_eps must be positive.')
  e += _rope_errors(m)
  return e


def _rope_errors(m) -> list[str]:
  kind = m.get('rope_scaling', 'none')
  if kind not in ROPE_SCALINGS:
    return [f'model.rope_scaling={kind!r} is unknown; use one of {", ".join(ROPE_SCALINGS)}.']
  e = []
  mscale = m.get('rope_mscale_all_dim', 0.0)  # a saved config may predate the key
  if mscale < 0 or (mscale and (kind != 'yarn' or not m.get('kv_lora_rank', 0))):
    e.append(f'model.rope_mscale_all_dim={mscale} must be >= 0 and is read only by multi-head latent attention '
             f'under yarn (DeepSeek); set model.rope_scaling=yarn and model.kv_lora_rank > 0, or it to 0.')
  if kind == 'none':
    return e
  if m.rope_factor < 1:
    e.append(f'model.rope_factor={m.rope_factor} must be >= 1 under rope_scaling={kind} (the new context is that '
             f'many times the original); set it, e.g. --config.model.rope_factor=8.')
  if kind in ('llama3', 'yarn') and m.rope_original_max_positions <= 0:
    e.append(f'model.rope_scaling={kind} needs model.rope_original_max_positions: the context length the model was '
             f'first trained at (e.g. 8192 for Llama 3.1).')
  if kind == 'llama3' and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
    e.append(f'model.rope_low_freq_factor={m.rope_low_freq_factor} must be positive and below '
             f'model.rope_high_freq_factor={m.rope_high_freq_factor} (Llama 3.1: 1 and 4).')
  if kind == 'yarn' and not 0 < m.rope_beta_slow < m.rope_beta_fast:
    e.append(f'model.rope_beta_slow={m.rope_beta_slow} must be positive and below '
             f'model.rope_beta_fast={m.rope_beta_fast} (YaRN: 1 and 32).')
  if kind == 'yarn' and m.rope_attention_factor < 0:
    e.append(f'model.rope_attention_factor={m.rope_attention_factor} must be >= 0 (0 = 0.1·ln(factor) + 1).')
  return e


def _moe_errors(c, num_devices: int) -> list[str]:
  """model.qk_norm and the mixture-of-experts keys (read only when model.moe_experts > 0)."""
  m = c.model
  e = []
  if m.get('qk_norm', 'none') not in QK_NORMS:
    e.append(f'model.qk_norm={m.qk_norm!r} is unknown; use one of {", ".join(QK_NORMS)}.')
  X = m.get('moe_experts', 0)
  if X < 0:
    e.append(f'model.moe_experts={X} must be >= 0 (0 = dense MLPs).')
  layout_ok = not sharding.MeshShape.errors(c.mesh, num_devices)
  shape = sharding.MeshShape.resolve(c.mesh, num_devices) if layout_ok else None
  if X == 0 and shape and shape.experts > 1:
    e.append(f'mesh.expert×mesh.dcn_expert = {shape.experts} on a dense model (model.moe_experts=0): there are no '
             f'experts to split; give those devices to mesh.fsdp or mesh.data, or set model.moe_experts.')
  if X <= 0:
    return e
  if not 1 <= m.moe_top_k <= X:
    e.append(f'model.moe_top_k={m.moe_top_k} must be between 1 and model.moe_experts={X}.')
  for key in ('moe_mlp_dim', 'moe_shared_experts'):
    if m[key] < 0:
      e.append(f'model.{key}={m[key]} must be >= 0.')
  first = m.get('moe_first_dense', 0)
  if not 0 <= first < m.num_layers:
    e.append(f'model.moe_first_dense={first} must be between 0 and model.num_layers - 1 = {m.num_layers - 1} '
             f'(the first k layers dense, DeepSeek\'s first_k_dense_replace).')
  elif m.moe_every < 1 or (m.num_layers - first) % m.moe_every:
    e.append(f'model.moe_every={m.moe_every} must be a positive divisor of model.num_layers - model.moe_first_dense'
             f' = {m.num_layers - first} (every n-th layer is MoE, the scanned unit is a group of n layers).')
  if m.moe_router not in MOE_ROUTERS:
    e.append(f'model.moe_router={m.moe_router!r} is unknown; use one of {", ".join(MOE_ROUTERS)}.')
  groups, top_groups = m.get('moe_groups', 1), m.get('moe_top_groups', 1)
  if groups < 1 or X % groups or not 1 <= top_groups <= groups:
    e.append(f'model.moe_groups={groups} must divide model.moe_experts={X}, and model.moe_top_groups={top_groups} '
             f'be between 1 and it (1/1: no group-limited routing).')
  elif groups > 1 and m.moe_router not in ('deepseek_v3', 'deepseek_v2'):
    e.append(f'model.moe_groups={groups} is DeepSeek-V3\'s group-limited routing (and V2\'s); use '
             f'model.moe_router=deepseek_v3 or deepseek_v2, or model.moe_groups=1.')
  elif top_groups < groups and (X // groups < 2 or m.moe_top_k > top_groups * (X // groups)):
    e.append(f'model.moe_top_groups={top_groups} of model.moe_groups={groups} leaves {top_groups * (X // groups)} '
             f'experts in groups of {X // groups} for model.moe_top_k={m.moe_top_k}: groups score by their best two '
             f'experts and must hold k; choose fewer groups or more top groups.')
  if m.moe_impl not in MOE_IMPLS:
    e.append(f'model.moe_impl={m.moe_impl!r} is unknown; use one of {", ".join(MOE_IMPLS)}.')
  for key in ('moe_capacity_factor', 'moe_aux_loss', 'moe_router_z_loss', 'moe_bias_rate'):
    if m[key] < 0:
      e.append(f'model.{key}={m[key]} must be >= 0 (0 = off{", dropless" if key == "moe_capacity_factor" else ""}).')
  if m.moe_routed_scale <= 0:
    e.append(f'model.moe_routed_scale={m.moe_routed_scale} must be positive.')
  if m.get('moe_aux_loss_form', 'switch') not in MOE_AUX_LOSS_FORMS:
    e.append(f'model.moe_aux_loss_form={m.moe_aux_loss_form!r} is unknown; use one of {", ".join(MOE_AUX_LOSS_FORMS)}.')
  if m.get('moe_transport', 'auto') not in MOE_TRANSPORTS:
    e.append(f'model.moe_transport={m.moe_transport!r} is unknown; use one of {", ".join(MOE_TRANSPORTS)}.')
  if m.get('moe_buffer_factor', 0.0) < 0:
    e.append(f'model.moe_buffer_factor={m.moe_buffer_factor} must be >= 0 (0 = the worst case: never overflows).')
  if shape:
    if X % shape.experts:
      e.append(f'model.moe_experts={X} is not divisible by mesh.expert×mesh.dcn_expert = {shape.experts}; each '
               f'device of the expert axis holds moe_experts / that many experts, so pick sizes that divide.')
    if shape.stages > 1:
      e.append(f'model.moe_experts={X} with mesh.stage={shape.stages}: mixture-of-experts layers do not run '
               f'inside a pipeline yet; set mesh.stage=1 (shard with fsdp or tensor instead).')
    F = m.moe_mlp_dim or model.mlp_dim(m)
    if F % shape.size('tensor'):
      e.append(f'model.moe_mlp_dim={F} is not divisible by mesh.tensor={shape.size("tensor")}; experts\' hidden '
               f'width is split over tensor, so pick a width that divides.')
  return e


def _lora_errors(c) -> list[str]:
  """model.lora (jaxlm/model.py): the adapters' shape, and the optimizer settings that cannot run on them."""
  lo = c.model.get('lora')
  if not lo or not lo.get('rank', 0):
    if lo and lo.get('rank', 0) < 0:
      return [f'model.lora.rank={lo.rank} must be >= 0 (0 = off).']
    return []
  e = []
  if not isinstance(lo.rank, int) or lo.rank < 0:
    e.append(f'model.lora.rank={lo.rank} must be a non-negative integer (0 = off).')
  if lo.alpha <= 0:
    e.append(f'model.lora.alpha={lo.alpha} must be positive (the branch is scaled by alpha / rank).')
  targets = lora_lib.LoraConfig.from_config(lo).targets
  mla = bool(c.model.get('kv_lora_rank', 0))
  known = lora_lib.LORA_TARGETS + (lora_lib.MLA_TARGETS if mla else ())
  if not targets or any(t not in known for t in targets):
    only = '' if mla else f' ({", ".join(lora_lib.MLA_TARGETS)}: MLA\'s only)'
    e.append(f'model.lora.targets={tuple(targets)} must name some of {", ".join(known)}{only}.')
  all_moe = c.model.get('moe_experts', 0) > 0 and c.model.get('moe_every', 1) == 1 and not c.model.get(
      'moe_first_dense', 0)
  named = [t for t in targets if t in lora_lib.MLP_TARGETS]
  if all_moe and named and tuple(targets) != lora_lib.LORA_TARGETS:  # asked for by name, not the default's
    e.append(f'model.lora.targets names {", ".join(named)}: every layer\'s MLP is a mixture of experts, which LoRA '
             f'never adapts (its experts are not the dense projections a peft adapter exports, e.g. gpt-oss\'s '
             f'fused expert weights); target the attention projections (query, key, value, out).')
  if lo.base_dtype not in lora_lib.LORA_BASE_DTYPES:
    e.append(f'model.lora.base_dtype={lo.base_dtype!r} is unknown; use one of {", ".join(lora_lib.LORA_BASE_DTYPES)}.')
  if c.optim.name == 'muon':
    e.append('optim.name=muon cannot run on LoRA adapters (it orthogonalises whole weight matrices, and an '
             'adapter is a rank-r factor); use optim.name=adamw, adafactor or sf_adamw with model.lora.')
  return e


def _preference_errors(c) -> list[str]:
  """train.objective and the preference section (jaxlm/preference.py)."""
  from jaxlm import preference  # pylint: disable=import-outside-toplevel
  objective = c.train.get('objective', 'lm')
  if objective not in step_lib.OBJECTIVES:
    return [f'train.objective={objective!r} is unknown; use one of {", ".join(step_lib.OBJECTIVES)}.']
  if objective == 'distill':  # its section is checked beside the loss (jaxlm/distill.py)
    from jaxlm import distill  # pylint: disable=import-outside-toplevel
    return distill.config_errors(c)
  if objective != 'preference':
    return []
  r, e = c.get('preference'), []
  if r is None:
    return ['train.objective=preference needs a preference section; start from configs/dpo_example.py.']
  if r.loss_type not in preference.LOSS_TYPES:
    e.append(f'preference.loss_type={r.loss_type!r} is unknown; use one of {", ".join(preference.LOSS_TYPES)}.')
  if r.beta <= 0:
    e.append(f'preference.beta={r.beta} must be positive.')
  if r.reference not in preference.REFERENCES:
    e.append(f'preference.reference={r.reference!r} is unknown; use one of {", ".join(preference.REFERENCES)}.')
  elif r.reference == 'base' and not c.model.get('lora', {}).get('rank', 0):
    e.append('preference.reference=base is the LoRA model with its adapters off, but model.lora.rank=0; set '
             'model.lora.rank, or use preference.reference=copy (a frozen copy of the initial weights).')
  if r.get('reference_dtype', 'float32') not in preference.REFERENCE_DTYPES:
    e.append(f'preference.reference_dtype={r.reference_dtype!r} is unknown; use one of '
             f'{", ".join(preference.REFERENCE_DTYPES)}.')
  if c.model.get('matmul_dtype') == 'fp8':
    e.append('train.objective=preference does not run with model.matmul_dtype=fp8 (the reference forward would '
             'advance the fp8 scales); set model.matmul_dtype=dtype.')
  if c.data.source != 'prepared':
    e.append('train.objective=preference reads preference pairs: set data.source=prepared and data.paths to the '
             'output of `python -m jaxlm.data.prepare --format=preference`.')
  return e


def _fp8_errors(c) -> list[str]:
  """model.matmul_dtype and the settings fp8 matmuls do not combine with."""
  m = c.model
  if m.matmul_dtype not in MATMUL_DTYPES:
    return [f'model.matmul_dtype={m.matmul_dtype!r} is unknown; use one of {", ".join(MATMUL_DTYPES)}.']
  if m.matmul_dtype != 'fp8':
    return []
  e = []
  if m.dtype == 'float16':
    e.append('model.matmul_dtype=fp8 needs model.dtype=bfloat16 (or float32); float16 loss scaling and fp8 '
             'scaling are not combined.')
  if c.train.microbatches > 1:
    # Each microbatch would update the same amax histories from the same old values; summing those is wrong.
    e.append(f'model.matmul_dtype=fp8 does not combine with train.microbatches={c.train.microbatches}; use '
             f'train.microbatches=1 (lower model.remat or shard wider to fit).')
  if m.explicit_transpose_grads:
    e.append('model.matmul_dtype=fp8 computes its own weight gradients; set model.explicit_transpose_grads=False.')
  return e


def _deterministic_errors(c) -> list[str]:
  """train.deterministic and the parts that have no deterministic form (attention.py's module docstring)."""
  if c.train.deterministic and c.model.attention == 'cudnn':
    return ['model.attention=cudnn has no deterministic backward under train.deterministic=True (cuDNN flash '
            'attention under --xla_gpu_deterministic_ops); set model.attention=xla, or auto (xla on a GPU then).']
  return []


def _data_errors(d) -> list[str]:
  e = []
  if 'reference_logps' in d:  # one switch, not two that must agree
    e.append('data.reference_logps is not a setting: cached reference log-probabilities are read when '
             'preference.reference=cached; remove data.reference_logps.')
  if d.source not in DATA_SOURCES:
    e.append(f'data.source={d.source!r} is unknown; use one of {", ".join(DATA_SOURCES)}.')
  if d.source == 'prepared' and not d.paths:
    e.append('data.source=prepared needs data.paths: directories written by `python -m jaxlm.data.prepare`.')
  if d.source == 'stream':
    if not d.paths:
      e.append('data.source=stream needs data.paths: parquet / jsonl / txt files, directories or globs.')
    if not d.get('tokenizer'):
      e.append('data.source=stream needs data.tokenizer: a .model, a tokenizer.json, or a directory with one.')
  if d.get('stream_format', 'text') not in ('text', 'chat'):
    e.append(f'data.stream_format={d.stream_format!r} is unknown; use text or chat.')
  if d.get('empty_think', 'mask') not in chat_lib.EMPTY_THINK:
    e.append(f'data.empty_think={d.empty_think!r} is unknown; use one of {", ".join(chat_lib.EMPTY_THINK)}.')
  if d.get('stream_lanes', 0) < 0:
    e.append(f'data.stream_lanes={d.stream_lanes} must be >= 0 (0 = train.batch_size).')
  if d.weights and d.source != 'stream' and len(d.weights.split(',')) != len(d.paths.split(',')):
    e.append(f'data.weights has {len(d.weights.split(","))} entries but data.paths has '
             f'{len(d.paths.split(","))}; give one weight per path, or none.')
  if d.seq_len <= 0:
    e.append(f'data.seq_len={d.seq_len} must be positive.')
  if not 0.0 < d.eval_fraction < 1.0:
    e.append(f'data.eval_fraction={d.eval_fraction} must be between 0 and 1.')
  if d.num_workers < 0 or d.prefetch < 0:
    e.append('data.num_workers and data.prefetch must be >= 0.')
  return e


def batch_stages(train_cfg, seq_len: int) -> list[tuple[int, float]]:
  """[(batch size, tokens before which it applies), ...] ending with (train.batch_size, inf)."""
  stages = []
  for item in filter(None, (x.strip() for x in train_cfg.batch_ramp.split(','))):
    size, until = item.split(':')
    stages.append((int(size), float(until)))
  return stages + [(train_cfg.batch_size, math.inf)]


def _harness_errors(t) -> list[str]:
  """train.harness_*: the tasks themselves (known, offline) are checked at start-up, by jaxlm/harness.py."""
  tasks, e = t.get('harness_tasks', ()), []
  if not isinstance(tasks, (tuple, list)) or not all(isinstance(x, str) and x for x in tasks):
    e.append(f'train.harness_tasks={tasks!r} must be a tuple of lm-eval task names, e.g. "(\'arc_easy\',)".')
  every = t.get('harness_every', 0)
  if every < 0 or t.get('harness_limit', 0) < 0:
    e.append(f'train.harness_every={every} and train.harness_limit={t.get("harness_limit", 0)} must be >= 0.')
  elif tasks and every and t.eval_every and every % t.eval_every:
    e.append(f'train.harness_every={every} must be a multiple of train.eval_every={t.eval_every} (harness tasks '
             f'are scored at evaluations); change either.')
  for folder in (p for p in t.get('harness_include_path', '').split(',') if p):
    if tasks and not os.path.isdir(os.path.expanduser(folder)):
      e.append(f'train.harness_include_path: {folder} is not a folder; give folders of lm-eval task YAMLs.')
  return e


def _gen_eval_errors(t, d, num_processes: int) -> list[str]:
  if not t.get('gen_eval', 0):
    return []
  e = []
  if t.gen_eval_prompt_tokens + t.gen_eval_tokens > d.seq_len:
    e.append(f'train.gen_eval_prompt_tokens + train.gen_eval_tokens = {t.gen_eval_prompt_tokens + t.gen_eval_tokens} '
             f'must fit data.seq_len={d.seq_len}; lower them.')
  if num_processes > 1:  # each process would cut its prompts from its own held-out rows; the sampler needs one set
    e.append(f'train.gen_eval runs on one process only, not {num_processes}: set it to 0 and score a checkpoint '
             f'with python -m jaxlm.tools.eval --generate=heldout.')
  return e


def _train_errors(t, o) -> list[str]:
  e = []
  if t.batch_ramp:
    try:
      stages = batch_stages(t, 1)
    except ValueError:
      return [f'train.batch_ramp={t.batch_ramp!r} must read "size:until_tokens,...", e.g. "4:20000,8:60000".']
    sizes, untils = [s for s, _ in stages], [u for _, u in stages]
    if any(b % sizes[0] for b in sizes) or untils != sorted(untils) or sizes != sorted(sizes):
      e.append(f'train.batch_ramp={t.batch_ramp!r}: sizes must grow, each a multiple of the first, up to '
               f'train.batch_size={t.batch_size}, at growing token counts.')
  for key in ('steps', 'batch_size', 'microbatches', 'log_every', 'eval_batches'):
    if t[key] <= 0:
      e.append(f'train.{key}={t[key]} must be a positive integer.')
  if t.get('epochs', 0) < 0:
    e.append(f'train.epochs={t.epochs} must be >= 0 (0 = train for train.steps).')
  if t.get('epochs', 0) and t.batch_ramp:
    e.append('train.epochs counts rows of one batch size; it does not combine with train.batch_ramp. Set '
             'train.steps instead, or drop the ramp.')
  if t.eval_every < 0:
    e.append(f'train.eval_every={t.eval_every} must be >= 0 (0 = evaluate only at the end).')
  prompts = t.get('sample_prompts', ())
  if not isinstance(prompts, (tuple, list)) or not all(isinstance(p, str) and p for p in prompts):
    e.append(f'train.sample_prompts={prompts!r} must be a tuple of non-empty texts, e.g. "(\'def \',)".')
  if prompts and t.get('sample_tokens', 1) < 1:
    e.append(f'train.sample_tokens={t.sample_tokens} must be a positive integer.')
  if t.get('gen_eval', 0) < 0:
    e.append(f'train.gen_eval={t.gen_eval} must be >= 0 (every N-th evaluation; 0 = off).')
  if t.get('gen_eval', 0) and (t.gen_eval_prompts < 1 or t.gen_eval_prompt_tokens < 1 or t.gen_eval_tokens < 1
                               or t.gen_eval_temperature < 0 or not 0 < t.gen_eval_top_p <= 1):
    e.append('train.gen_eval_prompts, gen_eval_prompt_tokens and gen_eval_tokens must be positive, '
             'gen_eval_temperature >= 0 and gen_eval_top_p in (0, 1].')
  if o.lr <= 0:
    e.append(f'optim.lr={o.lr} must be positive.')
  if o.name not in optimizer.OPTIMIZERS:
    e.append(f'optim.name={o.name!r} is unknown; use one of {", ".join(optimizer.OPTIMIZERS)}.')
  if o.get('muon_scale', 'rms') not in optimizer.MUON_SCALES:
    e.append(f'optim.muon_scale={o.muon_scale!r} is unknown; use rms or spectral.')
  if not 0 <= o.get('muon_momentum', 0.95) < 1 or o.get('muon_ns_steps', 5) < 1 or o.get('adam_lr', 0.0) < 0:
    e.append('optim.muon_momentum must be in [0, 1), optim.muon_ns_steps >= 1 and optim.adam_lr >= 0.')
  if not 0 <= o.get('ema', 0.0) < 1 or o.get('ema_start', 0) < 0:
    e.append(f'optim.ema={o.ema} must be in [0, 1) (0 = off) and optim.ema_start >= 0.')
  if o.schedule not in optimizer.SCHEDULES:
    e.append(f'optim.schedule={o.schedule!r} is unknown; use one of cosine, linear, wsd, constant.')
  if not 0.0 < o.decay_fraction <= 1.0:
    e.append(f'optim.decay_fraction={o.decay_fraction} must be in (0, 1].')
  if o.warmup_steps < 0 or o.warmup_steps >= max(t.steps, 1):
    e.append(f'optim.warmup_steps={o.warmup_steps} must be >= 0 and shorter than train.steps={t.steps}; '
             f'lower warmup_steps or raise train.steps.')
  if not 0.0 <= o.final_lr_fraction <= 1.0:
    e.append(f'optim.final_lr_fraction={o.final_lr_fraction} must be in [0, 1].')
  if not (0.0 <= o.b1 < 1.0 and 0.0 <= o.b2 < 1.0):
    e.append(f'optim.b1={o.b1} and optim.b2={o.b2} must be in [0, 1).')
  if o.loss_scale_init < 1 or o.loss_scale_period < 1:
    e.append('optim.loss_scale_init and optim.loss_scale_period must be >= 1.')
  if o.eps <= 0 or o.weight_decay < 0 or o.clip < 0:
    e.append('optim.eps must be positive; optim.weight_decay and optim.clip must be >= 0.')
  return e


def _mesh_errors(c, num_devices: int, num_processes: int, num_slices: int) -> list[str]:
  if layout := sharding.MeshShape.errors(c.mesh, num_devices, num_processes, num_slices):
    return layout
  shape = sharding.MeshShape.resolve(c.mesh, num_devices)
  data, fsdp, tensor, context = (shape.size(a) for a in ('data', 'fsdp', 'tensor', 'context'))
  e = _pipeline_errors(c, shape.stages, data * fsdp) + model.block_errors(c.model, shape.stages) + mla.mla_errors(c.model) + mtp.mtp_errors(c.model, shape.stages)
  if context > 1 and c.data.seq_len > 0 and c.data.seq_len % (2 * context):
    e.append(f'data.seq_len={c.data.seq_len} is not divisible by 2 × mesh.context = 2×{context}: context '
             f'parallelism cuts each sequence into 2·context chunks (the load-balanced zig-zag order); use a '
             f'seq_len that is a multiple of {2 * context}, or a smaller mesh.context.')
  block_q = c.model.get('attention_block_q', 0)
  if block_q < 0:
    e.append(f'model.attention_block_q={block_q} must be >= 0 (0 = all query rows at once).')
  elif block_q and c.data.seq_len > 0 and c.data.seq_len % (context * block_q):
    e.append(f'model.attention_block_q={block_q} does not divide the {c.data.seq_len // context} query rows of '
             f'each context shard (data.seq_len={c.data.seq_len} / mesh.context={context}); use a divisor of '
             f'{c.data.seq_len // context}, or 0.')
  if tensor > 1 and c.data.seq_len > 0 and c.data.seq_len % (context * tensor):
    # As Megatron asserts seq_length % tensor_parallel_size == 0 under --sequence-parallel: an uneven split
    # would leave the residual stream padded or whole, silently losing the memory the tensor axis should save.
    e.append(f'data.seq_len={c.data.seq_len} is not divisible by mesh.context × mesh.tensor = {context}×{tensor}: '
             f'between layers each sequence is split over context and then tensor (sequence parallelism); use a '
             f'seq_len that is a multiple of {context * tensor}, or a smaller mesh.tensor.')
  if context > 1 and shape.stages > 1:
    e.append(f'mesh.context={context} with mesh.stage={shape.stages}: context parallelism does not run inside '
             f'a pipeline yet; use one of them (mesh.context=1 or mesh.stage=1).')
  # Processes that differ only along tensor or context across hosts read the same rows (sharding.row_share).
  same_rows = shape.dcn[sharding.AXES.index('tensor')] * shape.dcn[sharding.AXES.index('context')]
  shares = num_processes // same_rows if num_processes % same_rows == 0 else num_processes
  if c.train.batch_size % shares:
    e.append(f'train.batch_size={c.train.batch_size} is not divisible by the {shares} processes that read '
             f'different rows; each reads batch_size / {shares} rows, so use a multiple of {shares}.')
  m = c.model
  micro = max(c.train.microbatches, 1)
  try:
    sizes = [size for size, _ in batch_stages(c.train, 1)]
  except ValueError:
    sizes = [c.train.batch_size]
  # The expert axis splits the batch (and `embed`) as one more fsdp axis (sharding.EXPERT_RULES).
  expert = shape.experts
  fsdp_names, fsdp_text = ('fsdp×expert', f'{fsdp}×{expert}') if expert > 1 else ('fsdp', f'{fsdp}')
  for size in sizes:
    if size % (data * fsdp * expert * micro):
      field = 'train.batch_size' if size == c.train.batch_size else 'train.batch_ramp size'
      e.append(f'{field}={size} is not divisible by mesh data×{fsdp_names} × train.microbatches = '
               f'{data}×{fsdp_text}×{micro}; use a multiple of {data * fsdp * expert * micro}.')
  if m.num_heads > 0 and m.num_heads % tensor:
    e.append(f'model.num_heads={m.num_heads} is not divisible by mesh.tensor={tensor}; heads are split over '
             f'the tensor axis, so pick a tensor size that divides the head count.')
  if m.d_model > 0 and m.d_model % (fsdp * expert):
    e.append(f'model.d_model={m.d_model} is not divisible by mesh.{fsdp_names}={fsdp_text}; parameters are sharded '
             f'over {fsdp_names} along d_model, so pick an fsdp size that divides it.')
  if m.vocab_size > 0 and m.vocab_size % tensor:
    e.append(f'model.vocab_size={m.vocab_size} is not divisible by mesh.tensor={tensor}; round the vocabulary '
             f'up to a multiple of {tensor} (extra entries are never produced by the tokenizer).')
  if m.d_model > 0 and model.mlp_dim(m) % tensor:
    e.append(f'model.mlp_dim={model.mlp_dim(m)} is not divisible by mesh.tensor={tensor}.')
  return e


def _pipeline_errors(c, stages: int, batch_ways: int) -> list[str]:
  """Problems with pipeline.* and mesh.stage (a pipeline is on when the mesh has more than one stage)."""
  p = c.get('pipeline')
  if p is None:
    return []
  e = []
  if p.schedule not in PIPELINE_SCHEDULES:
    e.append(f'pipeline.schedule={p.schedule!r} is unknown; use one of {", ".join(PIPELINE_SCHEDULES)}.')
  if p.microbatches < 0:
    e.append(f'pipeline.microbatches={p.microbatches} must be >= 0 (0 = one per stage).')
  if p.repeats < 1:
    e.append(f'pipeline.repeats={p.repeats} must be a positive integer.')
  if stages == 1 or e:
    return e
  m, t = c.model, c.train
  repeats = p.repeats if p.schedule == 'circular' else 1
  micro = pipeline_lib.microbatches(p, stages)
  if m.num_layers > 0 and m.num_layers % (stages * repeats):
    what = f'stages × pipeline.repeats = {stages}×{repeats}' if repeats > 1 else f'the {stages} stages'
    e.append(f'model.num_layers={m.num_layers} is not divisible by {what}; each stage holds '
             f'{"repeats chunks of " if repeats > 1 else ""}the same number of layers, so make num_layers a '
             f'multiple of {stages * repeats} or change mesh.stage{"/pipeline.repeats" if repeats > 1 else ""}.')
  if micro < stages:
    e.append(f'pipeline.microbatches={micro} is fewer than the {stages} pipeline stages; every stage needs a '
             f'microbatch to work on, so use at least {stages} (more shrinks the bubble).')
  if not m.scan_layers:
    e.append('model.scan_layers=False cannot run as a pipeline (stages split the scanned layer stack); set '
             'model.scan_layers=True or mesh.stage=1.')
  if m.get('matmul_dtype') == 'fp8':
    e.append('model.matmul_dtype=fp8 does not run under a pipeline yet (its scales are a second collection the '
             'stages do not carry); set model.matmul_dtype=dtype or mesh.stage=1.')
  # Each accumulation microbatch is split into pipeline microbatches, each of which is split over data × fsdp;
  # outside the pipeline (embedding, loss) the batch is also split over the stages.
  accum = max(t.microbatches, 1)
  unit = accum * math.lcm(micro * batch_ways, stages * batch_ways)
  try:
    sizes = [size for size, _ in batch_stages(t, 1)]
  except ValueError:  # reported by _train_errors
    sizes = [t.batch_size]
  for size in sizes:
    if size % unit:
      field = 'train.batch_size' if size == t.batch_size else 'train.batch_ramp size'
      e.append(f'{field}={size} is not divisible by train.microbatches × lcm(pipeline.microbatches × data×fsdp, '
               f'stages × data×fsdp) = {accum}×lcm({micro}×{batch_ways}, {stages}×{batch_ways}) = {unit}; use a '
               f'multiple of {unit}, or change pipeline.microbatches.')
  return e


def _other_errors(c) -> list[str]:
  e = []
  k = c.checkpoint
  if k.every < 0 or k.keep_every < 0:
    e.append('checkpoint.every and checkpoint.keep_every must be >= 0 (0 = off).')
  if k.keep < 1 or k.max_failures < 1:
    e.append('checkpoint.keep and checkpoint.max_failures must be >= 1.')
  if not isinstance(k.get('allow_data_change', False), bool):
    e.append(f'checkpoint.allow_data_change={k.allow_data_change!r} must be True or False.')
  if c.log.profile_steps:
    try:
      first, last = (int(x) for x in c.log.profile_steps.split(','))
      if not 0 <= first <= last:
        raise ValueError
    except ValueError:
      e.append(f'log.profile_steps={c.log.profile_steps!r} must be "first,last" with 0 <= first <= last.')
  y = c.stability
  if y.policy not in STABILITY_POLICIES:
    e.append(f'stability.policy={y.policy!r} is unknown; use one of {", ".join(STABILITY_POLICIES)}.')
  if y.window < 2 or y.threshold <= 0 or y.min_history < 2 or y.spikes < 1 or y.spike_window < 1:
    e.append('stability.window and min_history must be >= 2, threshold > 0, spikes and spike_window >= 1.')
  if y.nonfinite_steps < 1 or y.skip_batches < 0 or y.max_rollbacks < 0 or y.lr_factor <= 0:
    e.append('stability.nonfinite_steps must be >= 1, skip_batches and max_rollbacks >= 0, lr_factor > 0.')
  if y.policy == 'rollback' and c.checkpoint.every and c.checkpoint.keep * c.checkpoint.every <= y.spike_window:
    e.append(f'stability.policy=rollback needs a checkpoint from before the first spike, but checkpoint.keep='
             f'{c.checkpoint.keep} × checkpoint.every={c.checkpoint.every} steps do not reach back past '
             f'stability.spike_window={y.spike_window}; raise checkpoint.keep.')
  for key in ('poison_batches', 'lr_spike_steps'):
    if c.faults[key] and not all(x.strip().isdigit() for x in c.faults[key].split(',')):
      e.append(f'faults.{key}={c.faults[key]!r} must be comma-separated step numbers.')
  if c.faults.poison not in ('random_tokens', 'nan'):
    e.append(f'faults.poison={c.faults.poison!r} is unknown; use random_tokens or nan.')
  if c.log.slow_step_factor <= 1.0 or c.log.slow_step_count < 1:
    e.append('log.slow_step_factor must be > 1 and log.slow_step_count >= 1.')
  return e


def _stream_errors(c) -> list[str]:
  """data.source=stream: every batch is cut from data.stream_lanes lanes, so each batch size must divide it."""
  d, t = c.data, c.train
  if d.source != 'stream':
    return []
  lanes = d.get('stream_lanes', 0) or t.batch_size
  if t.batch_ramp and not d.get('stream_lanes', 0):
    return [f'data.source=stream with train.batch_ramp: set data.stream_lanes to the largest batch size '
            f'({t.batch_size}).']
  if lanes % t.batch_size:
    return [f'data.stream_lanes={lanes} is not a multiple of train.batch_size={t.batch_size}.']
  if t.get('epochs', 0):
    return ['train.epochs needs the dataset\'s size; data.source=stream does not count it: set train.steps.']
  return []


def _rl_errors(c) -> list[str]:
  """The `rl` section (python -m jaxlm.rl); its choice lists are declared beside the policy objective (step.py)."""
  r = c.get('rl')
  if r is None:
    return []
  e = []
  if r.loss_type not in policy.LOSS_TYPES:
    e.append(f'rl.loss_type={r.loss_type!r} is unknown; use one of {", ".join(policy.LOSS_TYPES)}.')
  if r.scale_rewards not in policy.SCALE_REWARDS:
    e.append(f'rl.scale_rewards={r.scale_rewards!r} is unknown; use one of {", ".join(policy.SCALE_REWARDS)}.')
  if r.num_generations < 2 or c.train.batch_size % r.num_generations:
    e.append(f'rl.num_generations={r.num_generations} must be >= 2 and divide train.batch_size='
             f'{c.train.batch_size} (the completions of each step); group advantages need two or more.')
  if not 0 < r.max_new_tokens < c.data.seq_len:
    e.append(f'rl.max_new_tokens={r.max_new_tokens} must be positive and below data.seq_len={c.data.seq_len} '
             f'(the prompt takes the rest).')
  if r.temperature < 0 or r.top_k < 0 or not 0 < r.top_p <= 1:
    e.append('rl.temperature and rl.top_k must be >= 0, rl.top_p in (0, 1].')
  if not 0 <= r.epsilon < 1 or r.epsilon_high < 0 or r.beta < 0:
    e.append(f'rl.epsilon={r.epsilon} must be in [0, 1), rl.epsilon_high and rl.beta >= 0.')
  try:
    [float(x) for x in str(r.reward_weights).split(',')] if r.reward_weights else []
  except ValueError:
    e.append(f'rl.reward_weights={r.reward_weights!r} must be comma-separated numbers, one per reward function.')
  if r.stability_spikes < 1:
    e.append(f'rl.stability_spikes={r.stability_spikes} must be >= 1.')
  return e


LOCATION_KEYS = ('data.paths', 'data.eval_paths', 'data.tokenizer', 'data.cache_dir', 'checkpoint.init_from',
                 'rl.prompts', 'rl.tokenizer')  # the config keys that name files, directories or buckets


def _location_errors(c) -> list[str]:
  """A location written as a URL that is not one jaxlm can use (locations.location_problem), per key."""
  errors = []
  for key in LOCATION_KEYS:
    section, name = key.split('.')
    value = c.get(section, {}).get(name) or ''
    for part in str(value).replace(';', ',').split(','):
      if problem := locations.location_problem(part.strip()):
        errors.append(f'{key}: {problem}')
  return errors


def validate(c: ml_collections.ConfigDict, num_devices: int, num_processes: int = 1, num_slices: int = 1, *,
             rl: bool = False) -> None:
  """Raises ConfigError listing every problem with `c` on `num_devices` devices in `num_processes` processes.

  rl: the config runs `python -m jaxlm.rl`, whose `rl` section is checked too.
  """
  errors = (_model_errors(c.model) + _moe_errors(c, num_devices) + _lora_errors(c) + _preference_errors(c)
            + _fp8_errors(c) + _deterministic_errors(c)
            + _data_errors(c.data) + _stream_errors(c) + _train_errors(c.train, c.optim)
            + _gen_eval_errors(c.train, c.data, num_processes) + _harness_errors(c.train) + _mesh_errors(c, num_devices, num_processes, num_slices)
            + distributed.dist_errors(c.dist) + _other_errors(c) + _location_errors(c) + (_rl_errors(c) if rl else []))
  if errors:
    raise ConfigError('invalid config:\n  - ' + '\n  - '.join(errors))


class BatchRamp:
  """Batch size per step under `train.batch_ramp` (a single stage when there is no ramp)."""

  def __init__(self, train_cfg, seq_len: int):
    stages = batch_stages(train_cfg, seq_len)
    self.unit = stages[0][0]
    self.starts = []  # (first step, batch size, tokens before that step)
    step, tokens = 0, 0
    for size, until in stages:
      self.starts.append((step, size, tokens))
      if until != float('inf'):
        n = max(0, -(-(int(until) - tokens) // (size * seq_len)))  # steps until `until` tokens are reached
        step, tokens = step + n, tokens + n * size * seq_len
    self.seq_len = seq_len

  def _stage(self, step: int):
    return [s for s in self.starts if s[0] <= step][-1]

  def size(self, step: int) -> int:
    """Global batch size of the step after `step` steps are done."""
    return self._stage(step)[1]

  def tokens(self, steps: int) -> int:
    """Tokens trained on after `steps` steps."""
    first, size, tokens = self._stage(steps)
    return tokens + (steps - first) * size * self.seq_len

  def draw(self, it, size: int) -> dict:
    """This process's rows of the next global batch of `size` rows."""
    if hasattr(it, 'take'):  # the global stream (data/pipeline.py): any size, rows in the global order
      return it.take(size)
    parts = [next(it) for _ in range(size // self.unit)]
    return parts[0] if len(parts) == 1 else {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
