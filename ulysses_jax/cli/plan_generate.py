"""``ulysses-plan --generate``: the planner for generation (``ulysses_jax.plan.generate``).

    ulysses-plan --generate --model=llama3.1-8b --prompt_len=1048576 --devices=8

It prints the KV cache, the prefill and decode memory per device and the predicted prefill
time and decode time per token, without compiling (``ulysses-aot --generate`` compiles the
same programs). The mesh is ``--mesh`` (DATAxSEQxRING), by default ``seq`` over one NVLink
domain and ``ring`` over the domains, as the issue's layouts. Exits 1 when it does not fit.
"""

from ulysses_jax import cli
from ulysses_jax.plan.generate import GenerationQuestion, format_generation_plan, \
    predict_generation


def run(args, gpu) -> dict:
  """The prediction for ``args`` (parsed by ``cli.plan``) on ``gpu`` (its budget applied)."""
  if not args.prompt_len:
    cli.fail("--generate needs --prompt_len (tokens per prompt, >= 1).")
  seq = min(args.devices, args.intra_node)
  data, seq, ring = args.mesh or (1, seq, args.devices // seq)
  if data * seq * ring != args.devices:
    cli.fail(f"the mesh {data}x{seq}x{ring} needs {data * seq * ring} devices, not "
             f"--devices={args.devices}; give --mesh=DATAxSEQxRING with their product "
             f"{args.devices}.")
  config = args.model_config.replace(dtype=args.dtype, param_dtype=args.dtype)
  try:
    question = GenerationQuestion(
        prompt_len=args.prompt_len, data=data, seq=seq, ring=ring, batch=args.batch,
        max_new_tokens=args.max_new_tokens, chunk_len=args.prefill_chunk or None,
        nodes=-(-args.devices // args.intra_node), dtype=args.dtype)
  except ValueError as e:
    cli.fail(str(e), debug=args.debug)
  result = {"model": args.model, **predict_generation(config, question, gpu)}
  print(format_generation_plan(result))
  if args.json:
    cli.write_json(args.json, result)
    print(f"wrote {args.json}")
  if not result["fits"]:
    cli.fail("generation does not fit: shorten the prompt, add devices (ring) or batch "
             "fewer prompts.", code=cli.EXIT_FAILED)
  return result
