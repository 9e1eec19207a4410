"""The PyTorch baseline: a plain GPT of jaxlm's shape, trained the way jaxlm trains, timed the way bench/mfu.py times.

  python bench/torch_gpt.py --config=configs/palm_small.py --steps=20 --warmup=3 [--config.model.x=y]

Same model (PaLM parallel block or Llama pre-norm block, SwiGLU, MQA/GQA, half-split RoPE, tied embeddings scaled
by 1/sqrt(D), z-loss), same optimizer (global-norm clipping, AdamW with decay on matrices only, warmup-cosine),
same random batches and the same FLOPs formula (jaxlm.model.flops_per_token), so tokens/s and model FLOP/s compare
one to one with bench/mfu.py. bfloat16/float16 run under torch.autocast with float32 master weights (the parameters
and AdamW's state stay float32), as jaxlm keeps param_dtype=float32 and computes in model.dtype. Attention is F.scaled_dot_product_attention; the model runs under torch.compile,
or eagerly (with a printed note) when compiling fails. torch must be the exact CPU build: `pip install
torch==2.13.0`, never a bare `torch` (that pulls a multi-GB CUDA build).
"""

import json
import math
import os
import pathlib
import statistics
import sys
import time

from absl import app, flags
from ml_collections import config_flags
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).absolute().parents[1]))
from jaxlm import config as config_lib  # noqa: E402  (pure Python: validation and derived sizes)
from jaxlm import model as model_lib  # noqa: E402  (only for its FLOPs formula; no device work)

FLAGS = flags.FLAGS

DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


def rope(x, positions, theta: float):
  """Half-split rotary embeddings, as jaxlm.model.rope. x: (B, T, N, E); positions: (B, T)."""
  E = x.shape[-1]
  inv_freq = theta ** (-torch.arange(0, E, 2, dtype=torch.float32, device=x.device) / E)  # (E/2,)
  angles = positions.float()[:, :, None, None] * inv_freq  # (B, T, 1, E/2)
  sin, cos = angles.sin(), angles.cos()
  x1, x2 = x.float().chunk(2, dim=-1)
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Norm(nn.Module):
  """LayerNorm without bias (PaLM) or RMSNorm (Llama), statistics in float32."""

  def __init__(self, m, rms: bool):
    super().__init__()
    self.rms, self.eps = rms, m.norms.eps
    self.scale = nn.Parameter(torch.ones(m.d_model))

  def forward(self, x):  # (B, T, D)
    x32 = x.float()
    if self.rms:
      x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
    else:
      x32 = F.layer_norm(x32, x32.shape[-1:], eps=self.eps)
    return (x32 * self.scale).to(x.dtype)


class Attention(nn.Module):
  """Multi-query / grouped-query attention with RoPE and one fused q|k|v projection, no biases."""

  def __init__(self, m):
    super().__init__()
    self.m = m
    D, H, K, E = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
    self.qkv = nn.Linear(D, (H + 2 * K) * E, bias=False)
    self.out = nn.Linear(H * E, D, bias=False)
    nn.init.normal_(self.qkv.weight, std=D ** -0.5)
    nn.init.normal_(self.out.weight, std=(H * E) ** -0.5)

  def forward(self, x, segment_ids, positions):  # x: (B, T, D)
    m = self.m
    B, T, _ = x.shape
    H, K, E = m.num_heads, m.num_kv_heads, m.head_dim
    q, k, v = self.qkv(x).split([H * E, K * E, K * E], dim=-1)
    q = rope(q.view(B, T, H, E), positions, m.rope_theta).transpose(1, 2)  # (B, H, T, E)
    k = rope(k.view(B, T, K, E), positions, m.rope_theta).transpose(1, 2)  # (B, K, S, E)
    v = v.view(B, T, K, E).transpose(1, 2)  # (B, K, S, E)
    if segment_ids is None:  # one document per row: SDPA's causal fast path
      out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=K != H)
    else:  # packed documents: causal and same-document
      causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
      mask = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])  # (B, T, S)
      out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=K != H)
    return self.out(out.transpose(1, 2).reshape(B, T, H * E))  # (B, T, D)


