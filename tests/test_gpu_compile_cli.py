"""The ``ulysses-aot`` command compiled for GPU clusters on a machine without a GPU: the shipped
configs fit the clusters their headers name, the planner's answers compile, offloaded state is
counted on the host, and what does not fit is said (``gpu_compile``, as
``tests/test_gpu_compile.py``, whose marks apply here too).
"""

import glob
import json
import logging
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from test_gpu_compile import GIB, MOSAIC, TRITON, _forward_kernels, pytestmark  # noqa: F401
from ulysses_jax import aot, make_mesh, sharding
from ulysses_jax.step_builder import build_train_step, run_mesh


def _cli(tmp_path, *flags):
  """Runs ``python -m ulysses_jax.aot`` in this process; (exit status, JSON report)."""
  from ulysses_jax.cli.aot import main
  path = tmp_path / "report.json"
  status = main([*flags, f"--json={path}"])
  return status, json.loads(path.read_text())


# Compiling a whole train step takes 1.5 to 2 minutes on 2 CPU cores: slow as well.
@pytest.mark.slow
def test_cli_llama1b_128k_on_one_node(tmp_path):
  status, r = _cli(tmp_path, "--gpu=h100", "--topology=1x1x8",
                   "--gin_file=configs/llama1b_128k.gin")
  assert status == 0 and r["fits"] and r["device_bytes"] < 0.2 * r["device_capacity_bytes"]
  assert r["host_bytes"] == 0 and r["kernels"]["mosaic"] >= 3 and not r["kernels"]["triton"]
  # Llama 3.2 1B: 16 layers, 32 query / 8 KV heads of 64; 2 rows of 131,072 tokens per
  # micro-batch, 4 micro-batches, seq=8. Each layer's 4 all-to-alls run in the forward, again
  # in its rematerialised forward and once more (the cotangents) in the backward.
  per_layer_pass = (2 * 32 + 2 * 8) * 64 * 2 * 131072 // 8 * 2
  assert r["collective_bytes"]["all-to-all"] == 16 * 3 * 4 * per_layer_pass
  assert r["flops"] > r["model_flops_per_device"]  # + rematerialisation, kernel recompute
  assert 0 < r["prediction"]["mfu"] < 1 and r["prediction"]["assumptions"]


@pytest.mark.slow
@pytest.mark.machine_jax  # its XLA ran attention's forward twice here before (Makefile)
@pytest.mark.parametrize("accumulate_dq", [False, True], ids=["table", "dkv-accumulating-dq"])
def test_llama1b_64k_on_one_gpu_runs_attention_forward_once_and_no_float32_gemm(
    monkeypatch, accumulate_dq):
  """Llama-3.2-1B, 65,536 tokens on one H100, remat "full": per layer one attention forward
  and its two backward kernels (the backward keeps the forward's output and lse), no float32 x
  float32 product (the chunked head's gradients multiply in bfloat16), the head's logits
  formed once (the gradients are formed in the forward scan), and it fits. With the dk/dv
  kernel accumulating dq (a sweep candidate) one backward kernel."""
  from ulysses_jax.aot import cost
  from ulysses_jax.aot.report import device_breakdown
  from ulysses_jax.cli.gin_config import read
  from ulysses_jax.kernels import mosaic_tiles
  from ulysses_jax.kernels.flash_kernels import Tile
  if accumulate_dq:
    row = ("sm90", 64, True)
    monkeypatch.setitem(mosaic_tiles.TABLE, row, (*mosaic_tiles.TABLE[row][:2],
                                                  Tile(64, 128, 12, 4, accumulate_dq=True)))
  config = read(["configs/llama1b_128k.gin"], [
      "DataConfig.seq_len=65536", "DataConfig.batch_size=1", "TrainConfig.mesh_seq=1",
      "TrainConfig.accum_steps=1"])
  jax.clear_caches()  # a layer traced by an earlier test would keep its tiles
  try:
    built = build_train_step(config, run_mesh(config.train, aot.gpu_devices("h100", "1x1x1")))
    compiled = built.step.lower(built.state, built.batch).compile()
  finally:
    jax.clear_caches()  # and a later test these
  text = compiled.as_text()
  assert text.count(MOSAIC) == 3 - accumulate_dq and _forward_kernels(text) == 1, text.count(
      MOSAIC)
  f32_products = [p for p in cost.products(text)
                  if all(o.startswith("f32[") for o in p.operands)]
  assert not f32_products, f32_products
  model = config.model
  logits = [p for p in cost.products(text)
            if p.shape.startswith(f"f32[{model.loss_chunk},{model.vocab_size}]")]
  assert len(logits) == 1, logits
  assert sum(device_breakdown(compiled.memory_analysis()).values()) < (
      aot.gpu_spec("h100").budget_bytes)


