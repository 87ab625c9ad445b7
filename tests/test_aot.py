"""Platform decisions read from the mesh's devices, and ``ulysses_jax.aot``'s input checks.

These run everywhere (no CUDA plugin needed); the GPU compiles themselves are in
``test_gpu_compile.py``. A GPU target is simulated with an abstract mesh whose abstract device
is a GPU, which is what the body of a ``shard_map`` over compile-only GPU devices sees.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from ulysses_jax import aot, make_mesh
from ulysses_jax.aot import cost, roofline  # noqa: F401  (aot.cost, aot.roofline)
from ulysses_jax.aot import report as report_lib
from ulysses_jax.attention.backends import choose_backend, resolve_backend
from ulysses_jax.kernels import flash_attention as fa
from ulysses_jax.kernels import target as target_lib

GIB = 2**30

H100 = "NVIDIA H100 80GB HBM3"


def _gpu_context(kind=H100):
  """What the body of a shard_map over GPU devices of ``kind`` sees."""
  device = AbstractDevice(device_kind=kind, num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(
      AbstractMesh((1, 8), ("data", "seq"), abstract_device=device))


def _resolve(backend, **kwargs):
  return resolve_backend(backend, dtype=jnp.bfloat16, head_dim=128, num_q_heads=32,
                         num_kv_heads=8, causal=True, segment_ids_given=False, **kwargs)


def _choose(**kwargs):
  case = dict(dtype=jnp.bfloat16, head_dim=128, num_q_heads=32, num_kv_heads=8, causal=True,
              segment_ids_given=True)
  return choose_backend(**{**case, **kwargs})


def test_auto_backend_follows_the_mesh_not_the_process(monkeypatch):
  cpu_mesh = make_mesh(seq=8, devices=jax.devices()[:8])
  assert _resolve("auto", mesh=cpu_mesh) == "xla"
  assert _resolve("auto") == "xla"  # no mesh, no context: JAX's first device (a CPU here)
  monkeypatch.setitem(target_lib._CAPABILITIES, H100, 9.0)
  with _gpu_context():
    assert _resolve("auto") == "pallas_mosaic"
    assert _resolve("cudnn") == "cudnn"
    assert _resolve("auto", mesh=cpu_mesh) == "xla"  # an explicit mesh wins


def test_auto_prefers_mosaic_then_triton_then_cudnn_then_xla_and_says_why(monkeypatch):
  monkeypatch.setitem(target_lib._CAPABILITIES, H100, 9.0)
  monkeypatch.setitem(target_lib._CAPABILITIES, "NVIDIA A100-SXM4-80GB", 8.0)
  monkeypatch.setitem(target_lib._CAPABILITIES, "NVIDIA B200", 10.0)
  with _gpu_context():
    hopper = _choose()
    assert (hopper.backend, hopper.fallbacks) == ("pallas_mosaic", ("pallas", "xla"))
    assert "Mosaic GPU" in hopper.reason and "cuDNN's attention: does not support segment_ids" \
        in hopper.reason
    assert _choose(segment_ids_given=False).fallbacks == ("pallas", "cudnn", "xla")
    assert _choose(causal=False, num_kv_heads=1).backend == "pallas_mosaic"  # MQA, full mask
    float32 = _choose(dtype=jnp.float32, segment_ids_given=False)
    assert (float32.backend, float32.fallbacks) == ("pallas", ("xla",))
    assert "got float32 and 128" in float32.reason
    assert _choose(head_dim=256).backend == "pallas"  # the Mosaic backward stops at 128
    assert _choose(head_dim=80, segment_ids_given=False).backend == "cudnn"
    ring = _choose(ring_attention=True)  # the ring takes partial results: no cuDNN
    assert (ring.backend, ring.fallbacks) == ("pallas_mosaic", ("pallas", "xla"))
    ring = _choose(ring_attention=True, segment_ids_given=False)
    assert ring.fallbacks == ("pallas", "xla") and "ring attention cannot use it" in ring.reason
  for kind in ("NVIDIA A100-SXM4-80GB", "NVIDIA B200"):  # Ampere; wgmma is Hopper's alone
    with _gpu_context(kind):
      assert _choose().backend == "pallas" and "compute capability" in _choose().reason
  monkeypatch.delitem(target_lib._CAPABILITIES, H100)
  with _gpu_context():  # a GPU whose capability was never seen: not Mosaic
    assert _choose().backend == "pallas" and "unknown" in _choose().reason
  cpu = _choose(mesh=make_mesh(seq=8, devices=jax.devices()[:8]))
  assert (cpu.backend, cpu.fallbacks) == ("xla", ()) and "interpreted" in cpu.reason
  with pytest.raises(ValueError, match=r"query heads \(32\) must be a positive multiple of KV "
                     r"heads \(5\)"):
    _choose(num_kv_heads=5)


def test_cudnn_and_mosaic_checks_name_the_mesh_devices(monkeypatch):
  with pytest.raises(ValueError, match=r"mesh's devices are 'cpu'"):
    _resolve("cudnn", mesh=make_mesh(seq=2, devices=jax.devices()[:2]))
  monkeypatch.setitem(target_lib._CAPABILITIES, "NVIDIA A100-SXM4-80GB", 8.0)
  with _gpu_context("NVIDIA A100-SXM4-80GB"), pytest.raises(ValueError, match="Hopper"):
    _resolve("pallas_mosaic")
  monkeypatch.delitem(target_lib._CAPABILITIES, H100, raising=False)
  with _gpu_context():  # capability unknown: allowed, as on a GPU never seen
    assert _resolve("pallas_mosaic") == "pallas_mosaic"


def test_kernel_interpret_mode_and_tiles_follow_the_target(monkeypatch):
  q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  spec = fa._plan_for(q, True, None, None, None, None, "triton", "triton", None)
  assert spec.interpret and spec.forward.num_warps == 8 and spec.forward.block_kv == 64
  monkeypatch.setitem(target_lib._CAPABILITIES, H100, 9.0)
  with _gpu_context():
    spec = fa._plan_for(q, True, None, None, None, None, "triton", "triton", None)
  assert not spec.interpret
  assert spec == fa.choose_tiles(256, 128, causal=True, scale=128 ** -0.5, generation="sm90")


def test_target_generation():
  assert target_lib.Target("gpu", H100, 9.0).generation == "sm90"
  assert target_lib.Target("gpu", "NVIDIA A100-SXM4-80GB", 8.0).generation == "other"
  assert target_lib.Target("gpu", "unknown", None).generation == "other"
  assert target_lib.Target("cpu", "cpu", None).generation == "other"
  assert target_lib.of_device(jax.devices()[0]).platform == "cpu"


@pytest.mark.parametrize("gpu,kind,capability", [
    ("h100", H100, "major: 9"), ("h200", "NVIDIA H200 141GB HBM3e", "major: 9"),
    ("a100", "NVIDIA A100-SXM4-80GB", "major: 8"), ("b200", "NVIDIA B200", "major: 10"),
    ("gb200", "NVIDIA GB200", "major: 10")])
def test_target_descriptions(gpu, kind, capability):
  text = aot.targets.target_config(aot.GPUS[gpu])
  assert f'name: "{kind}"' in text and capability in text
  assert "collective_memory_granularity" not in text  # jaxlib 0.10.2 rejects it


def test_one_gpu_table_for_aot_and_the_planner():
  """aot's GPUs are the planner's: the planner's budget is the one aot's fit check uses, and
  its speeds follow the GPU's peaks."""
  from ulysses_jax import gpus, plan
  assert aot.GPUS is gpus.GPUS
  for name, gpu in gpus.GPUS.items():
    hardware = plan.Hardware.of(name)
    assert hardware.budget_bytes == gpu.budget_bytes < gpu.memory_bytes
  a100, h100 = plan.Hardware.of("a100"), plan.Hardware.of("h100")
  assert a100.flops / h100.flops == pytest.approx(312 / 989.4)
  assert a100.intra_bw / h100.intra_bw == pytest.approx(300 / 450)


