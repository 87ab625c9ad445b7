"""Where the planner's collectives run (NVLink or the network), ``ulysses-plan --json``, the
all-gather-KV baseline, and the scaling study (``benchmarks.scaling``)."""

import json

import pytest

from benchmarks import scaling
from ulysses_jax import plan
from ulysses_jax.cli import plan as plan_cli
from ulysses_jax.gpus import GB, GPUS
from ulysses_jax.plan import comm, hardware as hardware_lib, report
from ulysses_jax.models import llama

# Llama-3.1-8B's attention (32 query, 8 KV heads of 128) in a 4-layer model: cheap to plan.
SMALL = plan.Model(vocab_size=32000, hidden_dim=4096, num_layers=4, num_heads=32,
                   num_kv_heads=8, head_dim=128, mlp_dim=14336)


def _by_name(model, layout, hardware, seq_len):
  step = plan.predict_step(model, layout, batch=1, seq_len=seq_len, hardware=hardware)
  return step, {t["term"]: t for t in step["breakdown"]}


def test_each_collective_names_its_group_domain_and_bandwidth():
  h100 = plan.Hardware.of("h100")  # 8 per NVLink domain
  step, terms = _by_name(SMALL, plan.Layout(1, 8, 8), h100, 2**20)
  a2a, ring = terms["all_to_all"], terms["ring"]
  assert (a2a["axes"], a2a["group"], a2a["domain"]) == ("seq", 8, "NVLink")
  assert a2a["bandwidth_gb_s"] == pytest.approx(h100.intra_bw / GB)
  assert (ring["axes"], ring["group"], ring["domain"]) == ("ring", 8, "network")
  assert ring["bandwidth_gb_s"] == pytest.approx(h100.inter_bw / GB)
  for name in ("fsdp_all_gather", "fsdp_reduce_scatter"):
    assert (terms[name]["group"], terms[name]["domain"]) == (64, "network")
  assert {"attention", "matmuls", "host_offload", "optimizer_transfer"} <= set(terms)
  assert step["step_s"] == pytest.approx(sum(t["seconds"] for t in terms.values()))
  # The same mesh inside one GB200 NVL72 rack: every collective stays on NVLink.
  _, rack = _by_name(SMALL, plan.Layout(1, 8, 8), plan.Hardware.of("gb200"), 2**20)
  assert {t["domain"] for t in rack.values() if "domain" in t} == {"NVLink"}
  assert GPUS["gb200"].nvlink_domain == 72 and plan.Hardware.of("gb200").intra_node == 72
  # Moved bytes: (P-1)/P of the all-to-all's result, all of the ring's.
  assert a2a["moved_bytes"] == pytest.approx(a2a["bytes"] * 7 / 8)
  assert ring["moved_bytes"] == ring["bytes"] == step["ring_bytes"]


def test_an_all_to_all_across_domains_sends_the_other_domains_share_over_the_network():
  h100 = plan.Hardware.of("h100")
  for seq, network_share in ((16, 8 / 16), (32, 24 / 32)):
    _, terms = _by_name(SMALL, plan.Layout(1, seq, 1), h100, 2**20)
    a2a = terms["all_to_all"]
    assert a2a["domain"] == "network"
    assert a2a["busy_s"] == pytest.approx(a2a["bytes"] * network_share / h100.inter_bw)
  # A faster network is an option: the all-to-all across domains speeds up with it.
  fast = plan.Hardware.of("h100", network_gb_s=100)
  assert fast.inter_bw == pytest.approx(2 * h100.inter_bw)
  slow_a2a = _by_name(SMALL, plan.Layout(1, 16, 1), h100, 2**20)[1]["all_to_all"]["busy_s"]
  fast_a2a = _by_name(SMALL, plan.Layout(1, 16, 1), fast, 2**20)[1]["all_to_all"]["busy_s"]
  assert fast_a2a == pytest.approx(slow_a2a / 2)


