"""``launcher=kubernetes``: submit the run as a Kubeflow Trainer ``TrainJob`` (or the training
operator's ``PyTorchJob``), and in each of its pods start that node's workers.

    plait train launcher=kubernetes launcher.image=registry/plait:1.0 launcher.nnodes=2 \\
        launcher.nproc_per_node=4 launcher.namespace=team-a \\
        'launcher.resources_per_node={nvidia.com/gpu: 4, cpu: 32, memory: 256Gi}' \\
        'launcher.volumes={team-a-data: /data, team-a-runs: /runs}' run.root=/runs data.path=/data
    plait train launcher=kubernetes launcher.image=... launcher.dry_run=true  # print only

Which kind (``launcher.kind``): ``TrainJob`` or ``PyTorchJob`` as given; ``auto`` (the default)
takes a ``PyTorchJob`` for an elastic range (``launcher.nnodes=MIN:MAX``: only it has an elastic
policy), else a ``TrainJob``, unless the cluster serves the training operator's
``pytorchjobs.kubeflow.org`` and not Kubeflow Trainer's ``trainjobs.trainer.kubeflow.org`` (asked
at submit time; a dry run asks nothing and prints a ``TrainJob``). A ``TrainJob`` is created
through the Kubeflow SDK (``TrainerClient``'s Kubernetes backend: its kube config, in-cluster
config and client) after the SDK's API model has read it; a ``PyTorchJob`` through the
Kubernetes client. The manifests: ``manifests.py``.

In a pod the operator sets torchrun's ``PET_*`` variables; :func:`launcher_from_operator`
translates them into the local launcher's settings (nodes, processes, node rank, rendezvous
address and port), and the local launcher's torch elastic launch starts this node's workers, as
``plait train`` does on any machine. Under the pod's own ``torchrun`` (``LOCAL_RANK`` set: the
Kubeflow SDK's local process backend runs the job's function that way) the worker runs in place.

Refused before anything is submitted: no ``launcher.image``; an elastic range with a
``TrainJob`` (Kubeflow Trainer's torch plugin has no elastic policy); a ``launcher.job_name``
Kubernetes does not take; several nodes whose ``run.root`` lies on no mounted volume (their
checkpoints must meet in one directory); for a real submit: no Kubernetes credentials, an
unknown ``launcher.namespace``, and a cluster that serves neither kind.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Mapping, Optional

from omegaconf import OmegaConf

from plait import hookimpl
from plait.config import AT_LEAST_0, LauncherConfig, range_problems
from plait.forkserver import START_METHODS
from plait.plugins import launch as local_launcher
from plait.plugins.launch.manifests import PYTORCHJOB, RESOURCES, TRAINJOB, job_manifest, to_yaml
from plait.types import PluginInfo

KINDS = ("auto", TRAINJOB, PYTORCHJOB)
JOB_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")


def open_dict() -> Any:
    """A mapping setting that takes keys of the user's (as launcher=local's ``rdzv_conf``)."""
    return OmegaConf.create({}, flags={"struct": False})


@dataclass
class KubernetesLauncherConfig(LauncherConfig):
    name: str = "kubernetes"
    kind: str = "auto"  # auto | TrainJob | PyTorchJob
    dry_run: bool = False  # print the manifest (and write it beside config.yaml), submit nothing
    image: Optional[str] = None  # the container image: plait and its dependencies installed
    namespace: Optional[str] = None  # None: the kube config context's, else "default"
    job_name: Optional[str] = None  # None: run.name as a Kubernetes name
    runtime: str = "torch-distributed"  # TrainJob: the ClusterTrainingRuntime it runs on
    # per pod, Kubernetes resource names: {cpu: 8, memory: 64Gi, nvidia.com/gpu: 4}
    resources_per_node: Any = field(default_factory=open_dict)
    # persistent volume claims to mount, {claim: path}: the data, and run.root for checkpoints
    volumes: Any = field(default_factory=open_dict)
    env: Any = field(default_factory=open_dict)  # more variables for every pod
    max_restarts: int = 0  # torch elastic restarts of a pod's workers (PyTorchJob elastic: also
    # elasticPolicy.maxRestarts)
    start_method: str = "forkserver"  # in the pod, as launcher=local's


RANGES = {"max_restarts": AT_LEAST_0}


@hookimpl
def plait_declare() -> PluginInfo:
    return PluginInfo(
        name="kubernetes_launcher",
        selected_by={"launcher.name": "kubernetes"},
        description="submit a Kubeflow TrainJob (or PyTorchJob); in its pods, "
        "start each node's workers from the operator's PET_ variables",
    )


@hookimpl
def plait_register_configs(config_store) -> None:
    config_store.store(group="launcher", name="base_kubernetes", node=KubernetesLauncherConfig)


def in_job(environ: Mapping[str, str]) -> bool:
    """In a pod of the job (the operator set ``PET_NNODES``) or a worker torchrun started."""
    return "PET_NNODES" in environ or "LOCAL_RANK" in environ


@hookimpl
def plait_validate(cfg, dims) -> list[str]:
    launcher = cfg.launcher
    problems = range_problems("launcher", launcher, RANGES)
    if launcher.kind not in KINDS:
        problems.append(f"launcher.kind={launcher.kind}: choose one of {', '.join(KINDS)}")
    if launcher.start_method not in START_METHODS:
        problems.append(
            f"launcher.start_method={launcher.start_method}: choose one of "
            f"{', '.join(START_METHODS)}"
        )
    if in_job(os.environ):
        return problems
    if not launcher.image:
        problems.append(
            "launcher=kubernetes needs launcher.image=<the container image the pods "
            "run, with plait installed> (e.g. launcher.image=registry/plait:1.0)"
        )
    if launcher.job_name and not JOB_NAME.fullmatch(launcher.job_name):
        problems.append(
            f"launcher.job_name={launcher.job_name}: Kubernetes takes lower-case "
            "letters, digits and '-', a letter first, at most 40 characters"
        )
    reserved = sorted(str(k) for k in launcher.env if str(k).startswith("PET_"))
    if reserved:
        problems.append(
            f"launcher.env sets {', '.join(reserved)}: the operator sets torchrun's "
            "PET_ variables in every pod (Kubeflow Trainer refuses a TrainJob that "
            "sets them); give the launcher's settings instead (launcher.nnodes, ...)"
        )
    if dims.nodes.elastic and launcher.kind == TRAINJOB:
        problems.append(
            f"launcher.nnodes={launcher.nnodes} with launcher.kind=TrainJob: a TrainJob has no "
            "elastic policy (Kubeflow Trainer's torch plugin runs a fixed node count until "
            "JobSet supports elastic jobs); give a fixed launcher.nnodes, or launcher.kind="
            "PyTorchJob (its elasticPolicy takes the range)"
        )
    if dims.nodes.max > 1 and not on_a_volume(cfg.run.root, launcher.volumes.values()):
        problems.append(
            f"launcher.nnodes={launcher.nnodes}: every pod writes its checkpoints into run.root="
            f"{cfg.run.root}, which lies on none of launcher.volumes: mount a shared volume "
            "(launcher.volumes={<claim>: /runs}) and set run.root=/runs"
        )
    if not problems and not launcher.dry_run:
        problems += cluster_problems(cfg, dims)
    return problems


def on_a_volume(root: str, mount_paths) -> bool:
    path = PurePosixPath(root)
    return path.is_absolute() and any(
        path.is_relative_to(PurePosixPath(str(mount))) for mount in mount_paths
    )


def cluster_problems(cfg, dims) -> list[str]:
    """For a real submit: credentials, the namespace, and a kind the cluster serves."""
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException
    from kubernetes.config.config_exception import ConfigException

    try:
        if "KUBERNETES_SERVICE_HOST" in os.environ:
            config.load_incluster_config()
        else:
            config.load_kube_config(config_file=kube_config_file())
    except (ConfigException, OSError, TypeError) as error:
        return [
            f"launcher=kubernetes found no Kubernetes credentials ({error}): point KUBECONFIG "
            "at a kube config for the cluster (or run in a pod), or set launcher.dry_run=true "
            "to print the manifest without submitting"
        ]
    namespace = target_namespace(cfg)
    try:
        client.CoreV1Api().read_namespace(namespace, _request_timeout=10)
    except ApiException as error:
        if error.status == 404:
            return [
                f"launcher.namespace={namespace}: the cluster has no such namespace: create it "
                "(kubectl create namespace) or name one that exists"
            ]
        if error.status != 403:  # allowed to submit without reading namespaces: go on
            return [
                f"launcher.namespace={namespace}: the cluster refused to say whether it "
                f"exists ({error.status} {error.reason})"
            ]
    except Exception as error:  # noqa: BLE001 - connection refused, TLS, DNS: all unreachable
        return [
            f"launcher=kubernetes: the cluster's API server does not answer ({error}): check "
            "the kube config's server, or set launcher.dry_run=true"
        ]
    kind = served_kind(cfg, dims)
    if kind is None:
        return [
            "launcher=kubernetes: the cluster serves neither Kubeflow Trainer's TrainJob "
            "(trainjobs.trainer.kubeflow.org) nor the training operator's PyTorchJob "
            "(pytorchjobs.kubeflow.org): install one of them, or set launcher.dry_run=true"
        ]
    if dims.nodes.elastic and kind == TRAINJOB:
        return [
            f"launcher.nnodes={cfg.launcher.nnodes}: the cluster serves only TrainJob, which "
            "has no elastic policy: give a fixed launcher.nnodes"
        ]
    return []


def kube_config_file() -> str | None:
    """``KUBECONFIG`` as it is now (the Kubernetes client reads it once, when imported)."""
    return os.environ.get("KUBECONFIG")


def target_namespace(cfg) -> str:
    """``launcher.namespace``, else the current kube config context's namespace, else
    ``default`` (as kubectl)."""
    if cfg.launcher.namespace:
        return cfg.launcher.namespace
    from kubernetes import config

    try:
        _, current = config.list_kube_config_contexts(config_file=kube_config_file())
        return current["context"].get("namespace") or "default"
    except Exception:  # noqa: BLE001 - in a pod, or no contexts: kubectl's default
        return "default"


def served_kind(cfg, dims) -> str | None:
    """``launcher.kind``, or for ``auto`` the kind plait takes among those the cluster serves."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    def served(kind: str) -> bool:
        group, _, plural = RESOURCES[kind]
        try:
            client.ApiextensionsV1Api().read_custom_resource_definition(
                f"{plural}.{group}", _request_timeout=10
            )
            return True
        except ApiException as error:
            return error.status == 403  # may not read CRDs: assume it is there

    if cfg.launcher.kind != "auto":
        return cfg.launcher.kind if served(cfg.launcher.kind) else None
    order = (PYTORCHJOB, TRAINJOB) if dims.nodes.elastic else (TRAINJOB, PYTORCHJOB)
    return next((kind for kind in order if served(kind)), None)