@pytest.mark.slow
def test_cli_finetune_config_reads_the_model_from_the_checkpoints_config_json(tmp_path):
  """configs/finetune_llama8b_128k.gin takes its model from ``init_from``: a directory with
  only Llama-3.1-8B's config.json is enough to compile it (no weights are read)."""
  from ulysses_jax import plan
  from ulysses_jax.hf import weights as hf
  from ulysses_jax.models.config import preset
  checkpoint = tmp_path / "llama8b"
  checkpoint.mkdir()
  config = preset("llama3.1-8b")
  (checkpoint / "config.json").write_text(json.dumps(hf.config_to_hf(config)))
  params = plan.Model.from_config(config).params
  status, r = _cli(tmp_path, "--gpu=h100", "--topology=1x1x8",
                   "--gin_file=configs/finetune_llama8b_128k.gin",
                   f"--gin_param=TrainConfig.init_from='{checkpoint}'")
  assert status == 0 and r["fits"]
  # float32 parameters and Adam moments of the 8B model, FSDP over 8 GPUs, are the arguments
  assert r["device_breakdown"]["arguments"] == pytest.approx(12 * params / 8, rel=0.01)


@pytest.mark.slow
def test_cli_llama8b_512k_on_one_node(tmp_path):
  status, r = _cli(tmp_path, "--gpu=h100", "--topology=1x1x8",
                   "--gin_file=configs/llama8b_512k.gin")
  assert status == 0 and r["fits"] and r["host_bytes"] == 0
  # float32 parameters and Adam moments of 8.0 B parameters (12 bytes each) over 8 GPUs.
  assert 10.5 * GIB < r["device_breakdown"]["arguments"] < 12 * GIB
  assert r["device_bytes"] < 0.6 * r["device_capacity_bytes"]
  # 32 layers, 32 query / 8 KV heads of 128, one row of 524,288 tokens over seq=8; forward,
  # rematerialised forward and backward.
  per_layer_pass = (2 * 32 + 2 * 8) * 128 * 524288 // 8 * 2
  assert r["collective_bytes"]["all-to-all"] == 32 * 3 * per_layer_pass


@pytest.mark.slow
def test_cli_llama8b_512k_on_one_gpu_counts_host_state_and_explains_xlas_remat_warning(
    tmp_path, capfd, caplog, monkeypatch):
  """The shipped config compiled as its header says (test_every_shipped_gpu_config_fits... leaves
  it to this test: one compile): its state and activations on the host are counted there. XLA's
  estimate adds host and device memory (45 + 104 GiB here, on an 80 GiB GPU): it warns "Can't
  reduce memory use below ..." for a step that fits; the user reads our line instead."""
  from ulysses_jax import xla_log
  monkeypatch.setattr(xla_log, "_explained", set())
  with caplog.at_level(logging.WARNING, logger="ulysses_jax"):
    status, r = _cli(tmp_path, "--gpu=h100", "--topology=1x1x1",
                     "--gin_file=configs/llama8b_1gpu_512k.gin")
  _assert_fits_the_cluster(status, r, "h100", "configs/llama8b_1gpu_512k.gin")
  # On the host: bfloat16 Adam moments of all 8.0 B parameters (29.9 GiB) and the 32 layers'
  # bfloat16 parameters (13.0 GiB); the layer inputs of every group of 4 layers (48 GiB).
  assert 42 * GIB < r["host_breakdown"]["offloaded_state"] < 44 * GIB
  assert r["host_breakdown"]["temporaries"] > 40 * GIB
  # On the device: the embedding and head (2 x 128,256 x 4,096 bfloat16, 1.96 GiB) + batch.
  assert r["device_breakdown"]["arguments"] < 2.1 * GIB
  assert r["device_bytes"] + r["host_bytes"] > 80 * GIB
  err = capfd.readouterr().err
  assert "Can't reduce memory use" not in err and "exceeds the base limit" not in err
  explained = [x.getMessage() for x in caplog.records if x.name == "ulysses_jax.xla_log"]
  assert any("adds host-offloaded buffers" in e for e in explained), explained


