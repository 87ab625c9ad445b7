"""Long-prompt generation on one GPU: time to first token and ms per token, beside transformers'
``generate`` on the same GPU with the same weights, and beside the hardware's floors.

    python -m benchmarks.generate_gpu [--models llama3.2-1b,llama3.1-8b]
        [--prompts 32768,131072] [--batches 1,8] [--new-tokens 32] [--longest] [--json PATH]
    python -m benchmarks.generate_gpu --tiny        # the same on CPU with tiny shapes

Each model preset gets RANDOM weights (bfloat16, seed 0: the speed does not depend on them),
written once as a Hugging Face checkpoint that transformers loads (``hf.save_llama``; not
with ``--no-transformers``). Each printed row starts with the seconds since the start. Per
prompt length P and batch B (random token ids, one length for all rows):

* ours: ``generate.Generator`` on one device (the weights replicated, ``PARAM_RULES``), bf16
  compute and cache: ``ttft_s`` = the prefill plus the first token (one untimed run first,
  for compilation), ``ms_per_token`` = ``--new-tokens`` decode steps as ``gen.generate`` runs
  them (``Generator.stream``: each queued before the tokens of the one before are fetched),
  their time over their count; ``ms_per_token_blocking`` = the same of as many steps each
  dispatched after the one before was fetched (the host's dispatch then adds to each);
* transformers (``hf_``): ``generate`` greedy, SDPA attention, ``cache_implementation=
  "static"`` (``"dynamic"`` where that runs out of memory; ``hf_cache`` says which), bf16
  weights: ``hf_ttft_s`` = ``generate`` of one new token, ``hf_ms_per_token`` =
  (that of ``--new-tokens`` tokens - of one) / (``--new-tokens`` - 1), after an untimed
  short prompt. A side out of memory records ``OOM`` (``vs_transformers.or_out_of_memory``);
  a case whose weights and cache alone exceed the GPU's memory is not tried ("does not fit");
* floors: ``floor_ms_per_token`` = (the bytes a decode step must read: the weights that take
  part in matmuls + B * P * layers * 2 * kv heads * head dim in bf16) / the copy bandwidth
  timed on this GPU (``doctor.timing.copy_bandwidth``, read + written); ``compute_floor_s`` =
  the prefill's matmul FLOPs (2 * those weights * B * P) / the timed bf16 matmul rate
  (``metrics.measure_peak_flops``) + its attention FLOPs (2 * B * P^2 * heads * head dim per
  layer, causal) / the rate of the attention kernel ``"auto"`` picks, timed at P.

The longest prompt (``--longest``, batch 1): the longest multiple of ``LONGEST_STEP`` tokens
whose weights and cache take at most ``LONGEST_SHARE`` of the GPU's memory (as its allocator
reports it; ``--memory-gb`` elsewhere). Its row times decode steps only, on a cache allocated at
that capacity but not filled (the decode step reads every slot, filled or not: the kernel masks
empty ones after reading them, so the time is that of a full cache); its prefill is not run (at
a million tokens it would take minutes), so ``ttft_s`` is empty and ``compute_floor_s`` says
what it would take at best (attention at the rate timed for the longest ``--prompts``).

Agreement: before the timings, the first model in float32 on both sides (ours from the same
checkpoint) generates ``--agreement-tokens`` greedy tokens from ``--agreement-prompt`` random
tokens; ``generate_agreement.agreement`` states how many are equal.

JAX does not preallocate the GPU here (``XLA_PYTHON_CLIENT_PREALLOCATE=false``): transformers
runs first for each model, then ours, in the same process.
"""

import argparse
import os
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common, vs_transformers  # noqa: E402
from ulysses_jax import generate as gen  # noqa: E402
from ulysses_jax import metrics  # noqa: E402
from ulysses_jax.attention import backends  # noqa: E402
from ulysses_jax.doctor.timing import copy_bandwidth, time_fn  # noqa: E402
from ulysses_jax.generate import steps as gen_steps  # noqa: E402
from ulysses_jax.generate.cache import empty_cache  # noqa: E402
from ulysses_jax.hf.weights import load_llama, save_llama  # noqa: E402
from ulysses_jax.mesh import make_mesh  # noqa: E402
from ulysses_jax.models import llama  # noqa: E402

