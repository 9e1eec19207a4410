"""Base configuration: every key jaxlm reads, each with one line saying what it does.

Files beside this one are small sets of overrides on top of it. Cross-field checks and derived values live in
`jaxlm/config.py` and run before any device work.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """Returns the base config (a PaLM-style decoder small enough for a CPU)."""
  c = ml_collections.ConfigDict()
  c.name = 'base'  # run name; the default workdir is runs/<name>

  c.model = m = ml_collections.ConfigDict()
  m.vocab_size = 8192  # V; the tokenizer's vocabulary must fit (prepared data: its metadata is checked)
  m.d_model = 256  # D, residual stream width
  m.num_layers = 4  # L
  m.num_heads = 4  # H, query heads
  m.num_kv_heads = 1  # K, key/value heads: 1 = multi-query (PaLM), H = multi-head, between = grouped-query
  m.head_dim = 0  # E; 0 means D // H
  m.mlp_dim = 0  # F, SwiGLU hidden width; 0 means 4 * D (PaLM)
  m.parallel_block = True  # PaLM block (one LayerNorm, attention + MLP in parallel); False = Llama pre-norm block
  m.tie_embeddings = True  # share input and output embeddings (PaLM)
  m.rope_theta = 10_000.0  # rotary embedding base wavelength
  m.rope_scaling = 'none'  # extend a model's context: none | linear | llama3 | yarn (model.py, rope_frequencies)
  m.rope_factor = 1.0  # linear/llama3/yarn: how many times longer the new context is than the original
  m.rope_original_max_positions = 0  # llama3/yarn: the context length the model was first trained at
  m.rope_low_freq_factor = 1.0  # llama3: wavelengths above original / this are fully interpolated
  m.rope_high_freq_factor = 4.0  # llama3: wavelengths below original / this are kept
  m.rope_beta_fast = 32.0  # yarn: dimensions turning more than this often in the original context are kept
  m.rope_beta_slow = 1.0  # yarn: ... fewer than this often are interpolated (a linear ramp between)
  m.rope_attention_factor = 0.0  # yarn: cos/sin scale; 0 = the paper's 0.1·ln(factor) + 1
  m.rope_truncate = True  # yarn: round the ramp's ends to whole dimensions (transformers' default)
  m.rope_mscale_all_dim = 0.0  # yarn + MLA (DeepSeek): softmax scale × (0.1·this·ln(rope_factor) + 1)²; 0 = off
  m.norm_eps = 1e-6  # epsilon of LayerNorm / RMSNorm
  m.z_loss = 1e-4  # coefficient of the z-loss (PaLM): keeps log Z near 0 so bf16 softmax stays stable
  m.dropout_rate = 0.0  # dropout on the attention and MLP outputs (PaLM used none)
  m.dtype = 'bfloat16'  # compute dtype: bfloat16 | float32 | float16
  m.param_dtype = 'float32'  # master-weight dtype (optimizer state follows it)
  m.remat = 'full'  # activation checkpointing per layer: none | full | dots | dots_no_batch | attn_out
  m.scan_layers = True  # nn.scan over layers: one compiled layer body (fast compiles); False unrolls
  m.attention = 'xla'  # attention kernel: xla | cudnn | splash | auto
  m.attention_block_q = 0  # xla attention: query rows per block on each context shard (long sequences); 0 = all
  m.matmul_dtype = 'dtype'  # the layers' projections: dtype (model.dtype) | fp8 (e4m3/e5m2, delayed scaling; GPUs with fp8)
  m.explicit_transpose_grads = False  # weight gradients as plain products of a transposed copy: faster on XLA:CPU only
  m.qk_norm = 'none'  # RMSNorm on queries and keys before RoPE: none | head (per head: Qwen3) | full (all heads: OLMoE)
  # Block features of today's open families (jaxlm/model.py, attention.py), all off by default; sequential block only.
  m.attention_window = 0  # W > 0: local layers see their W most recent tokens, their own included; 0 = all global
  m.attention_global_every = 0  # with a window, every n-th layer global (Gemma 3: 6, Gemma 2: 2); 0 = all local
  m.rope_local_theta = 0.0  # RoPE base of the local layers (Gemma 3: 10k beside 1M); 0 = rope_theta everywhere
  m.attention_softcap = 0.0  # attention scores -> cap·tanh(score / cap) (Gemma 2: 50); 0 = off
  m.attention_sinks = False  # a learned per-head logit joins each softmax's denominator (gpt-oss)
  m.attention_bias = False  # biases on the q, k, v and output projections (gpt-oss)
  m.query_pre_attn_scalar = 0.0  # scores scaled by this^-1/2 instead of head_dim^-1/2 (Gemma 2/3); 0 = head_dim
  m.final_softcap = 0.0  # logits -> cap·tanh(logit / cap) (Gemma 2: 30); 0 = off
  m.norm_placement = 'pre'  # pre (Llama) | sandwich (norm before and after each sublayer: Gemma) | post (after: OLMo 2)
  m.norm_offset = False  # RMSNorm scales by (1 + w), w starting at 0 (Gemma)
  # MLP gate: swiglu (silu) | geglu (tanh-approx. gelu: Gemma, dense only) | clamped (gpt-oss)
  m.mlp_activation = 'swiglu'
  m.mlp_swiglu_limit = 7.0  # clamped: gate clamped above at this, up to [-this, this]
  m.mlp_swiglu_alpha = 1.702  # clamped: gate·sigmoid(alpha·gate)·(up + 1)
  m.embed_scale = False  # multiply the embeddings by sqrt(d_model) (Gemma)
  # Multi-head latent attention (jaxlm/mla.py, DeepSeek-V2/V3); the keys below kv_lora_rank are read only when it is > 0.
  m.kv_lora_rank = 0  # R: keys and values up-projected from one RMS-normed latent this wide per token; 0 = off
  m.q_lora_rank = 0  # queries through their own normed latent this wide; 0 = a plain query projection (V2-Lite)
  m.qk_nope_head_dim = 128  # each head's query/key part without RoPE
  m.qk_rope_head_dim = 64  # the rotary part; the key's is one vector shared by every head (decoupled RoPE)
  m.v_head_dim = 128  # each head's value size (the output projection's input is num_heads × this)
  m.mtp_depth = 0  # D multi-token prediction modules (DeepSeek-V3, jaxlm/mtp.py), training only; 0 = off
  m.mtp_weight = 0.3  # λ: the training loss adds λ × the mean of the D depths' cross-entropies
  # Mixture of experts (jaxlm/moe.py); the moe_* keys below are read only when moe_experts > 0.
  m.moe_experts = 0  # X, routed experts per MoE layer; 0 = dense MLPs everywhere
  m.moe_top_k = 2  # k, experts each token is sent to
  m.moe_mlp_dim = 0  # one expert's SwiGLU width; 0 = mlp_dim's resolved width
  m.moe_shared_experts = 0  # experts every token goes through besides its k (DeepSeek), as one SwiGLU that wide
  m.moe_every = 1  # every n-th layer is MoE (layers n-1, 2n-1, ... after moe_first_dense), the rest dense; divides the rest
  m.moe_first_dense = 0  # k: the first k layers dense MLPs (DeepSeek's first_k_dense_replace), then moe_every's pattern
  # mixtral | qwen3_moe | olmoe (softmax, top-k) | deepseek_v3 (sigmoid, biased choice) |
  # gpt_oss (top-k, softmax over k)
  m.moe_router = 'mixtral'
  m.moe_groups = 1  # deepseek_v3's n_group: experts in this many equal groups for group-limited routing; 1 = none
  m.moe_top_groups = 1  # deepseek_v3's topk_group: top-k chosen inside this many best groups (ranked by top-2 sum)
  m.moe_norm_topk_prob = True  # qwen3_moe/olmoe/deepseek_v3: renormalise the k weights to sum to 1 (mixtral always)
  m.moe_routed_scale = 1.0  # deepseek_v3's routed_scaling_factor: the routed experts' weights times this
  m.moe_capacity_factor = 0.0  # 0 = dropless; else each expert takes ceil(factor·N·k/X) tokens, the rest dropped
  m.moe_aux_loss = 0.0  # Switch/GShard load-balancing loss coefficient (the loss is 1.0 at uniform routing); 0 = off
  m.moe_aux_loss_form = 'switch'  # switch: mean of the MoE layers' (1.0 at uniform) | pooled: transformers' (k)
  m.moe_router_z_loss = 0.0  # router z-loss coefficient (ST-MoE): mean log(Σ exp(router logits))²; 0 = off
  m.moe_bias_rate = 1e-3  # auxiliary-loss-free balancing (the default): selection-bias step per update; 0 = off
  m.moe_impl = 'ragged'  # ragged (tokens sorted by expert, grouped GEMMs) | dense (every expert on every token: tests)
  m.moe_transport = 'auto'  # mesh.expert > 1: all_to_all (ragged, GPU/TPU) | gather (all-gather + reduce-scatter, any) | auto
  m.moe_expert_bias = False  # biases on each expert's gate, up and down projections (gpt-oss)
  m.moe_router_bias = False  # a learned bias on the router's logits (gpt-oss)
  m.moe_buffer_factor = 0.0  # all_to_all receive buffer, × the balanced rows (N·k/expert); 0 = the worst case (never overflows)
  # LoRA (jaxlm/model.py `adapter`): low-rank adapters beside the projections; only they train, the base is frozen.
  m.lora = ml_collections.ConfigDict()
  m.lora.rank = 0  # r, the adapters' rank; 0 = off (full fine-tuning)
  m.lora.alpha = 16.0  # the branch is scaled by alpha / rank (peft's lora_alpha)
  m.lora.targets = ('query', 'key', 'value', 'out', 'gate', 'up', 'down')  # projections adapted (MoE experts never;
  # with MLA also query_a, kv_a, kv_b)
  m.lora.base_dtype = 'float32'  # how the frozen base is stored: float32 | bfloat16 (half the memory)

  c.data = d = ml_collections.ConfigDict()
  d.source = 'stdlib'  # stdlib: this interpreter's standard-library sources (no download); prepared: `paths`; stream: raw `paths` tokenized on the fly
  d.paths = ''  # prepared dataset directories (from `python -m jaxlm.data.prepare`), comma-separated; stream: parquet/jsonl/txt files, dirs, globs (datasets of a mixture split by ';')
  d.tokenizer = ''  # stream: the tokenizer (.model, tokenizer.json, or a directory with one)
  d.text_field = 'text'  # stream: jsonl field / parquet column holding the text
  d.stream_format = 'text'  # stream: text documents | chat (jsonl conversations, loss on assistant turns, as prepare --format=chat)
  d.chat_template = ''  # stream chat: chatml | llama3 | '' (the tokenizer's own)
  d.empty_think = 'mask'  # stream chat: an empty <think></think> the template writes is masked (mask) or trained (train)
  d.stream_lanes = 0  # stream: K lanes, each packing its own units; global row k = row k // K of lane k % K (0 = train.batch_size)
  d.eval_paths = ''  # stream: held-out files to evaluate on (there is no held-out split)
  d.weights = ''  # mixture weights for `paths`, comma-separated; empty = proportional to tokens (stream: equal)
  d.seq_len = 256  # T, tokens per training sequence
  d.cache_dir = '~/.cache/jaxlm'  # where the stdlib corpus is prepared once and reused
  d.stdlib_max_mb = 24  # cap on stdlib source bytes used (keeps first-run preparation short)
  d.eval_fraction = 0.02  # fraction of documents held out for evaluation, chosen by a hash of their path
  d.cross_document_attention = False  # False: segment ids + positions keep attention inside each document
  d.num_workers = 0  # Grain worker processes (0 = read in the training process)
  d.prefetch = 2  # batches read ahead per worker

  c.train = t = ml_collections.ConfigDict()
  t.steps = 200  # optimizer steps to train
  t.epochs = 0  # > 0: passes over the (single) dataset; train.steps is derived: ceil(epochs × rows / batch_size)
  t.batch_size = 16  # global batch, in sequences
  t.microbatches = 1  # gradient accumulation: split each batch into this many sequential microbatches
  t.batch_ramp = ''  # smaller batches first (GPT-3, PaLM): 'size:until_tokens,...', e.g. '4:20000,8:60000'
  t.seed = 0  # seeds init, dropout and the data order
  t.log_every = 10  # steps between metric records
  t.eval_every = 100  # steps between held-out evaluations (0 = only at the end)
  t.eval_batches = 8  # batches per evaluation
  t.sample_prompts = ()  # texts continued greedily at each evaluation, logged as `sample` events, e.g. ('def ',)
  t.sample_tokens = 32  # most new tokens per sample (fewer where the prompt leaves less of data.seq_len)
  t.gen_eval = 0  # every N-th evaluation also scores generations (jaxlm/textgen.py: gen records); 0 = off
  t.gen_eval_prompts = 32  # gen_eval: prompts cut once from the held-out batches
  t.gen_eval_prompt_tokens = 16  # gen_eval: tokens per prompt; the next gen_eval_tokens are the human continuation
  t.gen_eval_tokens = 32  # gen_eval: most new tokens per sample (prompt + these fit data.seq_len)
  t.gen_eval_temperature = 1.0  # gen_eval: sampling temperature (0 = greedy)
  t.gen_eval_top_p = 0.95  # gen_eval: nucleus sampling (the open-ended generation protocol's setting)
  t.gen_eval_mauve = False  # gen_eval: MAUVE on the run's own features (needs jaxlm[textgen]; moves with training)
  t.harness_tasks = ()  # lm-eval tasks scored in the loop on the live weights (jaxlm/harness.py), e.g. ('arc_easy',)
  t.harness_every = 0  # steps between harness evaluations, a multiple of eval_every (0 = at every evaluation)
  t.harness_limit = 0  # examples per harness task, bounding an in-loop evaluation's time (0 = all)
  t.harness_include_path = ''  # folders of task YAMLs beyond lm-eval's registry and jaxlm's own, comma-separated
  t.deterministic = False  # GPU: deterministic XLA ops, so reruns and resumes are bit for bit (slower); CPU/TPU always are
  t.objective = 'lm'  # lm: next-token cross-entropy (pre-training, SFT) | preference: `preference` below on pairs | distill: `distill` below

  c.optim = o = ml_collections.ConfigDict()
  o.name = 'adamw'  # adamw | adafactor (PaLM's) | muon (matrices; AdamW for the rest) | sf_adamw (schedule-free)
  o.schedule = 'cosine'  # after warmup: cosine | linear | wsd (warmup-stable-decay) | constant
  o.decay_fraction = 0.2  # wsd: the final fraction of steps spent decaying
  o.lr = 3e-3  # peak learning rate
  o.warmup_steps = 20  # linear warmup from 0 to `lr`
  o.final_lr_fraction = 0.1  # cosine decay ends at lr * this
  o.b1 = 0.9  # Adam first-moment decay
  o.b2 = 0.95  # Adam second-moment decay (0.95 as in PaLM/LLaMA: steadier on spikes than 0.999)
  o.eps = 1e-8  # Adam epsilon
  o.weight_decay = 0.1  # decoupled weight decay, applied to matrices only (not norms or other 1-D params)
  o.clip = 1.0  # global gradient-norm clipping threshold (0 = off)
  o.adam_lr = 0.0  # muon: peak LR of the AdamW part (embedding, unembedding, norms); 0 = optim.lr
  o.adam_weight_decay = -1.0  # muon: the AdamW part's weight decay (embeddings only); < 0 = optim.weight_decay
  o.muon_scale = 'rms'  # muon: rms (update RMS matched to AdamW's: its LR and decay carry over) | spectral
  o.muon_momentum = 0.95  # muon: Nesterov momentum of the matrices' gradients
  o.muon_ns_steps = 5  # muon: Newton-Schulz iterations per orthogonalisation
  o.ema = 0.0  # decay of an exponential moving average of the weights (float32, checkpointed); 0 = off
  o.ema_start = 0  # the average follows the weights (a copy) until this step, then averages
  o.loss_scale_init = 2.0 ** 15  # float16 compute only: initial dynamic loss scale ...
  o.loss_scale_period = 1000  # ... doubled after this many finite steps, halved on every overflow

  c.preference = r = ml_collections.ConfigDict()  # train.objective=preference (jaxlm/preference.py)
  r.loss_type = 'sigmoid'  # sigmoid (DPO) | ipo | sigmoid_norm (length-normalised DPO) | simpo (reference-free)
  r.beta = 0.1  # β: the strength of the pull towards the reference (DPO), IPO's τ, SimPO's reward scale
  r.gamma = 0.5  # simpo: the target reward margin γ
  r.reference = 'copy'  # base (LoRA: adapters off, no memory) | copy (frozen initial weights) | cached (tools/reference)
  r.reference_dtype = 'float32'  # copy: how the frozen reference is stored (bfloat16 halves it)

  c.distill = kd = ml_collections.ConfigDict()  # train.objective=distill (jaxlm/distill.py)
  kd.teacher = ''  # the teacher: a jaxlm run directory or import (its newest checkpoint), or one step directory
  kd.beta = 0.5  # 0: forward KL(teacher ‖ student) | 1: reverse KL | between: GKD's generalized JSD (TRL's default)
  kd.temperature = 1.0  # teacher and student logits are divided by it before the divergence
  kd.alpha = 0.0  # weight of the hard-label cross-entropy: (1 - alpha)·divergence + alpha·CE; 0 = pure distillation
  kd.top_k = 0  # compare on the teacher's K most likely tokens plus the mass left over; 0 = the full vocabulary
  kd.teacher_dtype = 'float32'  # how the frozen teacher's parameters are stored (bfloat16 halves them)
  kd.cached = ''  # a jaxlm.tools.teacher cache of its top-K log-probabilities, read beside the batches instead
  kd.on_policy = 0.0  # GKD's λ: the fraction of steps on completions the student samples (prompts from the data)
  kd.max_new_tokens = 64  # on_policy: tokens the student samples per prompt (sampled at distill.temperature)

  c.mesh = s = ml_collections.ConfigDict()
  s.data = 1  # data-parallel ways (params replicated)
  s.fsdp = -1  # fully-sharded data-parallel ways (ZeRO-3: params and optimizer state sharded); -1 = the rest
  s.tensor = 1  # tensor-parallel ways (Megatron: heads and MLP hidden sharded)
  # Multi-host: the sizes above are within one host (or TPU slice); these multiply them across hosts (or slices).
  s.dcn_data = 1  # data-parallel ways across hosts: with fsdp=-1 this is HSDP (sharded in a host, replicated across)
  s.dcn_fsdp = 1  # fsdp ways across hosts (parameter all-gathers cross the slow network)
  s.dcn_tensor = 1  # tensor-parallel ways across hosts (rarely wise: every layer talks across the network)
  s.context = 1  # context-parallel ways: each sequence split along its length (long context; seq_len % 2·context == 0)
  s.dcn_context = 1  # context-parallel ways across hosts (the K/V all-gathers of every layer cross the network)
  s.stage = 1  # pipeline stages (consecutive layers per stage, see `pipeline`); 1 = no pipeline
  s.dcn_stage = 1  # pipeline stages across hosts: only stage-to-stage activations cross the network
  s.expert = 1  # expert-parallel ways (MoE): experts split over it, the rest uses it as fsdp; moe_experts % it == 0
  s.dcn_expert = 1  # expert-parallel ways across hosts (every MoE layer's token exchange crosses the network)

  c.pipeline = p = ml_collections.ConfigDict()  # used when mesh.stage × mesh.dcn_stage > 1 (jaxlm/pipeline.py)
  p.schedule = 'gpipe'  # gpipe | circular (each stage holds `repeats` non-adjacent chunks: a smaller bubble)
  p.microbatches = 0  # M microbatches flowing through the stages per step (>= stages; 0 = one per stage)
  p.repeats = 2  # circular only: R chunks per stage; bubble (S-1)/(R*M+S-1)

  c.dist = n = ml_collections.ConfigDict()  # multi-process jobs (jaxlm/distributed.py)
  n.initialize = 'auto'  # join other processes: auto (a cluster is detected) | always (JAX detects) | never
  n.coordinator = ''  # host:port of process 0 ('' = JAX_COORDINATOR_ADDRESS or the cluster's environment)
  n.num_processes = 0  # processes in the job (0 = JAX_NUM_PROCESSES or the cluster's environment)
  n.process_id = -1  # this process's index (-1 = JAX_PROCESS_ID or the cluster's environment)
  n.init_timeout_s = 600  # how long processes wait for each other to start up
  n.peer_timeout_s = 120  # a peer without heartbeat this long is dead: every other process exits
  n.step_timeout_s = 1800  # multi-process: exit if no step finishes this long after the first (a hung peer); 0 = off
  n.stall = ''  # drill: 'process:step,...' hangs that process after that step, the i-th on the i-th attempt

  c.checkpoint = k = ml_collections.ConfigDict()
  k.every = 100  # steps between checkpoints (0 = only at the end)
  k.keep = 3  # newest checkpoints kept
  k.keep_every = 0  # additionally keep every step that is a multiple of this, forever (0 = none)
  k.async_save = True  # write in the background while training continues
  k.max_failures = 3  # consecutive failed saves before training stops
  k.init_from = ''  # warm start: load params only from this checkpoint directory (fresh optimizer, step 0)
  k.allow_data_change = False  # resume even if batch size, seq_len, data or tokenizer changed (logs what is skipped)

  c.stability = y = ml_collections.ConfigDict()
  y.policy = 'rollback'  # off | skip (log spikes, skip non-finite updates) | rollback (PaLM's remedy, automated)
  y.window = 100  # logged values the spike detector's rolling mean and std are taken over
  y.threshold = 6.0  # a spike: loss or grad norm above mean + threshold * std of the window
  y.min_history = 20  # logged values needed before spikes are judged
  y.spikes = 3  # rollback after this many spikes ...
  y.spike_window = 50  # ... within this many steps
  y.nonfinite_steps = 5  # non-finite loss/grads this many steps in a row: rollback (skip policy: stop)
  y.skip_batches = 200  # batches skipped after restoring, so the offending data is not seen again
  y.lr_factor = 1.0  # after a rollback, multiply the learning rate by this ...
  y.lr_factor_steps = 0  # ... for this many steps (0 = not at all)
  y.max_rollbacks = 3  # past this, stop with an error: something beyond bad luck is wrong

  c.faults = f = ml_collections.ConfigDict()  # fault injection for tests and drills; empty = none
  f.poison_batches = ''  # batch numbers (1-based, as drawn from the data) to poison, e.g. '40,41'
  f.poison = 'random_tokens'  # random_tokens (a loss spike) | nan (non-finite loss and gradients)
  f.lr_spike_steps = ''  # steps whose update is multiplied by lr_spike_factor, e.g. '60'
  f.lr_spike_factor = 1000.0  # the multiplier for lr_spike_steps

  c.rl = r = ml_collections.ConfigDict()  # RL with verifiable rewards: read only by `python -m jaxlm.rl`
  r.prompts = ''  # prompts jsonl: a `prompt` text or chat `messages` per line; every other field reaches the rewards
  r.tokenizer = ''  # tokenizer file or directory ('' = the data's, found as training finds it)
  r.chat_template = ''  # `messages` prompts: chatml | llama3 | '' (the tokenizer's own)
  r.num_generations = 8  # G completions per prompt; train.batch_size counts completions (a multiple of G)
  r.max_new_tokens = 64  # longest completion; a prompt may take data.seq_len - max_new_tokens tokens
  r.temperature = 1.0  # sampling temperature (also divides the logits the loss scores, as TRL)
  r.top_k = 0  # sample among the k most likely tokens (0 = all)
  r.top_p = 1.0  # nucleus sampling (1 = off)
  r.loss_type = 'dapo'  # grpo | bnpo | dr_grpo | dapo (TRL's default): how per-token losses are averaged
  r.scale_rewards = 'group'  # advantages divided by the std of: group | batch | none (Dr.GRPO)
  r.epsilon = 0.2  # policy ratio clipped below at 1 - epsilon ...
  r.epsilon_high = 0.0  # ... and above at 1 + epsilon_high (0 = epsilon; DAPO's clip-higher uses 0.28)
  r.beta = 0.0  # k3 KL penalty to the reference (the starting weights); 0 needs no reference
  r.mask_truncated = False  # completions cut at max_new_tokens are left out of the loss (DAPO)
  r.reward_weights = ''  # comma-separated weight per reward function ('' = all 1)
  r.stability_watch = 'update_ratio'  # the guard's spike signals in RL (loss and grad_norm move while a policy learns)
  r.stability_spikes = 1  # RL: rollback after this many spikes of those within stability.spike_window

  c.log = g = ml_collections.ConfigDict()
  g.tensorboard = True  # write TensorBoard event files to <workdir>/tb
  g.wandb = False  # also log to Weights & Biases (needs `pip install wandb`; WANDB_MODE=offline works)
  g.wandb_project = 'jaxlm'  # W&B project name
  g.profile_steps = ''  # steps to trace with jax.profiler, e.g. '10,12' (first,last); empty = none
  g.slow_step_factor = 3.0  # warn when a step takes longer than this times the rolling median ...
  g.slow_step_count = 3  # ... for this many steps in a row
  g.compilation_cache = '~/.cache/jaxlm/xla'  # persistent XLA compilation cache ('' = off)
  return c
