"""The layout planner's command line (``ulysses-plan``): what it recommends and prints, and its
errors."""

import json
import re

import gin
import pytest

from ulysses_jax import plan
from ulysses_jax.hf import weights as hf
from ulysses_jax.aot.devices import cuda_plugin_installed
from ulysses_jax.cli import gin_config
from ulysses_jax.cli import plan as plan_cli
from ulysses_jax.gpus import GPUS
from ulysses_jax.models import llama


def test_command_line(capsys):
  best = plan_cli.run(["--model=llama3.1-8b", "--seq-len=1048576", "--devices=32",
                        "--gpu-mem=80", "--intra-node=8"])
  out = capsys.readouterr().out
  assert "in Python: make_mesh(data=1, seq=" in out and best["layout"].ring > 1
  # Each given flag pins its knob.
  best = plan_cli.run(["--model=llama3.1-8b", "--seq-len=131072", "--devices=1",
                        "--host-mem-per-gpu=128", "--mlp-chunk=2048", "--param-dtype=bfloat16",
                        "--no-master-weights", "--offload=optimizer", "--remat=full_offload",
                        "--remat-group=2", "--head-chunks=2", "--mesh=1x1x1"])
  lay, precision = best["layout"], best["precision"]
  assert (best["mlp_chunk"], precision.param_dtype, precision.master_weights) == (
      2048, "bfloat16", False)
  assert (lay.remat, lay.remat_group, lay.attn_head_chunks, lay.offload_optimizer,
          lay.offload_params) == ("full_offload", 2, 2, True, False)
  with pytest.raises(SystemExit):
    plan_cli.run(["--model=llama3.1-8b", "--seq-len=1024", "--devices=1", "--master-weights",
                   "--param-dtype=float32"])
  assert "give param_dtype='bfloat16'" in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_info:
    plan_cli.run(["--model=llama3.1-8b", "--seq-len=1024", "--devices=1", "--head-chunks=3"])
  assert exit_info.value.code == 2
  assert "--head_chunks must divide 8 (the model's), got 3" in capsys.readouterr().err


README_QUESTION = ["--model=llama3.1-8b", "--seq-len=4194304", "--devices=8", "--gpu-mem=80"]


@pytest.mark.parametrize("host", ["--host-mem=2000", "--host-mem-per-gpu=250"])
def test_answers_the_readmes_question_searching_what_users_would_guess(host, capsys):
  """Llama-3.1-8B at 4M tokens on 8 x 80 GB with no knob given: the search finds the MLP
  tile and precision that the shipped 8-GPU config states, where a float32, untiled guess
  fits nothing."""
  best = plan_cli.run([*README_QUESTION, host])
  out = capsys.readouterr().out
  assert best["memory"]["total"] <= 80e9 and best["memory"]["host"] <= 250e9
  assert best["mlp_chunk"] > 0 and best["layout"].data * best["layout"].seq == 8
  assert "250 GB of free host memory per GPU" in out
  assert f"({best['precision'].trade_off})" in out  # the recommendation states its numerics
  with pytest.raises(SystemExit) as exit_info:  # the knobs guessed as the user did
    plan_cli.run([*README_QUESTION, host, "--mlp-chunk=0"])
  assert exit_info.value.code == 1


def test_nothing_fits_says_the_longest_length_and_the_fewest_devices(capsys):
  asked = ["--model=llama3.1-8b", "--gpu-mem=80", "--host-mem-per-gpu=250"]
  with pytest.raises(SystemExit) as exit_info:
    plan_cli.run([*asked, "--seq-len=67108864", "--devices=8"])
  out, err = capsys.readouterr()
  assert exit_info.value.code == 1 and len(err.strip().splitlines()) == 1
  longest = int(re.search(r"longest sequence that fits on these 8 devices: ([0-9,]+) tokens",
                          out)[1].replace(",", ""))
  fewest = int(re.search(r"fewest devices of this kind for 67,108,864 tokens: ([0-9,]+)",
                         out)[1].replace(",", ""))
  assert f"the longest that fits is {longest:,} tokens" in err and f": {fewest:,}." in err
  assert 4194304 <= longest < 67108864 and 8 < fewest
  assert plan_cli.run([*asked, f"--seq-len={longest}", "--devices=8"])  # it fits
  for seq_len, devices in ((longest + 8 * 1024, 8), (67108864, fewest - 8)):
    with pytest.raises(SystemExit):  # a step longer, or one node fewer, does not
      plan_cli.run([*asked, f"--seq-len={seq_len}", f"--devices={devices}"])
  assert plan_cli.run([*asked, "--seq-len=67108864", f"--devices={fewest}"])


