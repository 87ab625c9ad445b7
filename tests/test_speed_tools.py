"""The speed measurements' tooling on the CPU (issue 47 items 2, 4-6, issue 49 item 2): MFU
against both peaks, the step profile's classes, the OOM rows of the transformers comparison,
the gin settings the GPU stage reads, the Mosaic tile sweep's winners, and the GPU session's
speed, sweep and generate stages on tiny shapes."""

import json
import os
import pathlib
import subprocess
import sys
import types

import jax
import pytest

from benchmarks import attention_kernels, common, profile_step, train_step
from ulysses_jax import metrics
from ulysses_jax.kernels.flash_kernels import Tile

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("platform, kind, peak", [
    ("gpu", "NVIDIA H100 80GB HBM3", 989.4e12), ("gpu", "NVIDIA H200", 989.4e12),  # real names
    ("gpu", "NVIDIA H200 141GB HBM3e", 989.4e12), ("gpu", "NVIDIA H100 PCIe", 756.5e12),
    ("gpu", "NVIDIA Z999", None), ("cpu", "cpu", None)])
def test_a_device_finds_its_datasheet_peak(platform, kind, peak):
  """The datasheet's peak of a GPU the table knows by name; none for a GPU it does not (its
  nearest row may be another chip) or a CPU."""
  device = types.SimpleNamespace(platform=platform, device_kind=kind)
  found = metrics.datasheet_peak_flops(device)
  assert found == (peak and pytest.approx(peak))


def test_mfu_is_stated_against_both_peaks_and_names_them():
  assert metrics.mfu_text(0.36, 0.293) == ("MFU 36.0% of the measured matmul peak, 29.3% of "
                                           "the datasheet's dense bf16 peak")
  assert metrics.mfu_text(0.36, None).endswith("datasheet peak unknown for this device")
  assert metrics.datasheet_peak_flops(jax.devices()[0]) is None  # a CPU
  record = metrics.make_record(1, {"loss": 1.0, "grad_norm": 1.0, "learning_rate": 0.1}, 0,
                               tokens=1000, seconds=1.0, steps=1, flops_per_token=1e9,
                               peak_flops=4e12, datasheet_flops=5e12)
  assert record["mfu"] == pytest.approx(0.25) and record["mfu_datasheet"] == pytest.approx(0.2)


def test_run_settings_read_without_gin_equal_what_gin_binds():
  from ulysses_jax.cli import gin_config
  path = str(REPO / "configs" / "runs" / "gpu.gin")
  read = common.gin_bindings(path, "LlamaConfig")
  gin_config.parse([path], [])
  try:
    assert read and read == gin_config.bound_fields(gin_config.LlamaConfig)
  finally:
    gin_config.gin.clear_config()
  assert set(read) <= set(train_step.RUN_SETTINGS)  # every binding has a flag to land on


HLO = """HloModule jit_step
%fused_dot (param_0: bf16[64,64], param_1: bf16[64,64]) -> bf16[64,64] {
  %param_0 = bf16[64,64]{1,0} parameter(0)
  %param_1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,64]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}
}
ENTRY %main (p: bf16[64,64], h: f32[64,64]) -> bf16[64,64] {
  %p = bf16[64,64]{1,0} parameter(0)
  %h = f32[64,64]{1,0} parameter(1)
  %fusion.1 = bf16[64,64]{1,0} fusion(%p, %p), kind=kCustom, calls=%fused_dot
  %custom-call.2 = (f32[64,64]{1,0}, s8[0]{0}) custom-call(%h, %h), custom_call_target="__cublas$gemm"
  %custom-call.3 = bf16[64,64]{1,0} custom-call(%p), custom_call_target="mosaic_gpu", metadata={op_name="jit(step)/transpose(jvp(flash_attention_dkv_causal))/pallas_call"}
  %all-to-all.4 = bf16[64,64]{1,0} all-to-all(%p), dimensions={0}
  ROOT %add.5 = bf16[64,64]{1,0} add(%p, %p)
}
"""  # noqa: E501  (HLO's lines as XLA writes them)


