"""Generates text from (very long) prompts: sequence-parallel prefill, a KV cache sharded over
the mesh, distributed decoding (``ulysses_jax.generate``).

  ulysses-generate (--hf=DIR | --workdir=DIR [--step=N]) (--prompt=TEXT | --prompts=FILE.jsonl)
      [--max_new_tokens=N] [--temperature=T] [--top_k=K] [--top_p=P] [--seed=S]
      [--stop=TEXT ...] [--mesh_data=N] [--mesh_seq=P] [--mesh_ring=R] [--prefill_chunk=T]
      [--dtype=D] [--fsdp_params] [--tokenizer=T] [--platform=P] [--cpu_devices=N]
      [--json=OUT]

(or ``python -m ulysses_jax.generate``.) ``--prompts``: one JSON object per line,
``{"prompt": str}`` (tokenized with the checkpoint's tokenizer, its special tokens added as
transformers' tokenizer adds them) or ``{"prompt_ids": [int]}``; all prompts run as one batch,
of any lengths. Greedy unless ``--temperature`` > 0 (then ``--top_k``, ``--top_p``,
``--seed``). A row stops at an EOS id of the checkpoint (``eos_token_id`` of ``config.json``
and ``generation_config.json``; a workdir's ``DataConfig.eos_id``), at a ``--stop`` text in
its decoded output (repeatable; needs a tokenizer), or after ``--max_new_tokens``.

The mesh flags mean what ``TrainConfig``'s do (``--mesh_seq`` devices on the Ulysses axis,
``--mesh_ring`` on the ring axis, ``--mesh_data`` the rest); the prefill runs the model's
sequence-parallel forward over them, in chunks of ``--prefill_chunk`` tokens when given (a
progress bar) and in one pass otherwise. The weights are replicated on every device (decoding
reads them in place; ``--fsdp_params`` keeps the training layout). Before the prefill the KV
cache's size per device is printed (on stderr, like every message); the text of a single
prompt streams to stdout, several prompts print when done. ``--json`` writes
``{"results": [{"output_ids": [...], "text": ...}, ...]}`` in the prompts' order (text null
without a tokenizer).

Exit codes (``ulysses_jax.cli``): 0 generated, 2 bad input (found before the model is loaded:
an empty prompt, one longer than the model's positions, ``--top_p`` outside (0, 1], a mesh the
devices cannot form, a file or checkpoint that is not there).
"""

import json
import os
import sys
import time

import jax
from tqdm import tqdm

from ulysses_jax import cli, kernel_check, sharding, step_builder
from ulysses_jax.hf import init_from as finetune
from ulysses_jax import generate as generate_lib
from ulysses_jax.config_checks import ConfigError
from ulysses_jax.data.corpus import make_tokenizer
from ulysses_jax.generate import Sampling
from ulysses_jax.models.config import LlamaConfig
from ulysses_jax.data.records import jsonl_lines
from ulysses_jax.run_config import RunConfig, TrainConfig