# What drivers report (nvidia-smi, jax.devices()[0].device_kind) -> the table's row.
DRIVER_NAMES = {
    "NVIDIA H100 80GB HBM3": "h100", "NVIDIA H100 PCIe": "h100_pcie",
    "NVIDIA H100 NVL": "h100_nvl", "NVIDIA H800": "h800", "NVIDIA H200": "h200",
    "NVIDIA GH200 480GB": "gh200", "NVIDIA A100-SXM4-40GB": "a100_40gb",
    "NVIDIA A100-SXM4-80GB": "a100", "NVIDIA A100 80GB PCIe": "a100_pcie",
    "NVIDIA B200": "b200", "NVIDIA GB200": "gb200"}


@pytest.mark.parametrize("reported, key", DRIVER_NAMES.items())
def test_the_gpu_table_knows_the_names_drivers_report(reported, key):
  """Each driver's name finds its row, with nothing assumed, and the row serves doctor's
  roofline, aot's target and budget, and the planner."""
  from ulysses_jax import gpus, plan
  found, gpu, assumed = gpus.gpu_of_kind(reported)
  assert (found, assumed) == (key, "")
  assert gpus.gpu_of_kind(reported.removeprefix("NVIDIA ").lower())[0] == key
  assert f'device_description_str: "{gpu.name}"' in aot.targets.target_config(gpu)
  assert plan.Hardware.of(key).budget_bytes == gpu.budget_bytes > 0
  assert 0 < gpu.bf16_flops <= 2.5e15 and 0 < gpu.memory_bandwidth < 1e13


