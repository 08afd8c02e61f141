"""The Kubernetes objects ``launcher=kubernetes`` submits: a Kubeflow Trainer ``TrainJob``, or the
training operator's ``PyTorchJob``, for ``launcher.nnodes`` pods of ``launcher.nproc_per_node``
workers each.

Every pod runs the same command: the run's resolved config (``PLAIT_RUN_CONFIG``, written to a
file) through ``plait train --config-dir``, so the pods train exactly the config that was
checked on the submitting machine. In the pod plait translates the operator's ``PET_*``
variables into its launcher settings (``kubernetes.launcher_from_operator``).

- ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``): ``spec.runtimeRef`` names the torch runtime
  (``launcher.runtime``, a ``ClusterTrainingRuntime``, default ``torch-distributed``), whose
  torch plugin sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` and the
  rendezvous at node 0 (``PET_MASTER_ADDR``, ``PET_MASTER_PORT``); ``spec.trainer`` holds the
  image, command, env, ``numNodes``, ``numProcPerNode`` and ``resourcesPerNode``; the volumes
  are a ``runtimePatches`` entry on the runtime's ``node`` job. It has no elastic policy.
- ``PyTorchJob`` (``kubeflow.org/v1``): a ``Master`` replica (the rendezvous: the operator
  sets ``PET_MASTER_ADDR`` to it) and ``nnodes - 1`` ``Worker`` replicas, ``spec.nprocPerNode``;
  for ``launcher.nnodes=MIN:MAX`` only ``Worker`` replicas (``MAX``) and ``spec.elasticPolicy``
  (``minReplicas``, ``maxReplicas``, ``rdzvBackend: c10d``, ``maxRestarts``), which the operator
  turns into ``PET_NNODES=MIN:MAX`` and ``PET_RDZV_ENDPOINT``.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from omegaconf import OmegaConf

TRAINJOB = "TrainJob"
PYTORCHJOB = "PyTorchJob"
# (group, version, plural) of each kind's custom resource
RESOURCES = {
    TRAINJOB: ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
    PYTORCHJOB: ("kubeflow.org", "v1", "pytorchjobs"),
}
# Writes the run's config where `plait train --config-dir` reads it, then becomes plait.
POD_COMMAND = [
    "/bin/sh",
    "-c",
    'dir="${TMPDIR:-/tmp}/plait" && mkdir -p "$dir" && printf "%s\\n" '
    '"$PLAIT_RUN_CONFIG" > "$dir/run.yaml" && exec plait train --config-dir "$dir" '
    "--config-name run",
]
PATCH_MANAGER = "plait"  # the owner of plait's runtimePatches entry


def job_name(cfg) -> str:
    """``launcher.job_name``, else ``run.name`` as a Kubernetes name (RFC 1035 label: lower case,
    digits and ``-``, a letter first, at most 40 characters so the pods' names stay in 63)."""
    if cfg.launcher.job_name:
        return cfg.launcher.job_name
    name = re.sub(r"[^a-z0-9-]+", "-", str(cfg.run.name).lower()).strip("-")
    if not name[:1].isalpha():
        name = f"plait-{name}"
    return name[:40].rstrip("-")


def pod_config(cfg) -> str:
    """The resolved config the pods train, as YAML (a pod never submits: ``dry_run`` off)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    config["launcher"]["dry_run"] = False
    return yaml.safe_dump(config, sort_keys=False)


def pod_env(cfg) -> list[dict[str, str]]:
    env = {
        "PLAIT_RUN_CONFIG": pod_config(cfg),
        **{str(k): str(v) for k, v in cfg.launcher.env.items()},
    }
    return [{"name": k, "value": v} for k, v in env.items()]


def resources(cfg) -> dict[str, dict[str, str]]:
    amounts = {str(k): str(v) for k, v in cfg.launcher.resources_per_node.items()}
    return {"limits": amounts, "requests": dict(amounts)} if amounts else {}


def volumes(cfg) -> tuple[list[dict], list[dict]]:
    """(pod volumes, container mounts): each persistent volume claim of ``launcher.volumes``
    mounted at its path (the data, and ``run.root`` for the checkpoints)."""
    claims = sorted(cfg.launcher.volumes.items())
    return (
        [
            {"name": f"volume-{i}", "persistentVolumeClaim": {"claimName": str(claim)}}
            for i, (claim, _) in enumerate(claims)
        ],
        [{"name": f"volume-{i}", "mountPath": str(path)} for i, (_, path) in enumerate(claims)],
    )


def trainjob(cfg, nnodes: int) -> dict[str, Any]:
    launcher = cfg.launcher
    trainer = {
        "image": launcher.image,
        "command": POD_COMMAND,
        "env": pod_env(cfg),
        "numNodes": nnodes,
        "numProcPerNode": launcher.nproc_per_node,
    }
    if resources(cfg):
        trainer["resourcesPerNode"] = resources(cfg)
    spec = {
        "runtimeRef": {
            "name": launcher.runtime,
            "kind": "ClusterTrainingRuntime",
            "apiGroup": RESOURCES[TRAINJOB][0],
        },
        "trainer": trainer,
    }
    pod_volumes, mounts = volumes(cfg)
    if pod_volumes:  # on the runtime's trainer job ("node") and its container ("node")
        pod = {"volumes": pod_volumes, "containers": [{"name": "node", "volumeMounts": mounts}]}
        spec["runtimePatches"] = [
            {
                "manager": PATCH_MANAGER,
                "trainingRuntimeSpec": {
                    "template": {
                        "spec": {
                            "replicatedJobs": [
                                {"name": "node", "template": {"spec": {"template": {"spec": pod}}}}
                            ]
                        }
                    }
                },
            }
        ]
    return {
        "apiVersion": "/".join(RESOURCES[TRAINJOB][:2]),
        "kind": TRAINJOB,
        "metadata": {"name": job_name(cfg), "namespace": launcher.namespace},
        "spec": spec,
    }


def pytorchjob(cfg, min_nodes: int, max_nodes: int) -> dict[str, Any]:
    launcher = cfg.launcher
    pod_volumes, mounts = volumes(cfg)
    container = {
        "name": "pytorch",
        "image": launcher.image,
        "command": POD_COMMAND,
        "env": pod_env(cfg),
    }
    if resources(cfg):
        container["resources"] = resources(cfg)
    if mounts:
        container["volumeMounts"] = mounts
    pod = {"containers": [container], **({"volumes": pod_volumes} if pod_volumes else {})}

    def replicas(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": pod}}

    spec: dict[str, Any] = {"nprocPerNode": str(launcher.nproc_per_node)}
    if min_nodes < max_nodes:  # only workers; the rendezvous is the elastic policy's
        spec["elasticPolicy"] = {
            "minReplicas": min_nodes,
            "maxReplicas": max_nodes,
            "rdzvBackend": "c10d",
            "maxRestarts": launcher.max_restarts,
        }
        spec["pytorchReplicaSpecs"] = {"Worker": replicas(max_nodes)}
    else:  # the Master replica is the rendezvous (MASTER_ADDR)
        spec["pytorchReplicaSpecs"] = {"Master": replicas(1)}
        if max_nodes > 1:
            spec["pytorchReplicaSpecs"]["Worker"] = replicas(max_nodes - 1)
    return {
        "apiVersion": "/".join(RESOURCES[PYTORCHJOB][:2]),
        "kind": PYTORCHJOB,
        "metadata": {"name": job_name(cfg), "namespace": launcher.namespace},
        "spec": spec,
    }


def job_manifest(cfg, dims, kind: str) -> dict[str, Any]:
    if kind == TRAINJOB:
        return trainjob(cfg, dims.nodes.max)
    return pytorchjob(cfg, dims.nodes.min, dims.nodes.max)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the run's config) as YAML literal blocks, readable in the manifest."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None
    ),
)


def to_yaml(manifest: dict[str, Any]) -> str:
    return yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, width=100)