def chosen_kind(cfg, dims, ask_cluster: bool) -> str:
    if cfg.launcher.kind != "auto":
        return cfg.launcher.kind
    if ask_cluster:
        return served_kind(cfg, dims)
    return PYTORCHJOB if dims.nodes.elastic else TRAINJOB


def launcher_from_operator(environ: Mapping[str, str]) -> dict[str, Any]:
    """The local launcher's settings from the variables the operator gives torchrun in a pod.

    ``PET_NNODES`` (``N``, or ``MIN:MAX`` under a PyTorchJob's elastic policy) and
    ``PET_NPROC_PER_NODE``; the rendezvous: ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` (node 0's
    pod), or ``PET_RDZV_ENDPOINT`` in an elastic job; the node rank: ``PET_NODE_RANK`` (a
    TrainJob's job completion index, a PyTorchJob's replica index), absent in an elastic job,
    where it only decides which pod hosts the rendezvous store (the pod the endpoint names).
    """
    if "PET_RDZV_ENDPOINT" in environ:
        host, _, port = environ["PET_RDZV_ENDPOINT"].rpartition(":")
    else:
        host, port = environ["PET_MASTER_ADDR"], environ["PET_MASTER_PORT"]
    if "PET_NODE_RANK" in environ:
        node_rank = int(environ["PET_NODE_RANK"])
    else:
        node_rank = 0 if host.split(".")[0] == socket.gethostname().split(".")[0] else 1
    return {
        "nnodes": environ["PET_NNODES"],
        "nproc_per_node": int(environ["PET_NPROC_PER_NODE"]),
        "node_rank": node_rank,
        "master_addr": host,
        "master_port": int(port),
    }


