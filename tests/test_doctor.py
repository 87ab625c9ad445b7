"""python -m ulysses_jax.doctor on the CPU: what CI can check of the GPU-first command."""

import functools
import json
import time

import jax
import jax.numpy as jnp
import pytest

from ulysses_jax.attention import ring
from ulysses_jax.cli import doctor as doctor_cli
from ulysses_jax.doctor import kernels as kernels_lib
from ulysses_jax.doctor import timing
from ulysses_jax.kernel_check import cases


@pytest.mark.slow  # `make doctor` runs the same command in CI
def test_doctor_on_cpu_runs_the_xla_kernel_and_the_step_and_says_what_needs_a_gpu(
    tmp_path, capsys):
  path = tmp_path / "runs" / "doctor.json"  # a folder not made yet, as in a fresh clone
  assert doctor_cli.main(["--json", str(path), "--seq-lens", "256"]) == 0
  report = json.loads(path.read_text())
  out = capsys.readouterr().out
  rows = {(r["kernel"], r["causal"]): r for r in report["kernels"]}
  assert set(rows) == {(k, c) for k in ("ours mosaic", "ours triton", "cudnn", "xla chunked")
                       for c in (True, False)}
  for causal in (True, False):
    xla = rows["xla chunked", causal]
    assert xla["passed"] is True and xla["err_out"] < kernels_lib.TOLERANCE
    assert xla["fwd_tflops"] > 0
    for gpu_only in ("ours mosaic", "ours triton", "cudnn"):
      assert rows[gpu_only, causal]["passed"] is None
      assert rows[gpu_only, causal]["status"] == "needs a GPU"
  step = report["step"]
  assert step["mesh"] == {"data": 1, "seq": 8} and step["seq_len"] == 256 * 8
  assert jnp.isfinite(step["loss"]) and step["step_s"] > 0 and step["compiled_memory_gib"] > 0
  assert 0 < step["mfu"] and step["mfu_datasheet"] is None  # no datasheet figure for a CPU
  assert "matmul peak, datasheet peak unknown for this device" in out
  needs_gpu = [c for c in report["checks"] if c["passed"] is None and "kernel" not in c["name"]]
  assert {c["name"] for c in needs_gpu} == {"peak memory within the compiled figure",
                                           "step time at or above the roofline"}
  assert all(c["detail"].startswith("needs a GPU") for c in needs_gpu)
  assert report["passed"] is True
  assert "every check that can run here passed" in out
  assert report["environment"]["jax"] and report["environment"]["platform"] == "cpu"
  assert report["auto_backend"]["backend"] == "xla"
  assert "attention_backend='auto' picks xla" in out


def test_doctor_exits_1_naming_a_kernel_that_disagrees_with_the_reference(monkeypatch, capsys):
  real = kernels_lib.backend_fn

  def perturbed(backend, causal, head_dim):
    fn = real(backend, causal, head_dim)
    return lambda q, k, v: fn(q, k, v) * 1.1  # a 10 % error: far over the bf16 tolerance
  monkeypatch.setattr(kernels_lib, "backend_fn", perturbed)
  assert doctor_cli.main(["--seq-lens", "128", "--no-step"]) == 1
  out = capsys.readouterr().out
  assert "kernel xla chunked S=128 causal=True: FAILED check: out error 1.0" in out
  # each row is printed as it is done, before the report (a GPU's rows take minutes)
  assert 0 <= out.index("kernel kernel=xla chunked S=128 causal=True") < out.index("devices:")
  assert out.rstrip().splitlines()[-1].startswith("FAILED: kernel xla chunked S=128")


def test_our_kernels_programs_compile_ahead_and_their_rows_check_and_time_as_inline(
    monkeypatch):
  """Per length the doctor compiles our kernels' programs first, in threads (both masks, both
  phases), then checks and times every row; cuDNN's and XLA's rows compile in their rows. Our
  kernels need a GPU: here they stand in as XLA's backend."""
  import ulysses_jax.doctor as doctor
  monkeypatch.setattr(doctor, "KERNELS", {"ours mosaic": "xla", "ours triton": "xla",
                                          "cudnn": "cudnn", "xla chunked": "xla"})
  compiled = []
  real = kernels_lib.compile_ahead

  def recorded(fns, arrays, threads, phases=None):
    programs = real(fns, arrays, threads, phases)
    compiled.append({case: sorted(p) for case, p in programs.items()})
    return programs
  monkeypatch.setattr(kernels_lib, "compile_ahead", recorded)
  rows = doctor.kernel_rows(jax.devices()[0], [128], warmup=0, iters=1)
  both = ["backward", "forward"]
  assert compiled == [{(name, causal): both for causal in (True, False)
                       for name in ("ours mosaic", "ours triton")}]
  by_kernel = {(r["kernel"], r["causal"]): r for r in rows}
  for causal in (True, False):
    ours, xla = by_kernel["ours mosaic", causal], by_kernel["xla chunked", causal]
    assert ours["passed"] is True and {"fwd_tflops", "fwd_bwd_tflops"} <= set(ours)
    assert (ours["err_out"], ours["err_grad"]) == (xla["err_out"], xla["err_grad"])
    assert by_kernel["cudnn", causal]["status"] == "needs a GPU"