class SwiGLU(nn.Module):
  """down(silu(gate(x)) * up(x)), no biases."""

  def __init__(self, m):
    super().__init__()
    D, F_ = m.d_model, m.mlp_dim
    self.gate, self.up = nn.Linear(D, F_, bias=False), nn.Linear(D, F_, bias=False)
    self.down = nn.Linear(F_, D, bias=False)
    for lin, fan_in in ((self.gate, D), (self.up, D), (self.down, F_)):
      nn.init.normal_(lin.weight, std=fan_in ** -0.5)

  def forward(self, x):
    return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
  """PaLM parallel block (one LayerNorm) or the Llama sequential pre-norm block."""

  def __init__(self, m):
    super().__init__()
    self.parallel = m.parallel_block
    if self.parallel:
      self.norm = Norm(m, rms=False)
    else:
      self.attn_norm, self.mlp_norm = Norm(m, rms=True), Norm(m, rms=True)
    self.attention, self.mlp = Attention(m), SwiGLU(m)

  def forward(self, x, segment_ids, positions):
    if self.parallel:
      h = self.norm(x)
      return x + self.attention(h, segment_ids, positions) + self.mlp(h)
    x = x + self.attention(self.attn_norm(x), segment_ids, positions)
    return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
  """Embeddings, L blocks, final norm, (tied) output projection; returns jaxlm's loss (cross-entropy + z-loss)."""

  def __init__(self, m):
    super().__init__()
    self.m = m
    self.embedding = nn.Parameter(torch.randn(m.vocab_size, m.d_model))  # N(0, 1): no norm after the lookup
    self.blocks = nn.ModuleList(Block(m) for _ in range(m.num_layers))
    self.final_norm = Norm(m, rms=not m.parallel_block)
    self.unembed = None if m.tie_embeddings else nn.Linear(m.d_model, m.vocab_size, bias=False)

  def forward(self, inputs, targets, weights, positions, segment_ids=None):
    m = self.m
    dtype = DTYPES[m.dtype]
    # Mixed precision as jaxlm runs it: float32 master weights, matmuls in `dtype` (autocast casts each weight at
    # its use, as jaxlm's `w.astype(dtype)`). Without it an nn.Linear's float32 weight meets the bfloat16
    # activations and CUDA refuses the product ("expected mat1 and mat2 to have the same dtype").
    with torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype != torch.float32):
      return self._loss(inputs, targets, weights, positions, segment_ids, dtype)

  def _loss(self, inputs, targets, weights, positions, segment_ids, dtype):
    m = self.m
    x = self.embedding[inputs].to(dtype)  # (B, T, D)
    for block in self.blocks:
      x = block(x, segment_ids, positions)
    x = self.final_norm(x)
    if self.unembed is None:
      logits = x @ self.embedding.to(dtype).t() / math.sqrt(m.d_model)  # (B, T, V)
    else:
      logits = self.unembed(x)
    logits = logits.float()
    log_z = torch.logsumexp(logits, dim=-1)  # (B, T)
    target_logit = logits.gather(-1, targets[..., None])[..., 0]
    denom = weights.sum().clamp_min(1.0)
    ce = ((log_z - target_logit) * weights).sum() / denom
    return ce + m.z_loss * (log_z.square() * weights).sum() / denom