@hookimpl
def plait_launch(cfg, dims, entrypoint, args, hook) -> dict[int, Any]:
    if "LOCAL_RANK" in os.environ:  # a worker the pod's torchrun started
        return {int(os.environ["RANK"]): entrypoint(*args)}
    if "PET_NNODES" in os.environ:
        return launch_pod(cfg, dims, entrypoint, args, hook)
    launcher = cfg.launcher
    kind = chosen_kind(cfg, dims, ask_cluster=not launcher.dry_run)
    manifest = job_manifest(cfg, dims, kind)
    if not launcher.dry_run:
        manifest["metadata"]["namespace"] = target_namespace(cfg)
    elif launcher.namespace is None:
        del manifest["metadata"]["namespace"]  # kubectl apply: the context's namespace
    if kind == TRAINJOB:
        read_by_the_sdk(manifest)
    text = to_yaml(manifest)
    written = os.path.join(cfg.run.dir, f"{kind.lower()}.yaml")
    with open(written, "w") as out:
        out.write(text)
    if launcher.dry_run:
        print(text, end="", flush=True)
        print(
            f"plait: dry run: this {kind} was not submitted (also in {written})",
            file=sys.stderr,
            flush=True,
        )
        return {}
    submit(manifest, kind)
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    print(
        f"plait: submitted {kind} {namespace}/{name} ({written}); the run goes on in the "
        f"cluster: kubectl -n {namespace} get {RESOURCES[kind][2]} {name}",
        flush=True,
    )
    return {}