def test_an_unknown_gpu_gets_the_nearest_row_and_doctor_says_what_it_assumed():
  """By compute capability, then memory; doctor's roofline line names the values assumed."""
  from ulysses_jax import gpus
  from ulysses_jax.doctor import step
  key, gpu, assumed = gpus.gpu_of_kind("NVIDIA H200 NVL", (9, 0), 140 * GIB)
  assert key == "h200" and assumed.startswith("'NVIDIA H200 NVL' is not in ulysses_jax.gpus: "
                                              "assumed the values of 'h200'")
  assert gpus.gpu_of_kind("NVIDIA A100-PCIE-40GB", (8, 0), 40 * GIB)[0] == "a100_40gb"
  assert gpus.gpu_of_kind("NVIDIA B300", (10, 3), 270 * GIB)[0] == "gb200"
  result = {"loss": 1.0, "peak_memory_gib": 1.0, "compiled_memory_gib": 1.0, "step_s": 0.2,
            "predicted_step_s": 0.1, "gpu_assumed": assumed}
  line = step.checks(result, on_gpu=True)[-1]
  assert line["passed"] and line["detail"].endswith(assumed)


def test_the_runtime_reserve_is_a_tenth_of_each_gpu_and_can_be_given_in_gib():
  """The budget is the capacity less the reserve (at least 6 GiB on an H100, proportionally
  more on larger GPUs); --reserve_gib replaces it, and nonsense is refused."""
  h100, h200 = aot.GPUS["h100"], aot.GPUS["h200"]
  assert h100.runtime_reserve_bytes >= 6 * GIB
  assert h100.budget_bytes == h100.memory_bytes - h100.runtime_reserve_bytes
  for gpu in aot.GPUS.values():
    assert gpu.runtime_reserve_bytes / gpu.memory_bytes == pytest.approx(0.10)
  assert h200.runtime_reserve_bytes > h100.runtime_reserve_bytes
  assert h100.with_reserve(None) is h100
  assert h100.with_reserve(4).runtime_reserve_bytes == 4 * GIB
  assert h100.with_reserve(0).budget_bytes == h100.memory_bytes
  for bad in (-1, 80):
    with pytest.raises(ValueError, match="the runtime reserve must be at least 0 and below "
                                         "the GPU's 79.11 GiB"):
      h100.with_reserve(bad)