def test_the_schedulers_base_limit_line_counts_host_state_and_is_explained(capfd, caplog,
                                                                            monkeypatch):
  """jax 0.10.2's GPU scheduler adds a program's pinned-host inputs and outputs to its device
  ones and logs "The byte size of input/output arguments (N) exceeds the base limit (M)" when
  they pass 80 % of the GPU. A step donating 100 GiB of host state logs it (N = 100 GiB), one
  with 1 GiB does not, and both compile to the same device temporaries; the user reads our line
  instead. (XLA versions that count only device memory log nothing, and nothing is explained.)"""
  from ulysses_jax import xla_log
  monkeypatch.setattr(xla_log, "_explained", set())
  mesh = make_mesh(data=1, seq=1, devices=aot.gpu_devices("h100", "1x1x1"))
  host = NamedSharding(mesh, P(), memory_kind="pinned_host")
  device = NamedSharding(mesh, P(), memory_kind="device")
  x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32, sharding=device)

  def step(state, x):
    a, b, c = jnp.sin(x), jnp.cos(x), jnp.exp(x)
    return state, ((a @ b) @ c + a) @ (b + c) + a + b + c
  temps = {}
  with caplog.at_level(logging.WARNING, logger="ulysses_jax"):
    for gib in (1, 100):
      state = jax.ShapeDtypeStruct((gib, 2**28), jnp.float32, sharding=host)
      with xla_log.xla_warnings_explained():
        compiled = jax.jit(step, donate_argnums=0, out_shardings=(host, device)).lower(
            state, x).compile()
      temps[gib] = compiled.memory_analysis().temp_size_in_bytes
  assert temps[1] == temps[100]
  assert "exceeds the base limit" not in capfd.readouterr().err
  explained = [r.getMessage() for r in caplog.records if r.name == "ulysses_jax.xla_log"
               and r.getMessage().startswith("XLA's GPU scheduler")]
  assert len(explained) <= 1
  for message in explained:
    assert message.startswith("XLA's GPU scheduler logged that the step's inputs and outputs "
                              "(100.1 GiB) exceed its base limit (63.3 GiB). It counts those "
                              "kept in host memory"), message


@pytest.mark.slow
def test_cli_says_what_does_not_fit(tmp_path):
  status, r = _cli(tmp_path, "--gpu=h100", "--topology=1x1x1",
                   "--gin_file=configs/llama1b_128k.gin", "--gin_param=TrainConfig.mesh_seq=1",
                   "--gin_param=LlamaConfig.num_layers=2", "--gin_param=DataConfig.seq_len=8388608",
                   "--gin_param=DataConfig.batch_size=4")
  assert status == 1 and not r["fits"]
  assert r["shortfall_bytes"] == r["device_bytes"] - r["budget_bytes"] > 0
  assert r["budget_bytes"] == aot.GPUS["h100"].budget_bytes  # the budget the planner reads