COLUMNS = ["model", "batch", "prompt", "status", "ttft_s", "hf_ttft_s", "compute_floor_s",
           "ttft_vs_floor", "ms_per_token", "ms_per_token_blocking", "hf_ms_per_token",
           "floor_ms_per_token",
           "ms_vs_floor", "hf_status", "hf_cache"]
TINY = dict(models="tiny-gqa", prompts="64,128", batches="1,2", new_tokens=4,
            agreement_prompt=16, agreement_tokens=8, memory_gb=0.02)
COPY_BYTES = {"gpu": 1 << 30, "cpu": 1 << 24}
LONGEST_STEP = 1 << 16  # prompt lengths of the longest-prompt row, a multiple of this
LONGEST_SHARE = 0.9  # of the GPU's memory for the weights and the cache: the rest for the step


def decode_bytes(config, batch: int, prompt: int) -> dict:
  """Bytes one decode step must read: the weights in matmuls (bf16: all but the embedding
  table's rows, which are looked up; a tied table is read as the head) and the KV cache."""
  embedding = 0 if config.tie_embeddings else config.vocab_size * config.hidden_dim
  weights = 2 * (llama.count_params(config) - embedding)
  kv = 2 * batch * prompt * config.num_layers * 2 * config.num_kv_heads * config.head_dim
  return {"weights": weights, "kv": kv}


def prefill_flops(config, batch: int, prompt: int) -> dict:
  """The prefill's forward FLOPs: matmuls (2 per weight per token) and causal attention."""
  weights = decode_bytes(config, batch, prompt)["weights"] / 2
  attention = 2 * batch * prompt ** 2 * config.num_heads * config.head_dim * config.num_layers
  return {"matmul": 2 * weights * batch * prompt, "attention": attention}


def attention_rate(config, prompt: int, device) -> float:
  """FLOP/s of the attention kernel ``"auto"`` picks for one causal layer at ``prompt``."""
  mesh = jax.sharding.Mesh(np.array([device]), ("d",))
  backend = backends.choose_backend(dtype=jnp.bfloat16, head_dim=config.head_dim,
                                    num_q_heads=config.num_heads,
                                    num_kv_heads=config.num_kv_heads, causal=True,
                                    segment_ids_given=False, mesh=mesh).backend
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  shapes = [config.num_heads, config.num_kv_heads, config.num_kv_heads]
  q, k, v = (jax.device_put(jax.random.normal(key, (1, prompt, h, config.head_dim),
                                              jnp.bfloat16), device)
             for key, h in zip(keys, shapes))
  forward = jax.jit(lambda q, k, v: backends.local_attention(
      backend, q, k, v, causal=True, segment_ids=None, scale=config.head_dim ** -0.5))
  seconds = time_fn(forward, q, k, v, warmup=1, iters=3)["median_s"]
  return prefill_flops(config, 1, prompt)["attention"] / config.num_layers / seconds


def does_not_fit(config, prompt: int, batch: int, device) -> dict | None:
  """A row's status where the weights and the cache alone exceed ``device``'s memory (as
  its allocator reports it; None where it reports none, or they fit): tried, it would only
  run out of memory, late."""
  limit = (device.memory_stats() or {}).get("bytes_limit")
  needs = sum(decode_bytes(config, batch, prompt).values())
  if limit is None or needs <= limit:
    return None
  return {"status": f"does not fit: weights + cache {needs / 1e9:.0f} GB > {limit / 1e9:.0f}"}