def make_optimizer(model: GPT, o, total_steps: int):
  """AdamW with weight decay on matrices only, under jaxlm's warmup-cosine schedule (jaxlm.optimizer)."""
  decay = [p for p in model.parameters() if p.ndim >= 2]
  no_decay = [p for p in model.parameters() if p.ndim < 2]
  groups = [{'params': decay, 'weight_decay': o.weight_decay}, {'params': no_decay, 'weight_decay': 0.0}]
  opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, foreach=True)

  def lr_factor(step):
    if step < o.warmup_steps:
      return step / max(o.warmup_steps, 1)
    progress = min((step - o.warmup_steps) / max(total_steps - o.warmup_steps, 1), 1.0)
    return o.final_lr_fraction + (1 - o.final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))

  return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def random_batches(n: int, batch: int, seq: int, vocab: int, device, seed: int = 0) -> list[dict]:
  """`n` batches of random tokens, one document per row (bench/mfu.py draws the same)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    tokens = torch.from_numpy(rng.integers(0, vocab, (batch, seq + 1)).astype(np.int64)).to(device)
    positions = torch.arange(seq, device=device).expand(batch, seq)
    out.append(dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], positions=positions,
                    weights=torch.ones(batch, seq, device=device)))
  return out


class Bench:
  """The model, optimizer and random batches on `device`; `step()` runs one train step and returns its time."""

  def __init__(self, cfg, use_compile: bool = True, device: str = 'cpu'):
    config_lib.validate(cfg, 1)
    self.cfg, self.device = cfg, device
    self.m = m = model_lib.ModelConfig.from_config(cfg.model)
    torch.manual_seed(cfg.train.seed)
    self.model = GPT(m).to(device)
    self.opt, self.sched = make_optimizer(self.model, cfg.optim, cfg.train.steps)
    self.batches = random_batches(4, cfg.train.batch_size, cfg.data.seq_len, m.vocab_size, device, cfg.train.seed)
    self.forward, self.mode, self.steps_run, self.loss = self.model, 'eager', 0, None
    start = time.perf_counter()
    if use_compile:
      try:
        self.forward = torch.compile(self.model)
        self.step()  # compiles here (C++ through gcc on a CPU)
        self.mode = 'torch.compile'
      except Exception as e:  # pylint: disable=broad-except
        print(f'note: torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); running eagerly',
              flush=True)
        self.forward = self.model
    self.compile_s = time.perf_counter() - start

  def step(self) -> float:
    """Runs one train step (forward, backward, clipping, AdamW, schedule), waits, returns its wall time."""
    batch = self.batches[self.steps_run % len(self.batches)]
    start = time.perf_counter()
    self.opt.zero_grad(set_to_none=True)
    loss = self.forward(**batch)
    loss.backward()
    if self.cfg.optim.clip > 0:
      torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.clip, foreach=True)
    self.opt.step()
    self.sched.step()
    if self.device.startswith('cuda'):
      torch.cuda.synchronize()
    self.steps_run += 1
    self.loss = loss.detach()
    return time.perf_counter() - start

  def phase(self, name: str) -> float:
    """Times the forward pass alone ('forward') or forward + backward ('forward + backward') on one batch."""
    batch = self.batches[0]
    start = time.perf_counter()
    if name == 'forward':  # with autograd on, as in a train step (under no_grad torch.compile would recompile)
      self.forward(**batch)
    else:
      self.opt.zero_grad(set_to_none=True)
      self.forward(**batch).backward()
    if self.device.startswith('cuda'):
      torch.cuda.synchronize()
    return time.perf_counter() - start

  def result(self, times: list[float]) -> dict:
    """Throughput of the timed steps `times`, counted with jaxlm's FLOPs formula."""
    step_s = statistics.median(times)
    tokens = self.cfg.train.batch_size * self.cfg.data.seq_len
    flops = model_lib.flops_per_token(self.m, self.cfg.data.seq_len)
    return dict(framework='torch', mode=self.mode, torch=torch.__version__, threads=torch.get_num_threads(),
                device=self.device, step_s=step_s, step_s_mean=statistics.fmean(times), step_s_min=min(times),
                tokens_per_s=tokens / step_s, model_flops_per_s=tokens / step_s * flops, flops_per_token=flops,
                compile_s=self.compile_s, loss=float(self.loss),
                params=sum(p.numel() for p in self.model.parameters()), load_average=os.getloadavg()[0])


def measure(cfg, steps: int, warmup: int, use_compile: bool = True, device: str = 'cpu') -> dict:
  """Builds the model (compiling it), runs `warmup` + `steps` train steps, and returns `Bench.result`."""
  bench = Bench(cfg, use_compile, device)
  for _ in range(warmup):
    bench.step()
  return bench.result([bench.step() for _ in range(steps)])


def main(argv):
  del argv
  r = measure(FLAGS.config, FLAGS.steps, FLAGS.warmup, FLAGS.compile, FLAGS.device)
  print(f'torch {r["torch"]} ({r["mode"]}, {r["threads"]} threads, {r["device"]}): {r["params"]:,} parameters, '
        f'step {r["step_s"] * 1e3:.1f} ms (median of {FLAGS.steps}, min {r["step_s_min"] * 1e3:.1f}), '
        f'{r["tokens_per_s"]:,.0f} tokens/s, {r["model_flops_per_s"] / 1e9:.2f} GFLOP/s model, '
        f'loss {r["loss"]:.3f}', flush=True)
  if FLAGS.json:
    pathlib.Path(FLAGS.json).write_text(json.dumps(r))


def define_flags():
  """The command line of this script; not defined on import, so bench/cpu_step.py can import the module."""
  config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/palm_small.py.')
  flags.DEFINE_integer('steps', 10, 'Timed steps.')
  flags.DEFINE_integer('warmup', 3, 'Untimed steps first (allocator warm-up; compilation happens before them).')
  flags.DEFINE_bool('compile', True, 'torch.compile the model and loss (falls back to eager on failure).')
  flags.DEFINE_string('device', 'cpu', 'torch device: cpu or cuda.')
  flags.DEFINE_string('json', '', 'Also write the result as one JSON object to this file.')


if __name__ == '__main__':
  define_flags()
  flags.mark_flag_as_required('config')
  app.run(main)