# An 8B train step at 4M tokens compiles in about 30 s with jax 0.12.0.1 on 2 cores.
@pytest.mark.slow
def test_the_planners_answer_to_the_readmes_question_compiles_and_fits(tmp_path, capsys):
  """Llama-3.1-8B, 4,194,304 tokens, 8 x 80 GB, no knob given: what the planner prints for
  the trainer, compiled for one node of H100s, fits the GPU and the host figure given."""
  from ulysses_jax.cli import plan as plan_cli
  plan_cli.run(["--model=llama3.1-8b", "--seq-len=4194304", "--devices=8", "--gpu-mem=80",
                 "--host-mem-per-gpu=250"])
  params = re.findall(r"--gin_param='([^']*)'", capsys.readouterr().out)
  status, r = _cli(tmp_path, "--gpu=h100", "--topology=1x1x8",
                   "--gin_file=configs/models/llama3.1_8b.gin", "--gin_file=configs/runs/gpu.gin",
                   *[f"--gin_param={p}" for p in params])
  assert status == 0 and r["fits"] and r["device_bytes"] <= 80e9, r["device_bytes"] / GIB
  assert r["host_bytes"] <= 250e9 and r["tokens_per_step"] == 4194304


def test_offloaded_state_compiles_as_host_arguments_copied_in_the_program():
  """Compile-only devices drop a concrete sharding's memory kind; ``sharding.on_host`` keeps
  it, so the program has the host arguments and host-device copies a real GPU would run."""
  mesh = make_mesh(seq=8, devices=aot.gpu_devices("h100", "1x1x8"))
  device = NamedSharding(mesh, P(None, "seq"))
  [host] = jax.tree.leaves(sharding.on_host([device]))
  assert host.memory_kind == "pinned_host"
  w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=host)
  x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=device)
  to_device = jax.tree.leaves(sharding.on_device([device]))[0]
  step = lambda w, x: jax.device_put(jax.device_put(w, to_device) * x, host)
  compiled = jax.jit(step, in_shardings=(host, device), out_shardings=host).lower(w, x).compile()
  stats = compiled.memory_analysis()
  shard_bytes = 1024 * 128 * 4
  assert stats.host_argument_size_in_bytes == stats.host_output_size_in_bytes == shard_bytes
  assert stats.argument_size_in_bytes == shard_bytes  # x only: w is on the host


# Shipped configs another test compiles with their header's command and checks as below
# (llama8b_1gpu_1m.gin: the longest-sequence search compiles it, fitting its budget).
_COMPILED_ELSEWHERE = {"configs/llama8b_1gpu_512k.gin", "configs/llama8b_1gpu_1m.gin"}


def _shipped_gpu_configs():
  """(config, gpu, topology) of every config whose header gives its aot command and that needs
  no checkpoint (``init_from``: the fine-tuning configs have tests of their own)."""
  found = []
  for path in sorted(set(glob.glob("configs/*.gin")) - _COMPILED_ELSEWHERE):
    text = open(path, encoding="utf-8").read()
    header = "".join(line for line in text.splitlines(True) if line.startswith("#"))
    command = re.search(r"ulysses_jax\.aot --gpu=(\w+) \\?\s*#?\s*--topology=(\S+)", header)
    if command and "%gin.REQUIRED" not in text:
      found.append(pytest.param(path, *command.groups(), id=os.path.basename(path)))
  return found


@pytest.mark.slow
@pytest.mark.parametrize("config,gpu,topology", _shipped_gpu_configs())
def test_every_shipped_gpu_config_fits_the_cluster_its_header_names(tmp_path, config, gpu,
                                                                     topology):
  status, r = _cli(tmp_path, f"--gpu={gpu}", f"--topology={topology}", f"--gin_file={config}")
  _assert_fits_the_cluster(status, r, gpu, config)


def _assert_fits_the_cluster(status, r, gpu, config):
  """``aot``'s report ``r`` (exit ``status``) of a shipped config compiled for ``gpu``s."""
  # Fits with the default runtime reserve left to CUDA, the libraries and NCCL.
  assert status == 0 and r["fits"]
  assert r["device_bytes"] + r["reserve_bytes"] <= r["device_capacity_bytes"]
  assert r["reserve_bytes"] == aot.GPUS[gpu].runtime_reserve_bytes >= 6 * GIB
  # Host memory per GPU within a DGX H100's 2 TB for 8 GPUs, the offloaded state included.
  assert r["host_bytes"] <= 256e9
  if "TrainConfig.offload_optimizer = True" in open(config, encoding="utf-8").read():
    assert r["host_breakdown"]["offloaded_state"] > 0