def longest_prompt(config, limit_bytes: int, step: int = LONGEST_STEP) -> int:
  """The longest prompt (a multiple of ``step``; 0 if none) of one row whose weights (all of
  them, bf16) and KV cache fit ``LONGEST_SHARE`` of ``limit_bytes``."""
  weights = 2 * llama.count_params(config)
  per_token = decode_bytes(config, 1, 1)["kv"]
  return max(0, int(LONGEST_SHARE * limit_bytes - weights) // per_token // step * step)


def decode_ms(generator, steps: int) -> dict:
  """``ms_per_token`` and ``ms_per_token_blocking`` of ``steps`` decode steps each (the module
  doc), after one untimed step (compilation)."""
  generator.decode()
  start = time.perf_counter()
  for _ in generator.stream(steps):
    pass
  queued = 1e3 * (time.perf_counter() - start) / steps
  start = time.perf_counter()
  for _ in range(steps):
    generator.decode()  # fetches the token: blocks
  return {"ms_per_token": queued,
          "ms_per_token_blocking": 1e3 * (time.perf_counter() - start) / steps}


def unfilled_generator(model, prompt: int, new_tokens: int, batch: int = 1):
  """A ``gen.Generator`` ready to decode ``new_tokens`` steps over ``batch`` rows of a cache of
  ``prompt`` slots, allocated but not filled: the state prefill would leave, without running
  it (the module doc: a decode step reads every slot either way)."""
  config = model.config
  layout = gen.plan_cache(model.mesh, batch=batch, prompt_len=prompt,
                          max_new_tokens=new_tokens + 1, kv_heads=config.num_kv_heads,
                          head_dim=config.head_dim, dtype=config.dtype,
                          layer_windows=config.layer_windows())
  generator = gen.Generator(model, layout)
  rows = gen_steps.rows_sharding(layout)
  generator.cache = empty_cache(layout)
  generator.lengths = jax.device_put(np.full(batch, prompt, np.int32), rows)
  generator.tokens = jax.device_put(np.zeros(batch, np.int32), rows)
  return generator


def decode_only(model, prompt: int, new_tokens: int) -> dict:
  """ms per token of decode steps over a one-row cache of ``prompt`` slots that is allocated
  but not filled (``unfilled_generator``)."""
  return decode_ms(unfilled_generator(model, prompt, 2 * new_tokens + 1), new_tokens)


def ours(model, tokens: np.ndarray, new_tokens: int) -> dict:
  """Our time to first token (s, after an untimed run) and decode ms per token (``decode_ms``)."""
  config = model.config
  batch, prompt = tokens.shape
  layout = gen.plan_cache(model.mesh, batch=batch, prompt_len=prompt,
                          max_new_tokens=2 * new_tokens + 2, kv_heads=config.num_kv_heads,
                          head_dim=config.head_dim, dtype=config.dtype,
                          layer_windows=config.layer_windows())
  generator = gen.Generator(model, layout)
  lengths = np.full(batch, prompt, np.int32)
  generator.prefill(tokens, lengths)  # compiles
  generator.decode()
  start = time.perf_counter()
  generator.prefill(tokens, lengths)  # fetches the first token: blocks
  ttft = time.perf_counter() - start
  return {"ttft_s": ttft, **decode_ms(generator, new_tokens)}


def theirs(model, tokens: np.ndarray, new_tokens: int, cache: str = "static") -> dict:
  """transformers' time to first token and ms per token with its ``cache`` implementation
  (see the module doc)."""
  import torch
  ids = torch.from_numpy(tokens).long().to(model.device)
  options = dict(do_sample=False, eos_token_id=None, pad_token_id=0,
                 cache_implementation=cache)

  def seconds(ids, count):
    start = time.perf_counter()
    with torch.no_grad():
      model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count,
                     min_new_tokens=count, **options)[:, -1].tolist()  # synchronises
    return time.perf_counter() - start

  seconds(ids[:, :16], 2)
  first, all_ = seconds(ids, 1), seconds(ids, new_tokens)
  return {"hf_ttft_s": first, "hf_ms_per_token": 1e3 * (all_ - first) / (new_tokens - 1),
          "hf_cache": cache}


def theirs_static_else_dynamic(model, tokens: np.ndarray, new_tokens: int) -> dict:
  """``theirs`` with the static cache, or where that runs out of memory with the dynamic one
  (on an H200 the static cache's first 32K prompt asked for 16 GiB more with 138 of 140 in
  use, 2026-11-27)."""
  result = vs_transformers.or_out_of_memory(theirs, model, tokens, new_tokens)
  if result["status"] == "OOM":
    result = vs_transformers.or_out_of_memory(theirs, model, tokens, new_tokens, "dynamic")
  return result


def load_transformers(path: str, dtype: str):
  import torch
  import transformers
  device = "cuda" if jax.default_backend() == "gpu" else "cpu"
  return transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=getattr(torch, dtype), attn_implementation="sdpa").to(device).eval()


def agreement_row(path: str, name: str, vocab: int, prompt: int, new_tokens: int) -> dict:
  """Greedy tokens of ours and transformers in float32 from one random prompt."""
  from benchmarks import generate_agreement  # imports torch: only where transformers runs
  tokens = np.random.default_rng(1).integers(3, vocab, prompt).tolist()
  model = load_transformers(path, "float32")
  expected = generate_agreement.reference(model, [tokens], new_tokens)
  del model
  vs_transformers.free_torch_memory()
  mesh = make_mesh(1, 1, devices=jax.devices()[:1])
  ours_model = load_llama(path, mesh, dtype="float32", rules=gen.PARAM_RULES)
  got = gen.generate(ours_model, [tokens], max_new_tokens=new_tokens)
  return {"model": name, "prompt": prompt, "new_tokens": new_tokens, "dtype": "float32",
          **generate_agreement.agreement(got, expected)}