def test_units_a_user_cannot_misread(capsys):
  plan_cli.run(["--model=llama3.2-1b", "--seq-len=65536", "--devices=8"])
  header = capsys.readouterr().out.splitlines()[1]
  # GPU memory: the budget aot's fit check uses (Gpu.budget_bytes), in GiB as aot prints it.
  assert f"usable GPU memory {GPUS['h100'].budget_bytes / 2**30:.2f} GiB per device" in header
  assert "256 GB of free host memory per GPU" in header
  assert "less the runtime reserve (7.91 GiB)" in header
  # The reserve is aot's --reserve_gib, in GiB; the budget is what is left.
  plan_cli.run(["--model=llama3.2-1b", "--seq-len=65536", "--devices=8", "--reserve-gib=4"])
  header = capsys.readouterr().out.splitlines()[1]
  assert (f"usable GPU memory {GPUS['h100'].memory_bytes / 2**30 - 4:.2f} GiB per device" in
          header and "less the runtime reserve (4.00 GiB)" in header)
  # Host memory per node is divided over the node's devices in use, and the header says so.
  plan_cli.run(["--model=llama3.2-1b", "--seq-len=65536", "--devices=4", "--host-mem=1000"])
  assert "250 GB of free host memory per GPU (1000 GB per node, over 4 GPUs)" in (
      capsys.readouterr().out)
  # No abbreviations: --host-mem-per is not silently one of the two host flags.
  with pytest.raises(SystemExit) as exit_info:
    plan_cli.run(["--model=llama3.2-1b", "--seq-len=65536", "--devices=8", "--host-mem-per=9"])
  assert exit_info.value.code == 2
  # --gpu picks the GPU of the one table that aot reads: an A100 is predicted slower.
  h100 = plan_cli.run(["--model=llama3.2-1b", "--seq-len=65536", "--devices=8",
                        "--mesh=1x8x1", "--remat=full", "--offload=none"])
  a100 = plan_cli.run(["--model=llama3.2-1b", "--seq-len=65536", "--devices=8", "--gpu=a100",
                        "--mesh=1x8x1", "--remat=full", "--offload=none"])
  assert "8 x NVIDIA A100-SXM4-80GB" in capsys.readouterr().out
  assert a100["step"]["compute_s"] == pytest.approx(
      h100["step"]["compute_s"] * GPUS["h100"].bf16_flops / GPUS["a100"].bf16_flops)


def test_a_checkpoint_or_a_fine_tuning_config_names_init_from(tmp_path, capsys):
  (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(llama.preset("llama3.1-8b"))))
  plan_cli.run([f"--model={tmp_path}", "--seq-len=131072", "--devices=8"])
  assert f'TrainConfig.init_from="{tmp_path}"' in _gin_params(capsys.readouterr().out)
  finetune = ["--model=configs/finetune_llama8b_128k.gin", "--devices=8"]
  plan_cli.run([*finetune, f"--init-from={tmp_path}"])
  params = _gin_params(capsys.readouterr().out)
  assert f'TrainConfig.init_from="{tmp_path}"' in params and "DataConfig.seq_len=131072" in params
  with pytest.raises(SystemExit) as exit_info:
    plan_cli.run(finetune)
  assert exit_info.value.code == 2
  assert "give the checkpoint it starts from, --init_from=DIR" in capsys.readouterr().err
  # --verify compiles a checkpoint directory's model (init_from), not a lone config.json.
  with pytest.raises(SystemExit) as exit_info:
    plan_cli.run([f"--model={tmp_path / 'config.json'}", "--seq-len=131072", "--devices=8",
                   "--verify"])
  assert exit_info.value.code == 2
  assert "--verify compiles a preset, a checkpoint directory or a gin" in capsys.readouterr().err


@pytest.mark.skipif(cuda_plugin_installed(), reason="this Python can compile for GPUs")
def test_verify_without_the_cuda_plugin_is_one_error_line(tmp_path, capsys):
  args = ["--model=llama3.2-1b", "--seq-len=196608", "--verify"]
  with pytest.raises(SystemExit) as exit_info:
    plan_cli.run([*args, "--devices=8"])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
  assert err.startswith("error: --verify: compiling for GPUs needs JAX's CUDA plugin")
  with pytest.raises(SystemExit):
    plan_cli.run([*args, "--devices=12"])  # 1.5 nodes of 8
  assert "must be a multiple of --intra_node (8)" in capsys.readouterr().err
  (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(llama.preset("llama3.2-1b"))))
  with pytest.raises(SystemExit):  # a checkpoint directory gets as far as the compile
    plan_cli.run([f"--model={tmp_path}", "--seq-len=196608", "--devices=8", "--verify"])
  assert "compiling for GPUs needs JAX's CUDA plugin" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.gpu_compile  # run by make test-gpu-compile, in the venv with the CUDA plugin
@pytest.mark.skipif(not cuda_plugin_installed(), reason="needs JAX's CUDA plugin")
def test_verify_compiles_the_recommendation(capsys):
  best = plan_cli.run(["--model=llama3.2-1b", "--seq-len=65536", "--devices=8", "--verify"])
  out = capsys.readouterr().out
  compiled = re.search(r"\n  device +([0-9.]+) +([0-9.]+) ", out)
  assert compiled, out
  assert float(compiled[1]) == pytest.approx(best["memory"]["total"] / 2**30, abs=0.01)
  assert float(compiled[2]) > 0  # remat="none" recommended: 24.64 GiB predicted, 24.61 compiled
  as_is, pressed = map(float, re.search(r"as is, ([0-9.]+), and under memory pressure, "
                                        r"([0-9.]+)", out).groups())
  assert float(compiled[2]) == min(as_is, pressed)