@pytest.mark.parametrize("name, hlo_op, expected", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", None, "bf16 GEMMs"),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x128x32", None, "float32 GEMMs"),
    ("nvjet_tst_192x192_64x3_2x1_v_bz_coopA_NNT", "fusion.1", "bf16 GEMMs"),
    ("nvjet_tst_192x192_64x3_2x1_v_bz_coopA_NNT", "custom-call.2", "float32 GEMMs"),
    ("_forward_kernel", None, "attention forward"), ("_dq_kernel", None, "attention backward"),
    ("mosaic_gpu_kernel", "custom-call.3", "attention backward"),
    ("flash_attention_forward_causal", None, "attention forward"),
    ("flash_attention_dkv_dq_mosaic_gpu_kernel", None, "attention backward"),
    ("decode_attention_mosaic_gpu_kernel", None, "attention forward"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma", None, "attention backward"),
    ("ncclDevKernel_AllToAll_RING_LL", None, "collectives"),
    ("all-to-all.4", "all-to-all.4", "collectives"),
    ("MemcpyH2D", None, "host transfers"), ("loop_add_fusion", "add.5", "other fusions")])
def test_each_kernel_gets_its_class(name, hlo_op, expected):
  ops = profile_step.hlo_ops(HLO)
  assert profile_step.classify(name, ops.get(hlo_op)) == expected


def test_overlapping_gpu_kernels_share_their_overlap_and_the_classes_add_up():
  def meta(pid, tid, name, kind="thread_name"):
    return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}}
  trace = {"traceEvents": [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
      meta(1, 7, "Stream #7(Compute)"), meta(1, 13, "Stream #13(Nccl)"), meta(1, 99, "XLA Ops"),
      {"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 10, "name": "sm90_xmma_gemm_bf16bf16"},
      {"ph": "X", "pid": 1, "tid": 13, "ts": 5, "dur": 10, "name": "ncclDevKernel_AllGather"},
      {"ph": "X", "pid": 1, "tid": 7, "ts": 20, "dur": 5, "name": "_forward_kernel"},
      {"ph": "X", "pid": 1, "tid": 99, "ts": 0, "dur": 25, "name": "fusion.1"},  # a view
      {"ph": "X", "pid": 2, "tid": 3, "ts": 0, "dur": 30, "name": "host work"}]}
  events, mode = profile_step.device_events(trace)
  assert len(events) == 3 and mode.startswith("gpu")
  result = profile_step.breakdown(events, {})
  assert result["ms"]["bf16 GEMMs"] == pytest.approx(7.5e-3)  # 5 alone + half of 5 shared
  assert result["ms"]["collectives"] == pytest.approx(7.5e-3)
  assert result["ms"]["attention forward"] == pytest.approx(5e-3)
  assert result["busy_ms"] == pytest.approx(20e-3) and result["idle_ms"] == pytest.approx(5e-3)
  assert result["span_ms"] == pytest.approx(25e-3)


def test_kernels_named_only_on_the_stream_take_the_hlo_op_of_the_xla_ops_line():
  """jax 0.11.2's GPU trace: stream events carry the kernel's name alone; the "XLA Ops" line
  event spanning a kernel's start names its HLO op, which gives the class (a Mosaic kernel's
  generic name, a cuBLAS kernel's dtype); a kernel outside every op stays unclassed."""
  def meta(tid, name):
    return {"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": name}}
  trace = {"traceEvents": [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      meta(7, "Stream #7(Compute)"), meta(99, "XLA Ops"),
      {"ph": "X", "pid": 1, "tid": 99, "ts": 0, "dur": 12, "name": "fusion.1"},
      {"ph": "X", "pid": 1, "tid": 99, "ts": 12, "dur": 20, "name": "custom-call.3"},
      {"ph": "X", "pid": 1, "tid": 7, "ts": 1, "dur": 10, "name": "nvjet_tst_192x192_64x3"},
      {"ph": "X", "pid": 1, "tid": 7, "ts": 13, "dur": 15, "name": "main_kernel"},
      {"ph": "X", "pid": 1, "tid": 7, "ts": 40, "dur": 2, "name": "loop_fusion"}]}
  events, _ = profile_step.device_events(trace)
  result = profile_step.breakdown(events, profile_step.hlo_ops(HLO))
  assert result["ms"]["bf16 GEMMs"] == pytest.approx(10e-3)
  assert result["ms"]["attention backward"] == pytest.approx(15e-3)
  assert result["ms"]["other fusions"] == pytest.approx(2e-3)
  assert [(k["kernel"], k["hlo_op"], k["class"], k["launches"]) for k in
          result["top_kernels"]] == [("main_kernel", "custom-call.3", "attention backward", 1),
                                     ("nvjet_tst_192x192_64x3", "fusion.1", "bf16 GEMMs", 1),
                                     ("loop_fusion", "", "other fusions", 1)]