def longest_row(name, model, device, args, attention_rate_: float) -> dict:
  """The decode row at ``longest_prompt`` of ``--memory-gb`` or the GPU's allocator limit;
  its prefill's compute floor at ``attention_rate_`` (FLOP/s, timed at the longest prompt of
  the other rows)."""
  config = model.config
  limit = (args.memory_gb * 1e9 if args.memory_gb is not None
           else (device.memory_stats() or {}).get("bytes_limit"))
  prompt = longest_prompt(config, limit, step=64 if args.tiny else LONGEST_STEP) if limit else 0
  row = {"model": name, "batch": 1, "prompt": prompt, "ttft_s": None, "hf_status": "not run",
         "longest": f"weights + cache <= {LONGEST_SHARE:.0%} of {limit / 1e9:.1f} GB; decode "
                    "only, cache not filled" if limit else "no memory limit known"}
  if not prompt:
    return {**row, "status": "no prompt fits" if limit else "pass --memory-gb"}
  row.update(vs_transformers.or_out_of_memory(decode_only, model, prompt, args.new_tokens))
  needs = decode_bytes(config, 1, prompt)
  flops = prefill_flops(config, 1, prompt)
  row.update(weights_GB=needs["weights"] / 1e9, kv_read_GB=needs["kv"] / 1e9,
             floor_ms_per_token=1e3 * (needs["weights"] + needs["kv"]) / args.copy,
             compute_floor_s=flops["matmul"] / args.matmul_rate
             + flops["attention"] / attention_rate_)
  if row["status"] == "ok":
    row["ms_vs_floor"] = row["ms_per_token"] / row["floor_ms_per_token"]
  return row


_START = time.perf_counter()


def log(message) -> None:
  """Prints ``message`` after the seconds since the start (where a stage's minutes go)."""
  print(f"[{time.perf_counter() - _START:.0f} s] {message}", flush=True)


