"""``launcher=kubernetes`` as far as this machine allows: no Kubernetes cluster runs here, so
nothing is submitted to one. What runs for real:

- the dry run's manifests, validated with ``jsonschema`` against the custom resource
  definitions of Kubeflow Trainer v2.3.0 (``TrainJob``) and of the training operator v1.9.4
  (``PyTorchJob``). Neither the Kubeflow SDK nor any operator package on PyPI ships the CRDs
  (the SDK ships API models, which read the TrainJob too), so the upstream files are vendored in
  ``tests/data/crds/`` (gzipped, byte for byte: kubeflow/trainer at tags v2.3.0 and v1.9.4,
  ``manifests/base/crds/``). A manifest without its rendezvous (``spec.runtimeRef``, the torch
  runtime whose plugin sets ``PET_MASTER_ADDR``/``PET_MASTER_PORT``) fails that validation;
- the manifest's own container command, run as two "pods" (two processes) with the variables
  Kubeflow Trainer's torch plugin sets in each (``PET_NNODES``, ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``): plait translates them and trains
  like the local launcher;
- a TrainJob through the Kubeflow SDK's local process backend (``TrainerClient`` with
  ``LocalProcessBackendConfig``), which runs the job as ``torchrun`` in a fresh virtual
  environment with the operator's variables: 2 processes train like the local launcher. The
  backend installs the job's packages into that environment; here it installs only torch's
  ``torchrun`` entry point (``tests/data/torchrun_entry``, no download) and the job imports
  torch and plait from this environment (``PYTHONPATH``).

Skipped, with the reason, where the Kubeflow SDK or jsonschema is not installed
(``pip install -e ".[kubernetes]"``; scripts/setup.sh installs them).
"""

from __future__ import annotations

import gzip
import os
import shutil
import signal
import site
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from plait.cli import main
from plait.plugins.launch.kubernetes import launcher_from_operator
from plait.testing import TEST_OVERRIDES, free_port, read_metrics, run_losses

jsonschema = pytest.importorskip("jsonschema", reason="pip install -e '.[kubernetes]'")
pytest.importorskip("kubeflow.trainer", reason="the Kubeflow SDK: pip install -e '.[kubernetes]'")

DATA = Path(__file__).parent / "data"
STEPS = ["train.steps=3", "optimizer.decay_steps=3"]
IMAGE = "launcher.image=registry.example/plait:1.0"


def crd_schema(name: str) -> dict:
    crd = yaml.safe_load(gzip.open(DATA / "crds" / name).read())
    [version] = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return version["schema"]["openAPIV3Schema"]


TRAINJOB_SCHEMA = "trainer.kubeflow.org_trainjobs.v2.3.0.yaml.gz"
PYTORCHJOB_SCHEMA = "kubeflow.org_pytorchjobs.v1.9.4.yaml.gz"


def dry_run(tmp_path: Path, capsys, *overrides: str) -> tuple[dict, str]:
    """``plait train launcher=kubernetes launcher.dry_run=true ...``: the manifest it wrote
    beside the run's config, and what it printed."""
    code = main(
        [
            "train",
            *TEST_OVERRIDES,
            "launcher=kubernetes",
            IMAGE,
            "launcher.dry_run=true",
            f"run.root={tmp_path}",
            "run.name=job",
            *overrides,
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    [written] = (tmp_path / "job").glob("*job.yaml")
    text = written.read_text()
    assert out.out.startswith(text)  # printed as written
    return yaml.safe_load(text), out.err


def test_dry_run_of_2_nodes_x_4_processes_is_a_trainjob_its_crd_accepts(tmp_path, capsys):
    manifest, err = dry_run(
        tmp_path,
        capsys,
        "launcher.nnodes=2",
        "launcher.nproc_per_node=4",
        "launcher.namespace=team-a",
        f"run.root={tmp_path}",
        f"launcher.volumes={{runs: {tmp_path}, data: /data}}",
        "launcher.resources_per_node={cpu: 4, memory: 8Gi}",
    )
    assert "this TrainJob was not submitted" in err
    jsonschema.validate(manifest, crd_schema(TRAINJOB_SCHEMA))
    from kubeflow_trainer_api import models

    models.TrainerV1alpha1TrainJob.from_dict(manifest)  # the SDK's API model reads it too
    trainer = manifest["spec"]["trainer"]
    assert (manifest["kind"], manifest["metadata"]) == (
        "TrainJob",
        {"name": "job", "namespace": "team-a"},
    )
    assert manifest["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 4)
    assert trainer["image"] == "registry.example/plait:1.0"
    assert trainer["resourcesPerNode"]["limits"] == {"cpu": "4", "memory": "8Gi"}
    config = yaml.safe_load(trainer["env"][0]["value"])  # the run every pod trains
    assert config["launcher"]["nnodes"] == 2 and config["launcher"]["dry_run"] is False
    [patch] = manifest["spec"]["runtimePatches"]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"
    ]["spec"]
    assert {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]} == {"runs", "data"}
    assert {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]} == {
        str(tmp_path),
        "/data",
    }
    # without its rendezvous (the torch runtime the TrainJob runs on) the CRD refuses it
    del manifest["spec"]["runtimeRef"]
    with pytest.raises(jsonschema.ValidationError, match="'runtimeRef' is a required property"):
        jsonschema.validate(manifest, crd_schema(TRAINJOB_SCHEMA))