def test_doctor_runs_only_the_decode_rows_when_asked(tmp_path, capsys):
  """``--no_kernels --no_step`` (a GPU session's decode stage): the decode rows alone, each
  printed as it is done; on a CPU the one that says it needs a Hopper GPU."""
  path = tmp_path / "doctor.json"
  assert doctor_cli.main(["--no_kernels", "--no_step", "--json", str(path)]) == 0
  report = json.loads(path.read_text())
  assert report["kernels"] == [] and "step" not in report
  assert [c["name"] for c in report["checks"]] == ["decode kernel vs XLA"]
  out = capsys.readouterr().out
  assert "decode decode kernel vs XLA: needs a Hopper GPU (sm90)" in out
  assert "attention kernels:" not in out


@pytest.mark.parametrize("bad", ["", "0", "4k", "-512"])
def test_doctor_refuses_bad_lengths_before_any_work(bad, capsys):
  with pytest.raises(SystemExit) as exit_info:
    doctor_cli.main(["--seq-lens", bad])
  assert exit_info.value.code == 2
  assert "expected positive integers separated by commas" in capsys.readouterr().err


def test_doctor_refuses_a_json_path_it_cannot_write_before_any_work(tmp_path, capsys):
  (tmp_path / "file").write_text("")
  with pytest.raises(SystemExit) as exit_info:
    doctor_cli.main(["--json", str(tmp_path / "file" / "doctor.json")])
  assert exit_info.value.code == 2
  assert "cannot make the folder of" in capsys.readouterr().err


@pytest.mark.parametrize("flags,expected", [
    (["--mesh_seq", "2"], "--mesh_seq=2 shapes the ring check, which needs --mesh_ring > 1"),
    (["--mesh_ring", "3"], "--mesh_seq/--mesh_ring: seq=1 x ring=3 does not divide the 8 "
                           "available devices"),
])
def test_doctor_refuses_a_ring_mesh_it_cannot_build_before_any_work(flags, expected, capsys):
  assert doctor_cli.main(flags) == 2
  captured = capsys.readouterr()
  assert expected in captured.err and captured.out == ""


@pytest.mark.slow  # two XLA rings (full, windowed) and the kernel rows
def test_doctor_runs_the_ring_check_on_a_ring_mesh_and_names_a_failing_ring(monkeypatch, fault,
                                                                            capsys):
  """On a seq x ring mesh of the 8 CPU devices the doctor checks each backend a ring runs, for
  full attention and a window, as a run on that mesh would; the ring's merge made faulty (it
  drops the partial results' log-sum-exps), the XLA ring fails both and the doctor exits 1."""
  monkeypatch.setattr(cases, "RING_CHECK_LEN", 16)
  real = ring.merge
  fault(ring, "merge", lambda out, lse, part, part_lse: (
      out + part.astype(jnp.float32), real(out, lse, part, part_lse)[1]))
  assert doctor_cli.main(["--seq-lens", "128", "--no-step", "--mesh_seq", "2", "--mesh_ring",
                          "4"]) == 1
  out = capsys.readouterr().out
  assert "ring check on mesh {'data': 1, 'ring': 4, 'seq': 2}" in out
  assert "  ring: 0 ok, 2 FAILED, 4 cannot run here" in out
  for attention in ("full attention (checked on a ring of 4 x 16 tokens)",
                    "sliding window 4096 (checked with window 6 on a ring of 4 x 16 tokens)"):
    assert f"FAILED  ring xla chunked {attention}: {attention}: xla FAILED: error" not in out
    assert f"FAILED  ring xla chunked {attention}: xla FAILED: error" in out
    for kernel in ("ours mosaic", "ours triton"):
      assert f"ring kernel={kernel} attention={attention} H=4 KV=2" in out
  assert out.rstrip().splitlines()[-1].startswith("FAILED: ring xla chunked full attention")