@pytest.mark.slow
def test_sliding_window_finetune_config_fits_and_runs_windowed_mosaic_kernels(tmp_path):
  """configs/finetune_mistral7b_8gpu_8m.gin on one 8-H100 node, the model from Mistral-7B-v0.1's
  config.json (a 4,096-token window on every layer): it fits the budget, every attention call
  is a windowed Mosaic kernel ("auto" on Hopper), and the step's compiled FLOPs are a fraction
  of what full causal attention over 8M tokens would take."""
  from ulysses_jax import metrics
  from ulysses_jax.hf import weights as hf
  from ulysses_jax.models.config import preset
  checkpoint = tmp_path / "mistral7b"
  checkpoint.mkdir()
  config = preset("mistral-7b-v0.1")
  (checkpoint / "config.json").write_text(json.dumps(hf.config_to_hf(config)))
  status, r = _cli(tmp_path, "--gpu=h100", "--topology=1x1x8",
                   "--gin_file=configs/finetune_mistral7b_8gpu_8m.gin",
                   f"--gin_param=TrainConfig.init_from='{checkpoint}'")
  assert status == 0 and r["fits"]
  assert r["kernels"]["mosaic"] >= 3 and not r["kernels"]["triton"]
  seq_len = 8 * 2**20
  full = metrics.flops_per_token(config.replace(sliding_window=None), seq_len) * seq_len / 8
  assert r["flops"] < full / 5


@pytest.mark.slow
def test_attention_head_chunks_cut_the_compiled_memory(tmp_path):
  """Llama-3.1-8B at 8,388,608 tokens on one 8-GPU node: attention in 4 chunks of heads keeps
  a quarter of q, k, v and the output of a layer at a time (each [8M, 1, 128] per GPU per
  chunk after the all-to-all). Compiled 2026-11-24: 70.86 -> 63.14 GiB per GPU; the chunks'
  KV heads are replicated over the 8 GPUs, so more all-to-all bytes."""
  runs = {}
  for chunks in (1, 4):  # no runtime reserve: unchunked, the step needs more than the budget
    status, runs[chunks] = _cli(tmp_path, "--gpu=h100", "--topology=1x1x8", "--reserve_gib=0",
                                "--gin_file=configs/llama8b_8gpu_8m.gin",
                                f"--gin_param=LlamaConfig.attn_head_chunks={chunks}")
    assert status == 0
  plain, chunked = (runs[n]["device_breakdown"]["temporaries"] for n in (1, 4))
  assert chunked < plain - 6 * GIB
  assert (runs[4]["collective_bytes"]["all-to-all"] > runs[1]["collective_bytes"]["all-to-all"])
  assert runs[4]["host_bytes"] == runs[1]["host_bytes"]


@pytest.mark.slow
def test_longest_sequence_search_on_one_gpu(tmp_path):
  """``benchmarks.max_seqlen --gpu``: Llama-3.1-8B on one H100 in llama8b_1gpu_1m's layout, to
  524,288 tokens: 2 compiles, the config's 1,048,576 (fits) and 1,572,864 (does not on jax
  0.10.2, 0.11.2 or 0.12.0.1; 1,310,720 fits with 0.10.2, not with 0.11.2). The search's
  bisection is tested on the CPU (test_benchmarks)."""
  from benchmarks import max_seqlen
  [row] = max_seqlen.main(["--gpu=h100", "--case=1x1x1:configs/llama8b_1gpu_1m.gin",
                           "--granularity=524288", "--max-len=1572864",
                           f"--json={tmp_path / 'rows.json'}"])
  assert row["max_tokens"] == 1048576 and row["first_failure"] == 1572864
  # the config's own length fits its budget (the shipped configs' check, for this one)
  assert row["device_gib"] <= row["budget_gib"] and row["host_gib_per_gpu"] * GIB <= 256e9
  assert row["vs_alst"] == row["max_tokens"] / 500_000
  assert json.loads((tmp_path / "rows.json").read_text())["rows"][0] == row