def test_an_elastic_range_becomes_a_pytorchjobs_elastic_policy(tmp_path, capsys):
    manifest, _ = dry_run(
        tmp_path,
        capsys,
        "launcher.nnodes=1:2",
        "launcher.max_restarts=2",
        "launcher.nproc_per_node=4",
        f"run.root={tmp_path}",
        f"launcher.volumes={{runs: {tmp_path}}}",
    )
    jsonschema.validate(manifest, crd_schema(PYTORCHJOB_SCHEMA))
    assert manifest["kind"] == "PyTorchJob" and "namespace" not in manifest["metadata"]
    assert manifest["spec"]["elasticPolicy"] == {
        "minReplicas": 1,
        "maxReplicas": 2,
        "rdzvBackend": "c10d",
        "maxRestarts": 2,
    }
    assert manifest["spec"]["nprocPerNode"] == "4"
    assert manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    fixed, _ = dry_run(
        tmp_path / "fixed",
        capsys,
        "launcher.kind=PyTorchJob",
        "launcher.nnodes=2",
        f"run.root={tmp_path}/fixed",
        f"launcher.volumes={{runs: {tmp_path}}}",
    )
    jsonschema.validate(fixed, crd_schema(PYTORCHJOB_SCHEMA))
    assert {k: v["replicas"] for k, v in fixed["spec"]["pytorchReplicaSpecs"].items()} == {
        "Master": 1,
        "Worker": 1,
    }


def test_a_submit_creates_what_the_dry_run_wrote_as_the_kind_the_cluster_serves(
    tmp_path, capsys, monkeypatch
):
    """Against tests/fake_kube_api.py's stand-in for an API server (none can run here): the
    TrainJob is created through the Kubeflow SDK's client exactly as the manifest plait wrote,
    and where the cluster serves only the training operator, ``launcher.kind=auto`` takes a
    PyTorchJob."""
    from fake_kube_api import FakeKubeApi

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    run = [
        "train",
        *TEST_OVERRIDES,
        "launcher=kubernetes",
        IMAGE,
        "launcher.namespace=team-a",
        f"run.root={tmp_path}",
    ]
    with FakeKubeApi(
        namespaces={"team-a"}, crds={"trainjobs.trainer.kubeflow.org", "pytorchjobs.kubeflow.org"}
    ) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kube_config(tmp_path)))
        assert main([*run, "run.name=both"]) == 0
        assert "plait: submitted TrainJob team-a/both" in capsys.readouterr().out
        api.crds = {"pytorchjobs.kubeflow.org"}
        assert main([*run, "run.name=operator-only"]) == 0
    [(trainjobs, trainjob), (pytorchjobs, pytorchjob)] = api.created
    assert trainjobs == "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs"
    assert trainjob == yaml.safe_load((tmp_path / "both" / "trainjob.yaml").read_text())
    assert pytorchjobs == "/apis/kubeflow.org/v1/namespaces/team-a/pytorchjobs"
    assert pytorchjob["metadata"] == {"name": "operator-only", "namespace": "team-a"}
    jsonschema.validate(pytorchjob, crd_schema(PYTORCHJOB_SCHEMA))


def test_the_operators_variables_become_the_launchers_settings():
    trainjob = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "4",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "job-node-0-0.job",
        "PET_MASTER_PORT": "29400",
    }
    assert launcher_from_operator(trainjob) == {
        "nnodes": "2",
        "nproc_per_node": 4,
        "node_rank": 1,
        "master_addr": "job-node-0-0.job",
        "master_port": 29400,
    }
    elastic = {
        "PET_NNODES": "1:3",
        "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_ENDPOINT": "job-worker-0:23456",
        "PET_RDZV_BACKEND": "c10d",
    }
    assert launcher_from_operator(elastic) == {
        "nnodes": "1:3",
        "nproc_per_node": 2,
        "node_rank": 1,
        "master_addr": "job-worker-0",
        "master_port": 23456,
    }


