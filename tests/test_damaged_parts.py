"""Committed parts are checked before they are trusted: a damaged part (truncated, a byte changed, lost, its
footer gone) is computed again with a warning naming it, in place when it is in the middle; `batchrun verify`
finds every kind of damage, one line each, and passes a whole output, a folder of shards, a merged folder
(fake engine, in-process: this is about the folder)."""

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_job_fakes import read_rows, write_job

from batchrun.cli import main

N_ROWS = 20
IDS = [f"r{i:02d}" for i in range(N_ROWS)]


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], env={"BATCHRUN_LLM_FACTORY": "test_job_fakes:FakeLLM"})


@pytest.fixture
def done(tmp_path):
    """A complete output of 5 parts (4 rows each) and the rows it holds."""
    pq.write_table(pa.table({"id": IDS, "prompt": [f"prompt number {i}" for i in range(N_ROWS)]}),
                   tmp_path / "in.parquet")
    job = write_job(tmp_path / "job.yaml", input={"path": str(tmp_path / "in.parquet")},
                    output={"path": str(tmp_path / "out"), "rows_per_part": 4})
    assert cli("run", job).exit_code == 0
    return job, tmp_path / "out", read_rows(tmp_path / "out")


def part(out, i):
    return out / f"part-{i:05d}.parquet"


def flip_byte(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def verify_lines(out):
    result = cli("verify", out)
    return result.exit_code, [line for line in result.stderr.splitlines() if line.startswith("batchrun: problem:")]


def test_verify_passes_a_whole_output(done):
    _, out, _ = done
    result = cli("verify", out)
    assert result.exit_code == 0, result.output
    assert f"{out} is whole: 5 parts, {N_ROWS} rows for {N_ROWS} input rows" in result.stdout


@pytest.mark.parametrize("damage", ["truncate_last", "flip_middle", "lose_middle", "truncate_middle",
                                    "footer_of_first"])
def test_damage_is_found_named_and_computed_again(done, damage):
    job, out, rows = done
    others = {i: part(out, i).read_bytes() for i in range(5)}
    which = {"truncate_last": 4, "flip_middle": 2, "lose_middle": 1, "truncate_middle": 3, "footer_of_first": 0}[damage]
    p = part(out, which)
    if damage.startswith("truncate"):
        p.write_bytes(p.read_bytes()[:-100])
    elif damage == "flip_middle":
        flip_byte(p, 40)  # inside the data pages: the size and the footer stay as they were
    elif damage == "lose_middle":
        p.unlink()
    else:
        data = p.read_bytes()
        p.write_bytes(data[:-8] + b"XXXXXXXX")  # the footer's length and magic gone
    code, lines = verify_lines(out)
    assert code == 1 and len(lines) == 1 and p.name in lines[0] and "damaged" in lines[0], lines
    rerun = cli("run", job)
    assert rerun.exit_code == 0, rerun.output
    assert f"{p} is damaged" in rerun.stderr and "computed again" in rerun.stderr
    assert "already complete" not in rerun.stdout
    assert read_rows(out) == rows  # the same rows (greedy, deterministic), in order, once
    for i in range(5):
        if i != which:
            assert part(out, i).read_bytes() == others[i]  # the sound parts are not touched
    assert cli("verify", out).exit_code == 0
    assert cli("run", job).stdout.count("already complete") == 1


def test_a_lost_manifest_is_recorded_again(done):
    job, out, rows = done
    (out / "_manifest.json").unlink()
    code, lines = verify_lines(out)
    assert code == 1 and "no _manifest.json" in lines[0]
    again = cli("run", job)
    assert again.exit_code == 0 and "already complete" in again.stdout
    assert cli("verify", out).exit_code == 0 and read_rows(out) == rows


def test_parts_that_disagree_exit_2_naming_the_way_out(done):
    job, out, _ = done
    shutil.copy(part(out, 3), part(out, 2))
    (out / "_manifest.json").unlink()  # nothing left to say which part is right
    result = cli("run", job)
    assert result.exit_code == 2
    assert "not contiguous" in result.stderr and "--no-resume" in result.stderr and "part-00002" in result.stderr
    assert verify_lines(out)[0] == 1


def test_damage_in_an_unfinished_output_is_repaired_by_the_resume(done, tmp_path):
    job, _, rows = done
    out = tmp_path / "partial"
    assert cli("run", job, "--set", f"output.path={out}", "--limit", "12").exit_code == 0
    part(out, 1).write_bytes(b"not parquet at all")
    code, lines = verify_lines(out)
    assert code == 1 and any("part-00001" in x for x in lines) and any("not complete" in x for x in lines)
    resumed = cli("run", job, "--set", f"output.path={out}")
    assert resumed.exit_code == 0 and "part-00001.parquet is damaged" in resumed.stderr
    assert read_rows(out) == rows
    assert cli("verify", out).exit_code == 0


def test_verify_checks_ids_against_the_input(done, tmp_path):
    _, out, _ = done
    src = tmp_path / "in.parquet"
    ids = list(IDS)
    ids[7] = "someone else"
    pq.write_table(pa.table({"id": ids, "prompt": [f"prompt number {i}" for i in range(N_ROWS)]}), src)
    code, lines = verify_lines(out)
    assert code == 1 and len(lines) == 1 and "input position 7 have id 'r07' where the input has 'someone else'" \
        in lines[0]
    os.unlink(src)
    result = cli("verify", out)
    assert result.exit_code == 0 and "ids not checked against the input" in result.stderr


def test_verify_metrics_success_and_shards(done, tmp_path):
    job, out, rows = done
    metrics = json.loads((out / "_metrics.json").read_text())
    (out / "_metrics.json").write_text(json.dumps({**metrics, "output_rows": 3}))
    (out / "_SUCCESS").unlink()
    code, lines = verify_lines(out)
    assert code == 1 and len(lines) == 2
    assert any("output_rows is 3, the parts hold 20" in x for x in lines) and any("not complete" in x for x in lines)
    arr = tmp_path / "arr"
    for shard in ("0/2", "1/2"):
        assert cli("run", job, "--set", f"output.path={arr}", "--shard", shard).exit_code == 0
    assert cli("verify", arr).exit_code == 0
    flip_byte(part(arr / "shard-1-of-2", 0), 40)
    code, lines = verify_lines(arr)
    assert code == 1 and "shard-1-of-2/part-00000.parquet: damaged" in lines[0]
    refused = cli("merge", arr)
    assert refused.exit_code == 2 and "shard-1-of-2/part-00000.parquet is damaged" in refused.stderr
    assert cli("run", job, "--set", f"output.path={arr}", "--shard", "1/2").exit_code == 0  # repaired
    merged = cli("merge", arr)
    assert merged.exit_code == 0, merged.output
    assert read_rows(tmp_path / "arr-merged") == rows
    result = cli("verify", tmp_path / "arr-merged")
    assert result.exit_code == 0, result.output