def test_a_group_crosses_domains_where_its_members_do():
  peers = hardware_lib.fewest_peers_in_domain
  assert peers(8, 1, 64, 8) == 8                  # seq=8 in nodes of 8: inside
  assert peers(16, 1, 64, 8) == 8                 # seq=16: two nodes, 8 each
  assert peers(8, 8, 64, 8) == 1                  # a ring of 8 over seq=8: one per node
  assert peers(4, 2, 8, 8) == 4                   # everything in one node
  assert peers(64, 1, 128, 72) == 8               # 64-wide groups in racks of 72 straddle
  assert peers(32, 1, 128, 64) == 32              # 64 of each rack's 72 used: inside


def test_ring_and_fsdp_are_hidden_by_compute_until_the_tokens_per_gpu_are_few():
  h100 = plan.Hardware.of("h100")
  long, _ = _by_name(SMALL, plan.Layout(1, 8, 8), h100, 2**22)
  assert long["ring_exposed_s"] == 0 and long["fsdp_exposed_s"] == 0
  short, terms = _by_name(SMALL, plan.Layout(1, 1, 512), h100, 2**19)  # 1,024 per GPU
  assert short["ring_exposed_s"] > 0 and terms["ring"]["hidden_s"] > 0
  assert terms["ring"]["hidden_by"] == "attention"


def test_the_allgather_kv_baseline_gathers_the_whole_sequence():
  layout = plan.Layout(1, 8, 1, attention="allgather_kv")
  seq_len, c = 2**16, 2
  traffic = comm.layer_traffic(SMALL, layout, None, seq_len=seq_len, batch=1,
                               dtype="bfloat16", forward_passes=2)
  kv = 2 * SMALL.num_kv_heads * SMALL.head_dim * c
  assert traffic == {"allgather_kv": 2 * kv * seq_len, "allgather_kv_grad": kv * seq_len / 8}
  ulysses = plan.predict_memory(SMALL, plan.Layout(1, 8, 1), batch=1, seq_len=seq_len)
  gathered = plan.predict_memory(SMALL, layout, batch=1, seq_len=seq_len)
  assert gathered["working"] > ulysses["working"] + 4 * seq_len * 8 * 128 * c * 0.99
  step = plan.predict_step(SMALL, layout, batch=1, seq_len=seq_len,
                           hardware=plan.Hardware.of("h100"))
  assert step["allgather_kv_s"] > 0 and step["all_to_all_s"] == 0
  with pytest.raises(ValueError, match="has no ring, got ring=2"):
    plan.Layout(1, 4, 2, attention="allgather_kv")
  with pytest.raises(ValueError, match="attention must be one of"):
    plan.Layout(1, 4, 1, attention="megatron")


def test_the_planner_places_seq_by_the_network_and_says_why():
  model = plan.Model.from_config(llama.preset("llama3.1-70b"))
  h100 = plan.Hardware.of("h100")
  rows = plan.plan(model, seq_len=2**20, devices=64, hardware=h100)
  best = rows[0]["layout"]
  assert best.seq <= 8 and report.mesh_kind(best, h100) in ("hybrid", "ulysses")
  why = report.placement(rows, h100)
  assert "inside one NVLink domain of 8 GPUs" in why["text"]
  across = [a for a in why["alternatives"] if a["mesh_kind"] == "ulysses_across"]
  assert across and across[0]["slower_s"] > 0  # Ulysses over the network is slower
  # In a 64-GPU NVLink domain the all-to-all over all 64 stays on NVLink.
  one_domain = plan.Hardware.of("gb200", intra_node=64)
  assert report.mesh_kind(plan.Layout(1, 64, 1), one_domain) == "ulysses"
  assert report.mesh_kind(plan.Layout(1, 64, 1), h100) == "ulysses_across"