def test_profile_of_a_tiny_step_adds_up_to_the_device_time(tmp_path):
  parser = profile_step.argparse.ArgumentParser()
  train_step.add_step_arguments(parser)
  args = train_step.parse_step_arguments(parser, ["--preset", "tiny", "--seq-len", "64"])
  result = profile_step.profile(train_step.build_step(args), str(tmp_path))
  assert result["mode"].startswith("cpu: classes by op name") and result["events"] > 0
  assert all(ms >= 0 for ms in result["ms"].values()) and result["idle_ms"] >= -1e-9
  assert sum(result["ms"].values()) == pytest.approx(result["busy_ms"], rel=1e-9)
  assert result["busy_ms"] + result["idle_ms"] == pytest.approx(result["span_ms"])
  assert result["ms"]["float32 GEMMs"] > 0 and result["ms"]["collectives"] > 0  # 8 devices
  rows = profile_step.rows_of(result)
  assert [r["class"] for r in rows][:len(profile_step.CLASSES)] == list(profile_step.CLASSES)


def test_profile_of_tiny_decode_steps_adds_up_per_step(tmp_path):
  from benchmarks import profile_decode
  result = profile_decode.main(["--preset", "tiny-gqa", "--prompt", "128", "--steps", "2",
                                "--json", str(tmp_path / "decode.json")])
  assert result["steps"] == 2 and result["events"] > 0
  assert sum(result["ms"].values()) == pytest.approx(result["busy_ms"], rel=1e-9)
  assert result["busy_ms"] + result["idle_ms"] == pytest.approx(result["span_ms"])
  rows = {r["class"]: r for r in json.loads((tmp_path / "decode.json").read_text())["rows"]}
  assert rows["busy (device)"]["ms_per_step"] == pytest.approx(result["busy_ms"] / 2)
  # The device's span lies inside the timed steps: busy + idle per step <= the wall per step.
  assert (rows["busy (device)"]["ms_per_step"] + rows["idle (device)"]["ms_per_step"]
          <= rows["wall (host)"]["ms_per_step"] * 1.001)
  assert rows["bf16 GEMMs"]["launches_per_step"] > 0


def test_transformers_generate_falls_back_to_the_dynamic_cache_where_static_runs_out(
    monkeypatch):
  torch = pytest.importorskip("torch")
  from benchmarks import generate_gpu
  tried = []

  def theirs(model, tokens, new_tokens, cache="static"):
    tried.append(cache)
    if cache == "static":
      raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
    return {"hf_ttft_s": 1.0, "hf_ms_per_token": 2.0, "hf_cache": cache}
  monkeypatch.setattr(generate_gpu, "theirs", theirs)
  result = generate_gpu.theirs_static_else_dynamic(None, None, 4)
  assert tried == ["static", "dynamic"]
  assert result == {"status": "ok", "hf_ttft_s": 1.0, "hf_ms_per_token": 2.0,
                    "hf_cache": "dynamic"}


def test_an_out_of_memory_side_is_a_row_not_the_end_of_the_run():
  torch = pytest.importorskip("torch")
  from benchmarks import vs_transformers

  def torch_oom():
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

  def xla_oom():
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes")

  for run in (torch_oom, xla_oom):
    assert vs_transformers.or_out_of_memory(run)["status"] == "OOM"
  with pytest.raises(ValueError):
    vs_transformers.or_out_of_memory(lambda: (_ for _ in ()).throw(ValueError("a bug")))
  row = vs_transformers.side_columns("torch", vs_transformers.or_out_of_memory(torch_oom), 8)
  assert row["torch_status"] == "OOM" and row["torch_step_s"] != row["torch_step_s"]  # NaN
  assert vs_transformers.step_text(row, "torch") == "OOM"