@pytest.fixture
def short_tmp():
    """A directory with a short path, for the pods' ``TMPDIR``: multiprocessing's forkserver
    puts its socket there, and a UNIX socket's path has at most 107 bytes (a pytest-xdist
    worker's ``tmp_path`` is too long for it), as a pod's ``/tmp`` has."""
    path = Path(tempfile.mkdtemp(prefix="pods-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def pod_env(
    manifest: dict, node_rank: int, nnodes: int, nproc: int, port: int, tmp: Path
) -> dict[str, str]:
    """A pod's environment: the TrainJob's own variables, and what Kubeflow Trainer's torch
    plugin adds (pkg/runtime/framework/plugins/torch/torch.go: the node count, processes per
    node, the job completion index as node rank, node 0's pod as master)."""
    own = {e["name"]: e["value"] for e in manifest["spec"]["trainer"]["env"]}
    return {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "DS_ACCELERATOR": "cpu",
        "TMPDIR": str(tmp / f"pod{node_rank}"),  # short: forkserver's socket lives in it
        **own,
        "PET_NNODES": str(nnodes),
        "PET_NPROC_PER_NODE": str(nproc),
        "PET_NODE_RANK": str(node_rank),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
    }


@pytest.mark.slow
def test_the_manifests_command_in_two_pods_trains_like_the_local_launcher(
    tmp_path, capsys, short_tmp
):
    reference = run_losses(tmp_path / "local", [*STEPS, "launcher.nproc_per_node=2"])
    manifest, _ = dry_run(
        tmp_path,
        capsys,
        *STEPS,
        "launcher.nnodes=2",
        "launcher.nproc_per_node=1",
        f"run.root={tmp_path}",
        f"launcher.volumes={{runs: {tmp_path}}}",
    )
    shutil.rmtree(tmp_path / "job")  # the pods write the run
    port = free_port()
    pods = []
    try:
        for node_rank in range(2):
            env = pod_env(manifest, node_rank, nnodes=2, nproc=1, port=port, tmp=short_tmp)
            Path(env["TMPDIR"]).mkdir()
            pods.append(
                subprocess.Popen(
                    manifest["spec"]["trainer"]["command"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        for pod in pods:
            out, _ = pod.communicate(timeout=240)
            assert pod.returncode == 0, out[-3000:]
    finally:
        for pod in pods:  # a pod that hangs takes its workers with it
            if pod.poll() is None:
                os.killpg(pod.pid, signal.SIGKILL)
                pod.wait()
    losses = [m["loss"] for m in read_metrics(tmp_path / "job")]
    assert losses == pytest.approx(reference, rel=1e-5)


def packages_but_pip(site_dir: str, tmp_path: Path) -> Path:
    """This environment's packages (links) without pip: the job's fresh environment finds torch
    and its requirements installed (nothing is downloaded) and still gets a pip of its own
    (``ensurepip`` installs none where one is importable), which installs into it."""
    linked = tmp_path / "site"
    linked.mkdir()
    for entry in Path(site_dir).iterdir():
        if entry.name != "pip" and not entry.name.startswith(("pip-", "__editable__")):
            (linked / entry.name).symlink_to(entry)
    return linked


def plait_node(parameters):
    """The TrainJob's function: the Kubeflow SDK writes its source into the job's file and
    calls it with ``func_args`` in every process ``torchrun`` starts."""
    import site

    site.addsitedir(parameters["site"])  # plait's environment, its editable install included
    from omegaconf import OmegaConf

    from plait import api

    api.train_config(OmegaConf.load(parameters["config"]))


@pytest.mark.slow
def test_a_trainjob_through_the_kubeflow_sdks_local_process_backend_trains_like_the_local_launcher(
    tmp_path, capsys
):
    from kubeflow.trainer import CustomTrainer, LocalProcessBackendConfig, TrainerClient

    reference = run_losses(tmp_path / "local", [*STEPS, "launcher.nproc_per_node=2"])
    manifest, _ = dry_run(tmp_path, capsys, *STEPS, "launcher.nproc_per_node=2")
    config = tmp_path / "run.yaml"
    config.write_text(manifest["spec"]["trainer"]["env"][0]["value"])
    shutil.rmtree(tmp_path / "job")
    entry = shutil.copytree(DATA / "torchrun_entry", tmp_path / "torchrun_entry")
    our_site = site.getsitepackages()[0]
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": str(packages_but_pip(our_site, tmp_path)),
        # build the entry point with this environment's setuptools, from no index
        "PIP_NO_BUILD_ISOLATION": "0",
        "PIP_NO_INDEX": "1",
        # what Kubeflow Trainer's torch plugin sets for a 1-node x 2-process TrainJob
        "PET_NNODES": "1",
        "PET_NPROC_PER_NODE": "2",
        "PET_NODE_RANK": "0",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(free_port()),
    }
    client = TrainerClient(backend_config=LocalProcessBackendConfig(cleanup_venv=True))
    name = client.train(
        runtime="torch-distributed",
        trainer=CustomTrainer(
            func=plait_node,
            func_args={"config": str(config), "site": our_site},
            packages_to_install=[f"plait-test-torchrun-entry @ {entry.as_uri()}"],
            env=env,
        ),
    )
    job = client.wait_for_job_status(
        name, status={"Complete", "Failed"}, timeout=480, polling_interval=2
    )
    logs = "".join(client.get_job_logs(name))
    assert job.status == "Complete", logs[-4000:]
    assert "on 2 process(es)" in logs
    losses = [m["loss"] for m in read_metrics(tmp_path / "job")]
    assert losses == pytest.approx(reference, rel=1e-5)