@pytest.mark.parametrize("phases, timed", [(("forward",), {"fwd"}),
                                           (("backward",), {"fwd_bwd"}),
                                           (("forward", "backward"), {"fwd", "fwd_bwd"})])
def test_a_measurement_checks_and_times_only_the_phases_asked_for(phases, timed):
  """A swept forward tile is timed forward alone, a backward tile forward+backward alone (one
  compile each); the throughput columns follow what was timed."""
  import jax
  q, k, v, d_out = (jax.random.normal(key, (1, 128, 2, 16), jnp.bfloat16)
                    for key in jax.random.split(jax.random.PRNGKey(0), 4))
  rows = kernels_lib.sampled_rows(128)
  reference = kernels_lib.reference_on_rows(q, k, v, d_out, rows, True)
  fn = kernels_lib.backend_fn("xla", True, 16)
  result = kernels_lib.measure(fn, q, k, v, d_out, rows, reference, warmup=0, iters=1,
                               phases=phases)
  assert result["status"] == "ok" and timed == {"fwd", "fwd_bwd"} & set(result)
  assert ("err_out" in result) == ("forward" in phases)
  assert ("err_grad" in result) == ("backward" in phases)
  columns = kernels_lib.throughput(result, kernels_lib.attention_flops(1, 128, 2, 16, True))
  assert ("fwd_ms" in columns, "fwd_bwd_ms" in columns) == ("fwd" in timed, "fwd_bwd" in timed)
  assert ("bwd_tflops" in columns) <= (timed == {"fwd", "fwd_bwd"})


def test_programs_compiled_in_threads_measure_alike_and_a_failed_compile_is_the_rows_status():
  """``benchmarks.attention_kernels`` compiles our kernels' programs in threads first
  (``compile_ahead``); a row then measures the same as one compiling its own, and a program
  that fails to compile gives the row its reason, as inline."""
  q, k, v, d_out = (jax.random.normal(key, (1, 128, 2, 16), jnp.bfloat16)
                    for key in jax.random.split(jax.random.PRNGKey(1), 4))
  rows = kernels_lib.sampled_rows(128)
  reference = kernels_lib.reference_on_rows(q, k, v, d_out, rows, True)
  fn = kernels_lib.backend_fn("xla", True, 16)

  def broken(q, k, v):
    raise ValueError("no such tile")
  programs = kernels_lib.compile_ahead({"fn": fn, "broken": broken}, (q, k, v, d_out), 2)
  measure = functools.partial(kernels_lib.measure, q=q, k=k, v=v, d_out=d_out, rows=rows,
                              reference=reference, warmup=0, iters=1)
  threaded, inline = measure(fn, programs=programs["fn"]), measure(fn)
  assert threaded["status"] == inline["status"] == "ok"
  assert (threaded["err_out"], threaded["err_grad"]) == (inline["err_out"], inline["err_grad"])
  assert {"fwd", "fwd_bwd"} <= set(threaded)
  assert (measure(broken, programs=programs["broken"])["status"] == measure(broken)["status"]
          == "forward skipped: ValueError: no such tile")


def test_a_burst_sample_dispatches_its_calls_back_to_back_and_divides_by_them():
  calls = []

  def program(x):
    calls.append(x)
    return x + 1
  result = timing.time_fn(program, jnp.ones(4), warmup=1, iters=2, burst=3)
  assert len(calls) == 1 + 2 * 3 and result["burst"] == 3
  assert 0 < result["min_s"] <= result["median_s"] <= result["max_s"]
  assert timing.copy_bandwidth(jax.devices()[0], 1 << 20, warmup=1, iters=2, burst=2) > 0


def test_slow_calls_stop_sampling_after_the_time_allowed_keeping_three():
  calls = []

  def slow(x):
    calls.append(x)
    time.sleep(0.05)
    return x + 1
  result = timing.time_fn(slow, jnp.ones(4), warmup=1, iters=10, max_s=0.12)
  assert len(calls) == 1 + timing.MIN_SAMPLES == 1 + result["iters"]
  result = timing.time_fn(slow, jnp.ones(4), warmup=0, iters=10, burst=2, max_s=0.35)
  # three samples of two calls take at least 0.3 s, four at least 0.4
  assert result["iters"] in (3, 4) and result["median_s"] >= 0.05
  assert timing.time_fn(slow, jnp.ones(4), warmup=0, iters=2, max_s=0.0)["iters"] == 2