@pytest.mark.parametrize("io_gib", [0, 10, 60, 66, 200])
def test_budget_options_give_the_compile_the_limit_of_a_run_holding_the_budget(io_gib):
  """XLA's limit is (base - io) * slop / 100, base 80 % of the GPU on compile-only devices and
  the client's pool in a run (the trainer's XLA_CLIENT_MEM_FRACTION: the budget): with the
  options the two limits agree, whether io is small, near the base or above both."""
  gpu, io = aot.GPUS["h100"], io_gib * GIB
  slop = report_lib.budget_options(gpu, io)["xla_gpu_memory_limit_slop_factor"]
  compile_only = (int(gpu.memory_bytes * 0.8) - io) * slop / 100
  in_the_run = (gpu.budget_bytes - io) * 95 / 100
  assert compile_only == pytest.approx(in_the_run, rel=0.02)


def test_bad_gpu_and_topology_are_refused_before_any_work():
  with pytest.raises(aot.AotError, match=r"unknown GPU 'v100': expected one of \['a100', "):
    aot.gpu_devices("v100", "1x1x8")
  for bad in ("8", "1x8", "1x1x0", "axbxc", "1x1x8x2"):
    with pytest.raises(aot.AotError, match="malformed topology"):
      aot.gpu_devices("h100", bad)
  assert aot.parse_topology("4x1x8") == (4, 1, 8)


def test_missing_plugin_names_the_fix(monkeypatch):
  monkeypatch.setattr(aot.devices, "_PLUGINS", ("jax_plugins.no_such_plugin",))
  aot.devices._devices.cache_clear()
  with pytest.raises(aot.AotError, match=r"\.\[gpu-compile\].*make gpu-compile-venv"):
    aot.gpu_devices("h100", "1x1x8")


_HLO = """\
%fused_dot (p0: bf16[64,128], p1: bf16[128,32]) -> bf16[64,32] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,32]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (state: (s32[], bf16[64,128])) -> (s32[], bf16[64,128]) {
  %state = (s32[], bf16[64,128]{1,0}) parameter(0)
  %x = bf16[64,128]{1,0} get-tuple-element(%state), index=1
  %w = bf16[128,32]{1,0} constant({...})
  %mm = bf16[64,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot
  %q = bf16[1,256,4,64]{3,2,1,0} broadcast(%mm), dimensions={}
  %att = (bf16[1,256,4,64]{3,2,1,0}, f32[1,4,256]{2,1,0}) custom-call(%q, %q, %q), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/flash_attention_forward_causal/pallas_call"}
  %a2a = bf16[1,256,4,64]{3,2,1,0} all-to-all(%q), replica_groups=[1,8]<=[8]
  ROOT %t = (s32[], bf16[64,128]{1,0}) tuple(%i, %x)
}

ENTRY %main (a: bf16[64,128]) -> bf16[64,128] {
  %a = bf16[64,128]{1,0} parameter(0)
  %loop = (s32[], bf16[64,128]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = bf16[64,128]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_cost_counts_ops_per_launch_and_loop_trips():
  ops = {op.name: op for op in aot.cost.operations(_HLO)}
  assert set(ops) == {"mm", "q", "att"}  # collectives, tuples, parameters: not HBM work
  assert ops["mm"].count == 3 and ops["mm"].flops == 2 * 64 * 32 * 128
  assert ops["mm"].bytes == 2 * (64 * 32 + 64 * 128 + 128 * 32)
  assert ops["att"].flops == 4 * 1 * 4 * 256 * 256 * 64 * 0.5  # causal forward
  assert ops["q"].flops == 0


def test_cost_counts_a_kernel_inside_a_fusion():
  """XLA's dynamic-slice fusion wraps a kernel's custom call with the update of a stacked
  buffer (jax 0.11.2 did so to a copy of the attention forward): its FLOPs count."""
  call = ('custom-call(%q, %q, %q), custom_call_target="mosaic_gpu_v2", '
          'metadata={op_name="jit(f)/flash_attention_forward_causal/pallas_call"}')
  hlo = _HLO.replace("%body (state", f"""%wrapped (q: bf16[1,256,4,64]) -> bf16[1,256,4,64] {{
  %q = bf16[1,256,4,64]{{3,2,1,0}} parameter(0)
  ROOT %inner = bf16[1,256,4,64]{{3,2,1,0}} {call}
}}