def test_verify_says_the_trainer_runs_the_step_under_memory_pressure_where_only_that_fits():
  gib = 2**30
  report = dict(budget_bytes=71.2 * gib, fits=False, device_bytes=71.45 * gib,
                device_bytes_under_pressure=70.43 * gib)
  line = plan_cli._fit_line(report)
  assert line == ("  the compiled step DOES NOT FIT in the budget, 71.20 GiB; compiled under "
                  "memory pressure it does, and ulysses-train runs that program (it recomputes "
                  "more: a slower step). Your own loop gets the same with "
                  "XLA_FLAGS=--xla_gpu_memory_limit_slop_factor=10")
  report["device_bytes_under_pressure"] = 72 * gib
  assert plan_cli._fit_line(report) == "  the compiled step DOES NOT FIT in the budget, 71.20 GiB"
  report.update(fits=True, device_bytes=70 * gib)
  assert plan_cli._fit_line(report) == "  the compiled step fits in the budget, 71.20 GiB"


def _gin_params(out):
  return re.findall(r"--gin_param='([^']*)'", out)


def test_recommends_only_layouts_the_trainer_accepts(capsys):
  # 131071 tokens divide over no sequence shards, and one row over no data shards.
  with pytest.raises(SystemExit) as exit_info:
    plan_cli.run(["--model=llama3.2-1b", "--seq-len=131071", "--devices=8"])
  err = capsys.readouterr().err.strip()
  assert exit_info.value.code == 1 and len(err.splitlines()) == 1
  assert err.startswith("error: no layout of 8 devices splits the work as the trainer needs")
  assert re.search(r"the longest that fits is [0-9,]+ tokens\)\.$", err), err
  model = plan.Model.from_config(llama.preset("llama3.2-1b"))
  rows = plan.plan(model, seq_len=3 * 2**15, devices=8, batch=4, accum_steps=2,
                   hardware=plan.Hardware.of("h100"))
  assert rows
  for row in rows:
    lay = row["layout"]
    assert (3 * 2**15) % (lay.seq * lay.ring) == 0 and 4 % (lay.data * 2) == 0
    assert not lay.offload_params  # the trainer keeps accumulated gradients on the device


def test_prints_the_trainers_gin_settings(capsys):
  best = plan_cli.run(["--model=llama3.2-1b", "--seq-len=65536", "--devices=8", "--batch=4",
                        "--accum-steps=2", "--param-dtype=bfloat16", "--master-weights"])["layout"]
  params = _gin_params(capsys.readouterr().out)
  try:
    config = gin_config.read(["configs/tiny_cpu.gin"], params)
  finally:
    gin.clear_config()
  run, model, data = config.train, config.model, config.data
  assert (run.mesh_data, run.mesh_seq, run.mesh_ring) == (best.data, best.seq, best.ring)
  assert (run.offload_optimizer, run.offload_params) == (best.offload_optimizer,
                                                          best.offload_params)
  assert (run.accum_steps, run.master_weights, data.seq_len, data.batch_size) == (
      2, True, 65536, 4)
  assert (model.remat_policy, model.remat_group, model.dtype, model.param_dtype) == (
      best.remat, best.remat_group, "bfloat16", "bfloat16")
  assert model.attn_head_chunks == best.attn_head_chunks


def test_model_from_a_config_json_or_a_gin_file(tmp_path, capsys):
  config = llama.preset("qwen2.5-7b")
  (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(config)))
  args = ["--seq-len=131072", "--devices=8"]
  expected = plan_cli.run(["--model=qwen2.5-7b", *args])
  for model in (tmp_path, tmp_path / "config.json"):
    assert plan_cli.run([f"--model={model}", *args]) == expected
  # A gin file gives the model and the defaults of --seq-len, --batch and --accum-steps.
  best = plan_cli.run(["--model=configs/llama1b_128k.gin", "--devices=8"])["layout"]
  params = dict(p.split("=", 1) for p in _gin_params(capsys.readouterr().out))
  assert (params["DataConfig.seq_len"], params["DataConfig.batch_size"],
          params["TrainConfig.accum_steps"]) == ("131072", "8", "4")
  assert 8 % (best.data * 4) == 0


@pytest.mark.parametrize("model,message", [
    ("llama9", r"error: unknown model 'llama9': give a preset \(cpu-demo, gemma3-1b, "),
    ("{bad_json}", r"error: .*config.json: not a usable Hugging Face config.json"),
    ("{bad_gin}", r"error: .*bad.gin: "),
])
def test_bad_input_is_one_error_line_and_exit_2(model, message, tmp_path, capsys):
  (tmp_path / "config.json").write_text('{"model_type": "llama"}')
  (tmp_path / "bad.gin").write_text("LlamaConfig.hidden_dimm = 3\n")
  model = model.format(bad_json=tmp_path / "config.json", bad_gin=tmp_path / "bad.gin")
  with pytest.raises(SystemExit) as exit_info:
    plan_cli.run([f"--model={model}", "--seq-len=1024", "--devices=8"])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
  assert re.match(message, err), err