def parser() -> cli.Parser:
  p = cli.Parser("ulysses-generate", __doc__)
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--hf", help="a Hugging Face checkpoint directory")
  source.add_argument("--workdir", help="a training workdir of ours (or its checkpoints/)")
  prompts = p.add_mutually_exclusive_group(required=True)
  prompts.add_argument("--prompt", help="one prompt, as text")
  prompts.add_argument("--prompts", help='JSONL: {"prompt": str} or {"prompt_ids": [int]} '
                       "per line")
  add = p.add_argument
  add("--step", type=int, help="with --workdir: the step (default: newest)")
  add("--max_new_tokens", type=int, default=64, help="new tokens per prompt at most")
  add("--temperature", type=float, default=0.0, help="0: greedy (default)")
  add("--top_k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
  add("--top_p", type=float, default=1.0, help="sample from the smallest set of tokens whose "
      "probability reaches p (1: all)")
  add("--seed", type=int, default=0, help="the sampling seed")
  add("--stop", action="append", default=[], help="stop a row once its text contains this "
      "(repeatable)")
  add("--mesh_data", type=int, default=-1, help="devices on the data axis (-1: the rest)")
  add("--mesh_seq", type=int, default=1, help="devices on the Ulysses (seq) axis")
  add("--mesh_ring", type=int, default=1, help="devices on the ring axis")
  add("--prefill_chunk", type=int, default=0, help="prefill in chunks of this many tokens "
      "(0: the whole prompt in one pass)")
  add("--dtype", help="LlamaConfig.dtype: the compute and cache dtype (default: the "
      "checkpoint's, a run's LlamaConfig.dtype or config.json's torch_dtype)")
  add("--fsdp_params", action="store_true", help="keep the weights sharded as in training "
      "(FSDP: less memory, an all-gather of every weight per token) instead of replicated")
  add("--tokenizer", help="'byte' or a tokenizer.json (default: the checkpoint's "
      "tokenizer.json / the run's DataConfig.tokenizer)")
  add("--no_kernel_check", action="store_true", help="skip the attention kernel's "
      "self-check (ulysses_jax.kernel_check)")
  cli.add_json_flag(p, "the outputs")
  cli.add_platform_flags(p)
  return p


def _parse(argv):
  p = parser()
  args = p.parse_args(argv)
  if args.step is not None and not args.workdir:
    p.error("--step goes with --workdir")
  if args.max_new_tokens < 1:
    p.error(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
  if args.prefill_chunk < 0:
    p.error(f"--prefill_chunk must be >= 0, got {args.prefill_chunk}")
  return args


def main(argv: list[str] | None = None) -> int:
  args = _parse(argv)

  def body() -> int:
    run_parsed(args)
    return cli.EXIT_OK
  return cli.run(body, args.debug, bad_input=(ConfigError, ValueError, OSError))


def run(argv: list[str] | None = None) -> dict:
  """Generates as the flags say; returns what ``--json`` writes."""
  return run_parsed(_parse(argv))


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


class _Checkpoint:
  """What the command needs of ``--hf`` or ``--workdir``: the directory, its model config,
  tokenizer name, EOS ids and position limit (None: no limit known)."""

  def __init__(self, args):
    data = {}
    if args.workdir:
      saved = finetune.SavedParams(args.workdir, args.step)
      self.source = os.path.dirname(saved.state_dir)
      data = saved.run.get("data", {})
      self.eos_ids = eos_ids(run_data=data)
      self.max_positions = None
    else:
      self.source = args.hf
      self.eos_ids = eos_ids(hf=args.hf)
      self.max_positions = _read_json(os.path.join(args.hf, "config.json")).get(
          "max_position_embeddings")
      tokenizer_json = os.path.join(args.hf, "tokenizer.json")
      if os.path.isfile(tokenizer_json):
        data = {"tokenizer": tokenizer_json}
    self.tokenizer = args.tokenizer or data.get("tokenizer")
    dtype, self.dtype_reason = finetune.compute_dtype(self.source, args.dtype)
    given = {"dtype": dtype, "remat_policy": "none", "attn_head_chunks": 1}
    self.train = TrainConfig(mesh_data=args.mesh_data, mesh_seq=args.mesh_seq,
                             mesh_ring=args.mesh_ring, init_from=self.source)
    self.config = step_builder.resolve(RunConfig(train=self.train,
                                                 model=LlamaConfig(**given)),
                                       given=given).model


def eos_ids(hf: str | None = None, run_data: dict | None = None) -> tuple[int, ...]:
  """The ids that end generation: a Hugging Face checkpoint's ``eos_token_id`` (of its
  ``config.json`` and ``generation_config.json``), or a training run's ``DataConfig.eos_id``
  (``run_data``: the run's ``data`` section)."""
  if hf is None:
    eos = (run_data or {}).get("eos_id")
    return () if eos is None else (int(eos),)
  hf_config = _read_json(os.path.join(hf, "config.json"))
  generation = _read_json(os.path.join(hf, "generation_config.json"))
  return tuple(dict.fromkeys(_ids(hf_config.get("eos_token_id")) +
                             _ids(generation.get("eos_token_id"))))


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _ids(value) -> list[int]:
  if value is None:
    return []
  return [int(v) for v in (value if isinstance(value, list) else [value])]


def read_prompts(args, tokenizer) -> list[list[int]]:
  """The prompts of ``--prompt`` or ``--prompts`` as token ids; raises ``ValueError`` naming
  the file and line of a malformed one, or text without a tokenizer."""
  def encode(text: str, where: str) -> list[int]:
    if tokenizer is None:
      raise ValueError(f"{where}: a text prompt needs a tokenizer: the checkpoint has no "
                       "tokenizer.json; give --tokenizer or prompt_ids")
    return [int(i) for i in tokenizer.encode_batch([text.encode()],
                                                   add_special_tokens=True)[0]]

  if args.prompt is not None:
    return [encode(args.prompt, "--prompt")]
  prompts = []
  for where, record, line in jsonl_lines(args.prompts):
    if isinstance(record, dict) and isinstance(record.get("prompt_ids"), list):
      if not all(isinstance(t, int) for t in record["prompt_ids"]):
        raise ValueError(f"{where}: prompt_ids must be a list of integers")
      prompts.append(record["prompt_ids"])
    elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
      prompts.append(encode(record["prompt"], where))
    else:
      raise ValueError(f'{where}: expected {{"prompt": str}} or {{"prompt_ids": [int]}}, '
                       f"got {line.strip()[:80]}")
  if not prompts:
    raise ValueError(f"{args.prompts}: no prompts (one JSON object per line)")
  return prompts


def run_parsed(args) -> dict:
  """The generation of the parsed flags: every input checked, then the model loaded, the
  outputs streamed or printed (and written) and returned."""
  sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      seed=args.seed)
  cli.start_jax(args)
  checkpoint = _Checkpoint(args)
  config = checkpoint.config
  tokenizer = make_tokenizer(checkpoint.tokenizer) if checkpoint.tokenizer else None
  if args.stop and tokenizer is None:
    raise ConfigError("--stop needs a tokenizer to decode the output: the checkpoint has none; "
                      "give --tokenizer")
  prompts = read_prompts(args, tokenizer)
  generate_lib.check_prompts(prompts, vocab_size=config.vocab_size,
                             max_new_tokens=args.max_new_tokens,
                             max_positions=checkpoint.max_positions)
  devices = jax.devices()
  sequence = args.mesh_seq * args.mesh_ring
  mesh = step_builder.run_mesh(checkpoint.train, devices if args.mesh_data == -1 else
                               devices[:args.mesh_data * sequence])
  layout = generate_lib.plan_cache(
      mesh, batch=len(prompts), prompt_len=max(map(len, prompts)),
      max_new_tokens=args.max_new_tokens, kv_heads=config.num_kv_heads,
      head_dim=config.head_dim, dtype=config.dtype, layer_windows=config.layer_windows(),
      chunk_len=args.prefill_chunk or None)
  # Every input checked: now the kernel and the weights.
  attention = kernel_check.settle(config, mesh, seq_len=layout.prompt_len,
                                  check=not args.no_kernel_check, segment_ids_given=False)
  model = finetune.load_model(checkpoint.source, attention.model_config(config), mesh,
                              rules=sharding.DEFAULT_RULES if args.fsdp_params else
                              generate_lib.PARAM_RULES)
  _log(f"computing in {config.dtype} ({checkpoint.dtype_reason}), the KV cache too")
  _log(f"attention: {attention.choice.reason}")
  _log(f"mesh {dict(mesh.shape)}; {len(prompts)} prompt(s) of up to {layout.prompt_len} tokens "
       f"(padded), EOS ids {list(checkpoint.eos_ids)}")
  _log(generate_lib.describe_memory(layout))

  stream = _Stream(tokenizer) if len(prompts) == 1 else None
  bar = tqdm(total=layout.chunks, unit="chunk", desc="prefill", file=sys.stderr,
             disable=layout.chunks == 1)
  stop = None
  if args.stop:
    stop = lambda row, ids: any(s in tokenizer.decode(ids) for s in args.stop)
  start = time.perf_counter()
  outputs = generate_lib.generate(
      model, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
      eos_ids=checkpoint.eos_ids, stop=stop, layout=layout,
      on_token=None if stream is None else stream,
      progress=lambda done, total: bar.update(done - bar.n))
  bar.close()
  seconds = time.perf_counter() - start
  if stream is not None:
    stream.end()
  texts = [None if tokenizer is None else tokenizer.decode(ids) for ids in outputs]
  if stream is None:
    for i, (ids, text) in enumerate(zip(outputs, texts)):
      print(f"[{i}] " + (text if text is not None else " ".join(map(str, ids))), flush=True)
  _log(f"{sum(map(len, outputs))} tokens generated in {seconds:.1f} s (prefill included)")
  result = {"results": [{"output_ids": ids, "text": text} for ids, text in zip(outputs, texts)],
            "model": os.path.abspath(checkpoint.source), "mesh": dict(mesh.shape),
            "kv_cache_bytes_per_device": layout.bytes_per_device()}
  if args.json:
    cli.write_json(args.json, result)
  return result


class _Stream:
  """Prints one row's output to stdout as it comes: the text's new part after each token
  (the ids, without a tokenizer)."""

  def __init__(self, tokenizer):
    self.tokenizer, self.ids, self.shown = tokenizer, [], ""

  def __call__(self, row: int, token: int) -> None:
    self.ids.append(token)
    if self.tokenizer is None:
      print(token, end=" ", flush=True)
      return
    text = self.tokenizer.decode(self.ids)
    print(text[len(self.shown):] if text.startswith(self.shown) else text, end="", flush=True)
    self.shown = text

  def end(self) -> None:
    print(flush=True)