def test_plan_json_gives_the_layout_and_the_breakdown(tmp_path, capsys):
  out = tmp_path / "plan.json"
  plan_cli.run(["--model=llama3.1-70b", "--seq_len=16777216", "--devices=64", "--gpu=h100",
                f"--json={out}"])
  printed = capsys.readouterr().out
  answer = json.loads(out.read_text())
  best = answer["recommendation"]
  assert answer["fits"] and best["mesh"]["seq"] <= 8 and best["mesh"]["ring"] > 1
  terms = {t["term"]: t for t in best["breakdown"]}
  assert terms["all_to_all"]["domain"] == "NVLink" and terms["ring"]["domain"] == "network"
  assert terms["attention"]["seconds"] > 0 and terms["matmuls"]["seconds"] > 0
  assert best["step_s"] == pytest.approx(sum(t["seconds"] for t in terms.values()))
  assert best["why"]["text"] in printed and "why this mesh" in printed
  assert len(answer["rows"]) > 1 and answer["rows"][0]["mesh"] == best["mesh"]
  assert answer["question"]["nodes"] == 8 and answer["nothing_fits"] is None
  assert "all_to_all" in printed and "NVLink at 300 GB/s" in printed


def test_plan_json_says_what_fits_when_nothing_does(tmp_path, capsys):
  out = tmp_path / "plan.json"
  with pytest.raises(SystemExit) as exit_info:
    plan_cli.run(["--model=llama3.1-70b", "--seq_len=16777216", "--nodes=1", "--gpu=h100",
                  f"--json={out}"])
  assert exit_info.value.code == 1
  answer = json.loads(out.read_text())
  nothing = answer["nothing_fits"]
  assert not answer["fits"] and answer["recommendation"] is None
  assert answer["question"]["devices"] == 8
  assert 0 < nothing["longest_seq_len"] < 16777216 and nothing["fewest_devices"] > 8
  assert nothing["longest_layout"]["mesh"]["seq"] * nothing["longest_layout"]["mesh"]["ring"] > 1
  assert "no layout fits 16,777,216 tokens on 8 devices" in capsys.readouterr().err


def test_topology_flags(capsys):
  args = ["--model=llama3.2-1b", "--seq_len=1048576", "--mesh=1x16x1", "--remat=full",
          "--offload=none"]
  nodes = plan_cli.run([*args, "--nodes=2"])  # 2 nodes of the H100's 8: 16 devices
  intra = plan_cli.run([*args, "--devices=16", "--intra_node=8"])
  one_domain = plan_cli.run([*args, "--devices=16", "--intra_node=16"])
  assert nodes["step"]["all_to_all_s"] == intra["step"]["all_to_all_s"]
  assert one_domain["step"]["all_to_all_s"] < intra["step"]["all_to_all_s"]
  capsys.readouterr()
  for bad, message in ((["--devices=12", "--nodes=8"], "must split evenly over --nodes (8)"),
                       ([], "give --devices (GPUs in all), or --nodes"),
                       (["--devices=16", "--nodes=2", "--intra_node=8"], "not allowed with"),
                       (["--devices=16", "--network_gb_s=0"], "network bandwidth > 0")):
    with pytest.raises(SystemExit) as exit_info:
      plan_cli.run([*args[:2], *bad])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_scaling_study_writes_one_row_per_point_up_to_4096_gpus(tmp_path):
  out = tmp_path / "scaling.json"
  rows = scaling.main(["--models=llama3.1-8b", "--networks=h100", "--sweeps=strong-1m",
                       "--devices=8,64,4096", f"--json={out}"])
  written = json.loads(out.read_text())
  assert max(r["devices"] for r in written["rows"]) == 4096
  study = [r for r in rows if r["scaling"] != "scan"]
  assert {r["mesh_kind"] for r in study} == set(scaling.KINDS)
  impossible = [r for r in study if not r["possible"]]
  assert impossible and all(r["mesh_kind"] == "ulysses_across" and r["devices"] > 32
                            for r in impossible)
  hybrid = {r["devices"]: r for r in study if r["mesh_kind"] == "hybrid"}
  assert hybrid[64]["mesh"] == {"data": 1, "seq": 8, "ring": 8}
  assert hybrid[64]["domains"]["all_to_all"] == "NVLink"
  # 1M tokens over 4,096 GPUs: 256 per GPU, too few for attention to hide the rest.
  assert hybrid[4096]["exposed_comm_share"] > hybrid[64]["exposed_comm_share"]
  crossing = {c["mesh_kind"]: c for c in written["crossovers"]}
  assert crossing["ring"]["devices_at_10%"] is not None
  assert written["all_to_all_peaks"] and written["assumptions"]
