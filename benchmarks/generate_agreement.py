"""How often greedy generation agrees with transformers' ``generate``, in float32 and bfloat16.

    python -m benchmarks.generate_agreement [--prompts 8] [--new_tokens 32] [--json PATH]
        [--families llama,gpt_oss,...]

For random models of each family (``FAMILIES``: Llama, Mistral with a window of 16 tokens,
Qwen3 with YaRN, Gemma 3 with sliding and full layers, Qwen3-MoE, Mixtral and gpt-oss; 2 or 3
layers, weights drawn with standard deviation 0.15 so that logits are far from ties),
``--prompts`` prompts of 24 to 96 tokens in one batch on a 1 x 2 x 4 (Ulysses x ring) mesh of
CPU devices, ``--new_tokens`` greedy tokens each, beside transformers' ``generate`` (one prompt
at a time, no EOS):

* ``float32`` against transformers in float32;
* ``bfloat16``: our weights in float32, compute and cache in bfloat16, against transformers with
  bfloat16 weights and compute, and against transformers in float32;
* the baseline of what bfloat16 alone changes: transformers in bfloat16 against transformers in
  float32 (``ours`` = ``transformers-bfloat16``).

Per row: ``identical`` (the share of prompts whose continuations agree token for token),
``prefix`` (the mean share of new tokens before the first difference) and ``positions`` (the
share of positions holding the same token). Greedy decoding amplifies the first difference
(the continuations part there), so ``prefix`` is the telling figure.
"""

import argparse
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks import common  # noqa: E402
from ulysses_jax import generate as gen  # noqa: E402
from ulysses_jax.hf.weights import load_llama  # noqa: E402
from ulysses_jax.mesh import make_mesh  # noqa: E402

SHAPES = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              initializer_range=0.15)
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral_window16": (transformers.MistralConfig, dict(sliding_window=16)),
    "qwen3_yarn": (transformers.Qwen3Config, dict(rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
        rope_theta=10_000.0))),
    # Untied: with Gemma's embedding scale, random tied embeddings make every row repeat one
    # token, which agrees trivially.
    "gemma3": (transformers.Gemma3TextConfig, dict(
        sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=32, tie_word_embeddings=False)),
    # Mixtures of experts (4 experts, 2 per token); gpt-oss with its sinks, biases, sliding
    # (16) and full layers and YaRN.
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        num_hidden_layers=3, mlp_only_layers=[0], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=128)),
    "mixtral_window16": (transformers.MixtralConfig, dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=16)),
    "gpt_oss": (transformers.GptOssConfig, dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"])),
}
COLUMNS = ["family", "ours", "transformers", "identical", "prefix", "positions"]


def reference(model, prompts, new_tokens):
  out = []
  with torch.no_grad():
    for prompt in prompts:
      ids = torch.tensor([prompt], device=model.device)
      out.append(model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=new_tokens, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist())
  return out


def agreement(ours, theirs) -> dict:
  prefix, same = [], []
  for a, b in zip(ours, theirs):
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    prefix.append((differ[0] if differ else len(b)) / len(b))
    same.append(np.mean([x == y for x, y in zip(a, b)]))
  return {"identical": float(np.mean([p == 1 for p in prefix])),
          "prefix": float(np.mean(prefix)), "positions": float(np.mean(same))}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--json", default="")
  parser.add_argument("--families", default=",".join(FAMILIES),
                      help=f"comma-separated, of {', '.join(FAMILIES)}")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, SHAPES["vocab_size"], n).tolist()
             for n in rng.integers(24, 97, args.prompts)]
  mesh = make_mesh(1, 2, 4)
  rows = []
  for family in args.families.split(","):
    config_class, fields = FAMILIES[family]
    torch.manual_seed(0)
    config = config_class(**{**SHAPES, **fields})
    model_class = getattr(transformers, config_class.__name__.replace(
        "TextConfig", "ForCausalLM").replace("Config", "ForCausalLM"))
    theirs32 = model_class(config).eval()
    with tempfile.TemporaryDirectory() as path:
      theirs32.save_pretrained(path)
      expected = {"float32": reference(theirs32, prompts, args.new_tokens),
                  "bfloat16": reference(theirs32.to(torch.bfloat16), prompts,
                                        args.new_tokens)}
      rows.append({"family": family, "ours": "transformers-bfloat16",
                   "transformers": "float32",
                   **agreement(expected["bfloat16"], expected["float32"])})
      print(rows[-1], flush=True)
      for dtype in ("float32", "bfloat16"):
        model = load_llama(path, mesh, dtype=dtype, rules=gen.PARAM_RULES)
        ours = gen.generate(model, prompts, max_new_tokens=args.new_tokens)
        for theirs_dtype in (("float32",) if dtype == "float32" else ("bfloat16", "float32")):
          row = {"family": family, "ours": dtype, "transformers": theirs_dtype,
                 **agreement(ours, expected[theirs_dtype])}
          rows.append(row)
          print(row, flush=True)
  common.print_table(rows, COLUMNS)
  if args.json:
    common.write_json(args.json, rows, prompts=args.prompts, new_tokens=args.new_tokens,
                      mesh=dict(mesh.shape), torch=torch.__version__,
                      transformers=transformers.__version__)


if __name__ == "__main__":
  main()