def held_gb(device) -> str:
  """The GB JAX's allocator holds on ``device`` now (and at its peak), or "?" unknown."""
  stats = device.memory_stats() or {}
  if "bytes_in_use" not in stats:
    return "?"
  return f"{stats['bytes_in_use'] / 1e9:.1f} (peak {stats.get('peak_bytes_in_use', 0) / 1e9:.1f})"


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="llama3.2-1b,llama3.1-8b")
  parser.add_argument("--prompts", default="32768,131072", help="prompt lengths")
  parser.add_argument("--batches", default="1,8")
  parser.add_argument("--new-tokens", type=int, default=32, help="timed decode steps (>= 2)")
  parser.add_argument("--agreement-prompt", type=int, default=512)
  parser.add_argument("--agreement-tokens", type=int, default=32)
  parser.add_argument("--no-transformers", action="store_true")
  parser.add_argument("--longest", action="store_true", help="also a decode row at the longest "
                      "prompt whose weights and cache fit the GPU (the module doc)")
  parser.add_argument("--memory-gb", type=float, default=None, help="the memory --longest "
                      "plans for (default: the GPU allocator's limit)")
  parser.add_argument("--tiny", action="store_true", help="CPU check: " + str(TINY))
  parser.add_argument("--json", default="")
  args = parser.parse_args(argv)
  if args.tiny:
    for key, value in TINY.items():
      setattr(args, key, value)
  if args.new_tokens < 2:
    parser.error(f"--new-tokens must be >= 2 (ms per token of transformers is a difference), "
                 f"got {args.new_tokens}")
  models = args.models.split(",")
  if unknown := [m for m in models if m not in llama.PRESETS]:
    parser.error(f"unknown --models {unknown}; choose from {sorted(llama.PRESETS)}")
  cases = [(int(p), int(b)) for p in args.prompts.split(",") for b in args.batches.split(",")]

  device = jax.devices()[0]
  copy = copy_bandwidth(device, COPY_BYTES.get(device.platform, COPY_BYTES["cpu"]))
  matmul_rate = metrics.measure_peak_flops("bfloat16")
  args.copy, args.matmul_rate = copy, matmul_rate
  log(f"{device.device_kind}: copy {copy / 1e9:.0f} GB/s (read + written), bf16 matmul "
      f"{matmul_rate / 1e12:.4g} TFLOP/s; weights random (bf16, seed 0)")
  mesh = make_mesh(1, 1, devices=[device])
  rows, agreement = [], []
  for name in models:
    config = llama.preset(name, dtype="bfloat16", param_dtype="bfloat16",
                          remat_policy="none")
    with tempfile.TemporaryDirectory() as path:
      model = llama.init_llama(config, mesh, rules=gen.PARAM_RULES)
      if not args.no_transformers:
        save_llama(model, path)
      if not args.no_transformers and name == models[0]:
        agreement.append(agreement_row(path, name, config.vocab_size, args.agreement_prompt,
                                       args.agreement_tokens))
        log(agreement[-1])
      rng = np.random.default_rng(0)
      prompts = {case: rng.integers(3, config.vocab_size, (case[1], case[0]), dtype=np.int32)
                 for case in cases}
      too_big = {case: why for case in cases
                 if (why := does_not_fit(config, *case, device)) is not None}
      hf = dict(too_big)
      if not args.no_transformers:
        # Whether JAX's allocator left transformers room (an H200 run, 2026-11-27, found 138 of
        # 140 GiB in use when transformers ran out of memory at its first 32K prompt).
        log(f"{name}: transformers' cases; JAX holds {held_gb(device)} GB")
        hf_model = load_transformers(path, "bfloat16")
        hf.update({case: theirs_static_else_dynamic(hf_model, prompts[case], args.new_tokens)
                   for case in cases if case not in too_big})
        del hf_model
        vs_transformers.free_torch_memory()
    rates = {prompt: attention_rate(config, prompt, device) for prompt, _ in cases}
    for prompt, batch in cases:
      row = {"model": name, "batch": batch, "prompt": prompt,
             **(too_big.get((prompt, batch)) or vs_transformers.or_out_of_memory(
                 ours, model, prompts[prompt, batch], args.new_tokens))}
      theirs_row = hf.get((prompt, batch), {"status": "not run"})
      row.update({k: v for k, v in theirs_row.items() if k.startswith("hf_")},
                 hf_status=theirs_row["status"])
      needs = decode_bytes(config, batch, prompt)
      flops = prefill_flops(config, batch, prompt)
      row.update(weights_GB=needs["weights"] / 1e9, kv_read_GB=needs["kv"] / 1e9,
                 floor_ms_per_token=1e3 * (needs["weights"] + needs["kv"]) / copy,
                 compute_floor_s=flops["matmul"] / matmul_rate
                 + flops["attention"] / rates[prompt],
                 prefill_TFLOP=(flops["matmul"] + flops["attention"]) / 1e12)
      if row["status"] == "ok":
        row["ms_vs_floor"] = row["ms_per_token"] / row["floor_ms_per_token"]
        row["ttft_vs_floor"] = row["ttft_s"] / row["compute_floor_s"]
      for key in ("losses", "times", "peak_GiB"):
        row.pop(key, None)
      rows.append(row)
      log({k: row.get(k) for k in COLUMNS})
    if args.longest:
      rows.append(longest_row(name, model, device, args, rates[max(rates)]))
      log({k: rows[-1].get(k) for k in COLUMNS})
    del model
  print(f"one {device.device_kind}, bf16, random weights; ttft = time to first token (s); "
        "floors: decode bytes / copy bandwidth, prefill FLOPs / timed matmul and attention "
        "rates")
  common.print_table(rows, COLUMNS)
  if agreement:
    print("greedy tokens, float32, ours vs transformers:")
    common.print_table(agreement, list(agreement[0]))
  result = {"rows": rows, "agreement": agreement, "copy_GB_per_s": copy / 1e9,
            "matmul_TFLOPs": matmul_rate / 1e12}
  if args.json:
    extra = {} if args.no_transformers else {"versions": vs_transformers.versions()}
    common.write_json(args.json, rows, agreement=agreement, copy_GB_per_s=copy / 1e9,
                      matmul_TFLOPs=matmul_rate / 1e12, new_tokens=args.new_tokens,
                      weights="random (bf16, seed 0)", **extra)
  return result


if __name__ == "__main__":
  main()
