"""jobs/slurm_array.sh as Slurm reads it: no GPU asked for (a CPU-only cluster refuses a gres it lacks), no log
folder a fresh clone does not have (Slurm opens --output before the script runs; a missing folder fails every
task with no log at all), the SIGTERM warning before the time limit, CPUs and memory set; and the Kubernetes
example manifest next to it sets what `--shard auto` reads there. The real submission is `make test-cluster`."""

import os
import re
import shlex
import subprocess

import yaml
from test_job_fakes import REPO

SCRIPT = os.path.join(REPO, "jobs", "slurm_array.sh")


def sbatch_options(path=SCRIPT):
    """{option: value} of the #SBATCH lines (sbatch stops reading them at the first command)."""
    options = {}
    with open(path) as f:
        for line in f:
            if line.startswith("#SBATCH"):
                name, _, value = line[len("#SBATCH"):].strip().partition("=")
                options[name] = value
            elif line.strip() and not line.startswith("#"):
                break
    return options


def tracked_folders():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return {os.path.dirname(f) for f in files} | {""}


def test_no_gpu_request_and_no_folder_to_create():
    options = sbatch_options()
    assert not any(name in ("--gres", "--gpus", "--gpus-per-task", "-G") for name in options), options
    for name in ("--output", "--error"):
        if name in options:
            folder = os.path.dirname(options[name])
            assert "%" not in folder and folder in tracked_folders(), f"{name}={options[name]} needs {folder}/"


def test_resources_and_the_time_limit_warning():
    options = sbatch_options()
    assert int(options["--cpus-per-task"]) >= 1
    assert re.fullmatch(r"\d+[GM]", options["--mem"])
    assert re.fullmatch(r"B:TERM@\d+", options["--signal"])  # to the batch shell, which execs batchrun
    assert re.fullmatch(r"\d+-\d+", options["--array"])


def test_the_gpu_form_is_documented_beside_it():
    with open(SCRIPT) as f:
        text = f.read()
    gpu = [line for line in text.splitlines() if "sbatch --gres=gpu:1" in line]
    assert gpu and "jobs/slurm_array.sh" in gpu[0]
    assert "exec $BATCHRUN run" in text and "--shard auto" in text


def test_the_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0


def test_without_batchrun_it_says_so(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", SCRIPT, "jobs/example.yaml"], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "no batchrun: run make setup" in proc.stderr


def test_kubernetes_indexed_job_manifest():
    with open(os.path.join(REPO, "jobs", "k8s_indexed_job.yaml")) as f:
        job = yaml.safe_load(f)
    spec = job["spec"]
    assert job["kind"] == "Job" and spec["completionMode"] == "Indexed"
    container = spec["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container.get("env", [])}
    assert env["BATCHRUN_SHARD_COUNT"]["value"] == str(spec["completions"])  # the count the pods cannot see
    command = shlex.join(container["command"] + container.get("args", []))
    assert "--shard auto" in command
    assert spec["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
