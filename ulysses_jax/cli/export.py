"""ulysses-export --workdir=DIR [--step=N] --out=HF_DIR [--param_dtype=bfloat16]

(or ``python -m ulysses_jax.export``.) Writes checkpoint N (default: the newest) of a training
workdir as a Hugging Face model directory that ``transformers`` loads
(``ulysses_jax.export``). Exit codes (``ulysses_jax.cli``): 0 written, 2 bad input (no such
checkpoint; nothing written).
"""

import jax

from ulysses_jax import cli
from ulysses_jax.hf import weights as hf
from ulysses_jax.hf.export import export_checkpoint


def parser() -> cli.Parser:
  p = cli.Parser("ulysses-export", __doc__)
  p.add_argument("--workdir", required=True, help="a training workdir (or checkpoints/)")
  p.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
  p.add_argument("--out", required=True, help="the Hugging Face directory to write")
  p.add_argument("--param_dtype", choices=sorted(hf.SAFETENSORS_DTYPES),
                 help="dtype of the written weights (default: the run's "
                      "LlamaConfig.param_dtype)")
  return p


def run(argv: list[str] | None = None) -> str:
  """Exports as the flags say; returns the directory written."""
  return _export(parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)

  def body() -> int:
    _export(args)
    return cli.EXIT_OK
  return cli.run(body, args.debug)


def _export(args) -> str:
  jax.config.update("jax_platforms", "cpu")  # shapes only: leave accelerators to training
  out = export_checkpoint(args.workdir, args.out, step=args.step, dtype=args.param_dtype)
  print(f"wrote {out}: load it with transformers.AutoModelForCausalLM.from_pretrained"
        f"({out!r})")
  return out