%body (state""").replace(
      "  %a2a =", "  %dsf = bf16[1,256,4,64]{3,2,1,0} fusion(%q), kind=kCustom, "
      "calls=%wrapped\n  %a2a =")
  ops = {op.name: op for op in aot.cost.operations(hlo)}
  assert ops["dsf"].flops == ops["att"].flops == 4 * 1 * 4 * 256 * 256 * 64 * 0.5


_HLO_STACK = """\
%slice_of_stack (stack: bf16[16,64,128], i: s32[]) -> bf16[1,64,128] {
  %stack = bf16[16,64,128]{2,1,0} parameter(0)
  %view = bf16[16,64,128]{2,0,1} bitcast(%stack)
  %i = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%view, %i, %zero, /*index=3*/%zero), dynamic_slice_sizes={1,64,128}
}

%update_of_stack (stack: bf16[16,64,128], x: bf16[64,128], i: s32[]) -> bf16[16,64,128] {
  %stack = bf16[16,64,128]{2,1,0} parameter(0)
  %x = bf16[64,128]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %zero = s32[] constant(0)
  %neg = bf16[64,128]{1,0} negate(%x)
  %y = bf16[1,64,128]{2,1,0} bitcast(%neg)
  ROOT %dus = bf16[16,64,128]{2,1,0} dynamic-update-slice(%stack, %y, %i, %zero, /*index=4*/%zero)
}