def read_by_the_sdk(manifest: dict[str, Any]) -> None:
    """The Kubeflow SDK's API model of a TrainJob reads the manifest (a field it does not
    know, or of the wrong type, raises) where the SDK is installed."""
    try:
        from kubeflow_trainer_api import models
    except ImportError:
        return
    models.TrainerV1alpha1TrainJob.from_dict(manifest)


def submit(manifest: dict[str, Any], kind: str) -> None:
    group, version, plural = RESOURCES[kind]
    namespace = manifest["metadata"]["namespace"]
    if kind == TRAINJOB:  # the Kubeflow SDK's Kubernetes backend: its config and client
        from kubeflow.common.types import KubernetesBackendConfig
        from kubeflow.trainer import TrainerClient

        api = TrainerClient(
            backend_config=KubernetesBackendConfig(
                namespace=namespace, config_file=kube_config_file()
            )
        ).backend.custom_api
    else:
        from kubernetes import client

        api = client.CustomObjectsApi()
    api.create_namespaced_custom_object(group, version, namespace, plural, manifest)


def launch_pod(cfg, dims, entrypoint, args, hook) -> dict[int, Any]:
    """This pod's node of the job: the operator's variables as the local launcher's settings,
    checked against the plan, then the local launcher's torch elastic launch."""
    given = launcher_from_operator(os.environ)
    planned = {"nnodes": str(cfg.launcher.nnodes), "nproc_per_node": cfg.launcher.nproc_per_node}
    if {k: str(given[k]) for k in planned} != {k: str(v) for k, v in planned.items()}:
        raise ValueError(
            f"the operator started this pod with PET_NNODES={given['nnodes']} and "
            f"PET_NPROC_PER_NODE={given['nproc_per_node']}, but the run was planned "
            f"for launcher.nnodes={cfg.launcher.nnodes} and launcher.nproc_per_node="
            f"{cfg.launcher.nproc_per_node}: submit it again with plait"
        )
    if dims.nodes.max == 1:  # one pod: a rendezvous of its own (torchrun --standalone)
        given.update(master_addr="127.0.0.1", master_port=0)
    local = OmegaConf.structured(
        local_launcher.LocalLauncherConfig(
            nproc_per_node=cfg.launcher.nproc_per_node,
            nnodes=cfg.launcher.nnodes,
            timeout_s=cfg.launcher.timeout_s,
            node_rank=given["node_rank"],
            master_addr=given["master_addr"],
            master_port=given["master_port"],
            max_restarts=cfg.launcher.max_restarts,
            start_method=cfg.launcher.start_method,
        )
    )
    node_cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    node_cfg.launcher = local
    return local_launcher.plait_launch(
        cfg=node_cfg, dims=dims, entrypoint=entrypoint, args=args, hook=hook
    )
