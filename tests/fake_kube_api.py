"""A stand-in for a Kubernetes API server, for the tests of what ``launcher=kubernetes`` asks a
cluster before and while it submits: no API server can run here (no kube-apiserver, no etcd,
no cluster). It answers the few requests plait and the Kubeflow SDK make, over real HTTP, to the
real Kubernetes client reading a real kube config: a namespace by name, a custom resource
definition by name, and the creation of a custom object (recorded, not run).

    with FakeKubeApi(namespaces={"team-a"}, crds={"trainjobs.trainer.kubeflow.org"}) as api:
        env["KUBECONFIG"] = str(api.kube_config(tmp_path))
        ... api.created  # [(path, body), ...]
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml


class FakeKubeApi:
    def __init__(self, namespaces: set[str], crds: set[str]):
        self.namespaces, self.crds = namespaces, crds
        self.created: list[tuple[str, dict]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeKubeApi:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kube_config(self, directory: Path, namespace: str = "default") -> Path:
        server = f"http://127.0.0.1:{self.server.server_address[1]}"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": server}}],
            "users": [{"name": "test", "user": {"token": "test"}}],
            "contexts": [
                {
                    "name": "test",
                    "context": {"cluster": "test", "user": "test", "namespace": namespace},
                }
            ],
        }
        path = directory / "kubeconfig"
        path.write_text(yaml.safe_dump(config))
        return path

    def _handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _not_found(self) -> None:
                self._answer(
                    404,
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "reason": "NotFound",
                        "code": 404,
                    },
                )

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                namespace = re.fullmatch(r"/api/v1/namespaces/([^/]+)", path)
                crd = re.fullmatch(
                    r"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                    r"([^/]+)",
                    path,
                )
                if namespace and namespace[1] in api.namespaces:
                    self._answer(
                        200,
                        {
                            "kind": "Namespace",
                            "apiVersion": "v1",
                            "metadata": {"name": namespace[1]},
                        },
                    )
                elif crd and crd[1] in api.crds:
                    plural, group = crd[1].split(".", 1)
                    self._answer(
                        200,
                        {
                            "kind": "CustomResourceDefinition",
                            "apiVersion": "apiextensions.k8s.io/v1",
                            "metadata": {"name": crd[1]},
                            "spec": {
                                "group": group,
                                "scope": "Namespaced",
                                "names": {"plural": plural, "kind": plural},
                                "versions": [],
                            },
                        },
                    )
                else:
                    self._not_found()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.created.append((self.path.split("?")[0], body))
                self._answer(201, body)

        return Handler