ENTRY %main (stack: bf16[16,64,128], x: bf16[64,128], i: s32[]) -> (bf16[1,64,128], bf16[1,64,128]) {
  %stack = bf16[16,64,128]{2,1,0} parameter(0)
  %x = bf16[64,128]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %read = bf16[1,64,128]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%slice_of_stack
  %start = ((bf16[16,64,128]{2,1,0}, bf16[64,128]{1,0}, s32[]), bf16[16,64,128]{2,1,0}, u32[]) fusion-start(%stack, %x, %i), kind=kLoop, calls=%update_of_stack
  %done = bf16[16,64,128]{2,1,0} fusion-done(%start)
  %zero = s32[] constant(0)
  %unfused = bf16[1,64,128]{2,1,0} dynamic-slice(%done, %i, %zero, %zero), dynamic_slice_sizes={1,64,128}
  ROOT %t = (bf16[1,64,128]{2,1,0}, bf16[1,64,128]{2,1,0}) tuple(%read, %unfused)
}
"""


def test_cost_counts_a_layers_slice_of_a_stack_not_the_stack():
  """A layer scan's step reads its layer's slice of a stacked buffer and updates its slice in
  place (XLA's dynamic-update-slice; here an asynchronous fusion, as jax 0.11.2 compiles them):
  the slices' bytes, not the stack's 16 layers (read, written, and again at the fusion's done)."""
  ops = {op.name: op for op in aot.cost.operations(_HLO_STACK)}
  layer, index = 64 * 128 * 2, 4
  assert set(ops) == {"read", "start", "unfused"}
  assert ops["read"].bytes == layer + index + layer  # the slice read, the index, the slice out
  assert ops["start"].bytes == layer + index + layer  # x read, the index, x's rows written
  assert ops["unfused"].bytes == 2 * layer


@pytest.mark.parametrize("kernel,matmuls", [("dq", 3), ("dkv", 4), ("dkv_dq", 5)])
def test_cost_counts_each_backward_kernels_matmuls(kernel, matmuls):
  """dq recomputes QKᵀ and dO·Vᵀ beside dS·K; dk/dv runs four; dk/dv accumulating dq five."""
  hlo = _HLO.replace('op_name="jit(f)/flash_attention_forward_causal/pallas_call"',
                     f'op_name="jit(f)/transpose(flash_attention_{kernel}_causal)/pallas_call"')
  (att,) = [op for op in aot.cost.operations(hlo) if op.name == "att"]
  assert att.flops == matmuls * 2 * 1 * 4 * 256 * 256 * 64 * 0.5


def test_cost_reads_a_windowed_kernel_also_as_the_outermost_transformed_call():
  hlo = _HLO.replace('op_name="jit(f)/flash_attention_forward_causal/pallas_call"',
                     'op_name="jit(f)/jvp(flash_attention_forward_causal_window64)/pallas_call"')
  (att,) = [op for op in aot.cost.operations(hlo) if op.name == "att"]
  keys = 64 - 64 ** 2 / (2 * 256)  # reference.mean_visible_keys(256, 64)
  assert att.flops == 4 * 1 * 4 * 256 * keys * 64


_HLO_CONDITIONAL = """\
%small (p: bf16[64,128]) -> bf16[64,32] {
  %p = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,32]{1,0} constant({...})
  ROOT %small_dot = bf16[64,32]{1,0} dot(%p, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%big (p: bf16[64,128]) -> bf16[64,32] {
  %p = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,128]{1,0} constant({...})
  %h = bf16[64,128]{1,0} dot(%p, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %w2 = bf16[128,32]{1,0} constant({...})
  ROOT %big_dot = bf16[64,32]{1,0} dot(%h, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (i: s32[], a: bf16[64,128]) -> bf16[64,32] {
  %i = s32[] parameter(0)
  %a = bf16[64,128]{1,0} parameter(1)
  ROOT %c = bf16[64,32]{1,0} conditional(%i, %a, %a), branch_computations={%small, %big}
}
"""


def test_cost_counts_the_costliest_branch_of_a_conditional_only():
  """One branch of a conditional runs (the ring's causal step 0 or its tiles): the costliest
  one counts, not both."""
  ops = {op.name for op in aot.cost.operations(_HLO_CONDITIONAL)}
  assert ops == {"h", "big_dot"}


def test_roofline_adds_compute_links_and_pcie():
  gpu = aot.GPUS["h100"]
  ops = [aot.cost.Op("mm", "fusion", 2, flops=gpu.bf16_flops, bytes=1)]
  one_node = aot.roofline.predict(gpu, ops, {"all-to-all": int(gpu.nvlink_bandwidth),
                                             "all-gather": int(gpu.nvlink_bandwidth)},
                                  host_bytes=int(gpu.pcie_bandwidth), nodes=1,
                                  model_flops_per_step=4 * gpu.bf16_flops, num_devices=4)
  assert (one_node.compute_s, one_node.collective_s, one_node.host_s) == (2.0, 2.0, 1.0)
  assert one_node.step_s == 5.0 and one_node.mfu == pytest.approx(0.2)
  two_nodes = aot.roofline.predict(gpu, ops, {"all-gather": int(gpu.network_bandwidth)},
                                   host_bytes=0, nodes=2, model_flops_per_step=0,
                                   num_devices=16)
  assert two_nodes.collective_s == 1.0


@pytest.mark.parametrize("flag,message", [
    ("--gpu=v100", "unknown GPU 'v100'"), ("--topology=8", "malformed topology '8'"),
    ("--reserve_gib=80", "the runtime reserve must be at least 0 and below the GPU's 79.11 GiB, "
                         "got 80 GiB")])
def test_cli_bad_input_exits_2(flag, message, capsys):
  from ulysses_jax.cli.aot import main
  assert main([flag, "--gin_file=configs/llama1b_128k.gin"]) == 2
  assert message in capsys.readouterr().err


def test_async_collectives_count_their_results_only():
  from ulysses_jax.aot import hlo
  text = "\n".join([
      "  %a = ((bf16[1,64,8,128]{3,1,0,2}), bf16[1,64,8,128]{3,1,0,2}) all-to-all-start(%x), "
      "replica_groups=[1,8]<=[8]",
      "  %b = (f32[4,8]{1,0}, f32[4,8]{1,0}, u32[], u32[]) collective-permute-start(%y), "
      "source_target_pairs={{0,1},{1,0}}",
      "  %c = (bf16[4,8]{1,0}, bf16[32,8]{1,0}) all-gather-start(%z), replica_groups=[1,8]<=[8]",
      "  %d = f32[16]{0} all-reduce-start(%w), replica_groups=[1,8]<=[8], to_apply=%add",
      # jax 0.11 on: an all-reduce start returns its operands too.
      "  %e = ((f32[2048,64]{1,0}), f32[2048,64]{1,0}) all-reduce-start(%v), "
      "replica_groups=mesh['axis_0'=8] {'axis_0'}, to_apply=%add"])
  assert hlo.collective_bytes(text) == {
      "all-to-all": 64 * 8 * 128 * 2, "all-gather": 32 * 8 * 2,
      "all-reduce": 16 * 4 + 2048 * 64 * 4,
      "reduce-scatter": 0, "collective-permute": 4 * 8 * 4}


def test_links_carry_what_each_device_sends_by_the_ring_algorithms():
  """The roofline times what a device sends (``sent=True``), not a collective's result: over
  a group of n an all-gather sends (n-1)/n of its result, a reduce-scatter n-1 times it, an
  all-reduce 2(n-1)/n, an all-to-all (n-1)/n, a permute all of it."""
  from ulysses_jax.aot import hlo
  text = "\n".join([
      "ENTRY %main () -> f32[] {",
      "  %a = bf16[64]{0} all-gather(%x), replica_groups=[2,4]<=[8]",
      "  %b = f32[8]{0} reduce-scatter(%y), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add",
      "  %c = f32[16]{0} all-reduce(%w), replica_groups=[1,8]<=[8], to_apply=%add",
      "  %d = bf16[32]{0} all-to-all(%v), replica_groups=[2,4]<=[8]",
      "  %e = f32[4]{0} collective-permute(%u), source_target_pairs={{0,1},{1,0}}",
      # Shardy's groups (jax 0.11 on): the axes named after the mesh; one of size 1 moves nothing.
      "  %f = f32[8]{0} reduce-scatter(%t), replica_groups=mesh['data'=2,'seq'=4] {'seq'}, "
      "use_global_device_ids=true, dimensions={0}, to_apply=%add",
      "  %g = f32[8]{0} all-reduce(%t), replica_groups=mesh['data'=1,'seq'=8] {'data'}, "
      "use_global_device_ids=true, to_apply=%add",
      "}"])
  assert hlo.executed_collective_bytes(text) == {
      "all-gather": 128, "reduce-scatter": 32 + 32, "all-reduce": 64, "all-to-all": 64,
      "collective-permute": 16}
  assert hlo.executed_collective_bytes(text, sent=True) == {
      "all-gather": 96, "reduce-scatter": 7 * 32 + 3 * 32, "all-reduce": 112, "all-to-all": 48,
      "collective-permute": 16}


def test_cli_refuses_a_topology_the_config_does_not_use(capsys, monkeypatch):
  from ulysses_jax.cli import aot as cli
  monkeypatch.setattr(cli, "gpu_devices", lambda gpu, topology: jax.devices()[:8])
  assert cli.main(["--topology=1x1x8", "--gin_file=configs/llama8b_1gpu_512k.gin"]) == 2
  assert "needs 1 devices but 8 are available" in capsys.readouterr().err


def test_cli_says_a_gin_string_needs_quotes(capsys, monkeypatch):
  from ulysses_jax.cli import aot as cli
  monkeypatch.setattr(cli, "gpu_devices", lambda gpu, topology: jax.devices()[:8])
  assert cli.main(["--gin_file=configs/llama1b_128k.gin",
                   "--gin_param=LlamaConfig.remat_policy=full"]) == 2
  assert "strings need quotes" in capsys.readouterr().err