@pytest.mark.slow
def test_gpu_call_runs_stages_under_their_limits_and_packs_each(tmp_path):
  """``benchmarks/gpu_call.sh`` as a device call runs it (GPU_SESSION_DRY=1, tiny shapes): the
  profile-decode stage, then speed with a 1-second limit, which ends it (exit 124) and still
  packs what it wrote; each stage one archive, beside env.txt and calls.txt."""
  import tarfile
  env = {**os.environ, "GPU_SESSION_DRY": "1", "PYTHON": sys.executable, "OUT": str(tmp_path)}
  call = ["bash", "benchmarks/gpu_call.sh"]
  done = subprocess.run(call + ["profile-decode:250", "speed:1"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "calls.txt", "env.txt", "profile-decode.tgz", "speed.tgz"]
  calls = (tmp_path / "calls.txt").read_text().splitlines()
  assert [line.split(" in ")[0] for line in calls] == ["profile-decode exit 0", "speed exit 124"]
  assert "jax " in (tmp_path / "env.txt").read_text()
  with tarfile.open(tmp_path / "profile-decode.tgz") as packed:
    rows = json.load(packed.extractfile("profile-decode/profile_decode_128.json"))["rows"]
  assert rows[-1]["class"] == "wall (host)" and rows[-1]["ms_per_step"] > 0
  bad = subprocess.run(call + ["speed"], cwd=REPO, env=env, capture_output=True, text=True)
  assert bad.returncode == 2 and "'speed': expected STAGE:SECONDS" in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("stage, files", [
    ("speed", ["speed_kernels", "speed_train_step", "speed_profile_256",
               "speed_vs_transformers"]),
    ("generate", ["generate_gpu"]), ("generate-ours", ["generate_gpu"]),
    ("sweep-d128", ["sweep-d128"]), ("sweep-d64-dkv", ["sweep-d64-dkv"]), ("decode", [])])
def test_gpu_session_stage_runs_end_to_end_on_tiny_shapes(tmp_path, stage, files):
  """The stage's every command, as a GPU session runs it, on the CPU with tiny shapes
  (GPU_SESSION_DRY=1): a typo costs no GPU time. About 2 minutes each on 2 busy cores."""
  pytest.importorskip("transformers")
  env = {**os.environ, "GPU_SESSION_DRY": "1", "PYTHON": sys.executable}
  done = subprocess.run(["bash", "benchmarks/gpu_session.sh", stage, str(tmp_path)], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  for name in files:
    written = json.loads((tmp_path / f"{name}.json").read_text())
    assert written["rows"] and written["environment"]["platform"] == "cpu", name
  if stage.startswith("sweep"):  # on the CPU every Mosaic row is skipped, with the reason
    written = json.loads((tmp_path / f"{stage}.json").read_text())
    assert any(r["impl"].startswith("mosaic_dkv[") and "Hopper GPU" in r["status"]
               for r in written["rows"])
    if stage == "sweep-d64-dkv":  # the dk/dv tiles only, beside the table's kernels
      assert {r["impl"].split("[")[0] for r in written["rows"]} == {"ours_mosaic", "mosaic_dkv"}
    # the table as the sweep left it comes back with the stage (no row ran: unchanged)
    assert (tmp_path / "mosaic_tiles.py").read_text() == (
        REPO / "ulysses_jax" / "kernels" / "mosaic_tiles.py").read_text()
  elif stage == "decode":  # the doctor's decode rows alone: on the CPU the one saying why not
    report = json.loads((tmp_path / "decode.json").read_text())
    assert [c["name"] for c in report["checks"]] == ["decode kernel vs XLA"]
  elif stage == "speed":
    step, = json.loads((tmp_path / "speed_train_step.json").read_text())["rows"]
    assert step["MFU"] > 0 and step["dtype"] == "bfloat16" and step["mlp_chunk"] == 8192
    assert step["MFU_datasheet"] is None  # no datasheet figure for a CPU
    profile = json.loads((tmp_path / "speed_profile_256.json").read_text())
    assert sum(r["ms"] for r in profile["rows"][:len(profile_step.CLASSES)]) == pytest.approx(
        profile["busy_ms"])
  elif stage == "generate-ours":  # ours alone, batch 1 (the tiny shapes add batch 2)
    rows = json.loads((tmp_path / "generate_gpu.json").read_text())["rows"]
    assert rows and all(r["status"] == "ok" and r["ms_per_token"] > 0 for r in rows)
    assert {r["hf_status"] for r in rows} == {"not run"}
  else:
    written = json.loads((tmp_path / "generate_gpu.json").read_text())
    prompts = [r for r in written["rows"] if "longest" not in r]
    assert all(r["status"] == "ok" and r["hf_status"] == "ok" for r in prompts)
    longest, = [r for r in written["rows"] if "longest" in r]  # decode only, a 20 MB budget
    assert longest["status"] == "ok" and longest["prompt"] > 128 and longest["ttft_s"] is None
    assert longest["weights_GB"] + longest["kv_read_GB"] <= 0.9 * 0.02
    assert all(r["ms_per_token"] > 0 and r["ms_per_token_blocking"] > 0 and
               r["floor_ms_per_token"] > 0 and r["compute_floor_s"] > 0 for r in written["rows"])
    assert written["agreement"][0]["identical"] == 1.0  # float32, greedy: the same tokens


def test_the_sweep_prints_each_kernels_fastest_tile_as_a_table_row(capsys):
  """From timed rows (here written out, as a GPU run would give them): the forward's fastest
  forward time, dq's and dk/dv's fastest forward+backward time, each beside the table's tile's;
  a kernel none of whose tiles ran keeps the table's; failed rows do not count."""
  candidates = attention_kernels.mosaic_tiles.candidates(64)
  name = attention_kernels.mosaic_name
  table_forward, table_dq, table_dkv = attention_kernels.mosaic_tiles.TABLE[("sm90", 64, True)]
  faster_forward, faster_dq = (next(t for t in candidates[kernel] if t != table and
                                    t.num_warps == 16 and t.num_stages == 3)
                               for kernel, table in (("forward", table_forward),
                                                     ("dq", table_dq)))
  failed = next(t for t in candidates["forward"] if t not in (table_forward, faster_forward))
  names = [name(kernel, t) for kernel, tiles in candidates.items() for t in tiles]
  assert len(set(names)) == len(names) and "mosaic_forward[128x64-12w-2st-overlap]" in names
  row = lambda impl, **times: dict(impl=impl, S=16384, D=64, causal=True, status="ok", **times)
  rows = [row(name("forward", table_forward), fwd_ms=3.0, fwd_bwd_ms=10.0),
          row(name("forward", faster_forward), fwd_ms=2.5, fwd_bwd_ms=9.6),
          {**row(name("forward", failed), fwd_ms=1.0), "status": "FAILED check: out error 1e-1"},
          row(name("dq", table_dq), fwd_ms=3.0, fwd_bwd_ms=10.0),
          row(name("dq", faster_dq), fwd_ms=3.0, fwd_bwd_ms=9.0),
          row("cudnn", fwd_ms=0.1, fwd_bwd_ms=0.1)]
  table = attention_kernels.print_mosaic_table(rows, [64])
  sources = [attention_kernels.tile_source(t) for t in (faster_forward, faster_dq, table_dkv)]
  assert table == {"sm90,64,True,S=16384": sources}
  printed = capsys.readouterr().out
  assert (f'("sm90", 64, True): ({", ".join(sources)}),  # S=16384: forward 2.500 ms '
          "(table's 3.000); dq 9.000 ms (table's 10.000)") in printed


def test_a_sweep_cut_short_keeps_a_table_tile_that_ours_mosaic_timed_faster():
  """The ``ours_mosaic`` row times the table's tiles: a dk/dv candidate slower than it does not
  replace the table's tile though the tile's own row never ran; a faster one does. And the
  rows run in the order ``--impls`` names them (``select``)."""
  table_forward, table_dq, table_dkv = attention_kernels.mosaic_tiles.TABLE[("sm90", 64, True)]
  candidate = next(t for t in attention_kernels.mosaic_tiles.candidates(64)["dkv"]
                   if t != table_dkv)
  row = lambda impl, ms: dict(impl=impl, S=16384, D=64, causal=True, status="ok", fwd_ms=3.0,
                              fwd_bwd_ms=ms)
  name = attention_kernels.mosaic_name("dkv", candidate)
  key = "sm90,64,True,S=16384"
  table = attention_kernels.mosaic_table([row("ours_mosaic", 10.0), row(name, 10.5)], [64])
  assert table[key][0][2] == attention_kernels.tile_source(table_dkv)
  assert table[key][1] == "S=16384: dkv 10.000 ms (table's 10.000)"
  table = attention_kernels.mosaic_table([row("ours_mosaic", 10.0), row(name, 9.5)], [64])
  assert table[key][0] == [attention_kernels.tile_source(t)
                           for t in (table_forward, table_dq, candidate)]
  names = ["ours_mosaic", "mosaic_dkv[64x128-12w-2st]",
           "mosaic_dkv[64x128-12w-2st-accumulate_dq]", "cudnn"]
  assert attention_kernels.select(names, ["ours_mosaic", "mosaic_dkv*accumulate_dq]",
                                          "mosaic_dkv*"]) == names[:1] + names[2:0:-1]
  assert attention_kernels.select(names, ["mosaic_dkv[64x128-12w-2st]"]) == [names[1]]


def test_the_sweeps_table_rows_replace_the_tables_own_in_its_source(tmp_path):
  """``--write-table``: the swept rows replace theirs in a copy of mosaic_tiles.py (a row too
  long for one line wraps), the longest length's where a row was swept at two; the other rows
  and the rest of the module stay as they were, and the module still imports."""
  import importlib.util
  import shutil
  path = tmp_path / "mosaic_tiles.py"
  shutil.copy(attention_kernels.mosaic_tiles.__file__, path)
  long_row = ["Tile(192, 128, 16, 2, overlap=True)", "Tile(192, 64, 16, 3, pingpong=True)",
              "Tile(64, 128, 12, 2)"]
  attention_kernels.write_mosaic_table({
      "sm90,64,True,S=65536": long_row,
      "sm90,64,True,S=16384": ["Tile(64, 64, 12, 2)"] * 3,
      "sm90,128,False,S=16384": ["Tile(128, 64, 12, 2)", "Tile(64, 64, 12, 2)",
                                 "Tile(64, 64, 12, 2)"]}, path)
  spec = importlib.util.spec_from_file_location("swept_tiles", path)
  swept = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(swept)
  before = attention_kernels.mosaic_tiles.TABLE
  assert swept.TABLE[("sm90", 64, True)] == (Tile(192, 128, 16, 2, overlap=True),
                                             Tile(192, 64, 16, 3, pingpong=True),
                                             Tile(64, 128, 12, 2))
  assert swept.TABLE[("sm90", 128, False)] == (Tile(128, 64, 12, 2), Tile(64, 64, 12, 2),
                                               Tile(64, 64, 12, 2))
  assert {k: v for k, v in swept.TABLE.items() if k[1:] not in ((64, True), (128, False))} == {
      k: v for k, v in before.items() if k[1:] not in ((64, True), (128, False))}
  assert max(map(len, path.read_text().splitlines())) <= 100
  assert swept.candidates(64) == attention_kernels.mosaic_tiles.candidates(64)
  with pytest.raises(ValueError, match=r'no TABLE row \("sm100", 64, True\): to replace'):
    attention_kernels.write_mosaic_table({"sm100,64,True,S=16384": long_row}, path)


def test_the_longest_prompt_fits_its_share_of_the_memory_in_whole_steps():
  """Llama-3.1-8B on an H200's 139 GiB allocator limit: the weights (16 GB) and 131,072 bytes
  of cache per token within 90 %, in steps of 65,536 tokens; nothing where the weights alone
  do not fit."""
  from benchmarks import generate_gpu
  from ulysses_jax.models import llama
  config = llama.preset("llama3.1-8b", dtype="bfloat16", param_dtype="bfloat16")
  limit = 139 * 2**30
  prompt = generate_gpu.longest_prompt(config, limit)
  assert generate_gpu.decode_bytes(config, 1, 1)["kv"] == 131072
  weights = 2 * llama.count_params(config)
  assert prompt % 65536 == 0 and 0.9 * limit - 65536 * 131072 < weights + prompt * 131072
  assert weights + prompt * 131072 <= 0.9 * limit and prompt == 851968
  assert generate_gpu.longest_prompt(config, weights) == 0
