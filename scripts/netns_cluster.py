"""Several "nodes" on one machine: Linux network namespaces joined through a bridge, each
running one node of a multi-node plait job over its own address (needs root and iproute2).

    sudo python scripts/netns_cluster.py --nodes 2 --nproc-per-node 2 -- comm=hierarchical \\
        train.steps=20 tracker=none
    sudo python scripts/netns_cluster.py --nodes 2 --nproc-per-node 2 --rate 1gbit -- ...
    sudo python scripts/netns_cluster.py --nodes 2 --delay 5ms -- ...   # where the kernel has netem

It makes a "switch" namespace holding a bridge and, per node, a namespace with one end of a veth
pair (``eth<i>``-like name, address ``10.99.0.<i+1>/24``) whose other end is on the bridge; with
``--rate`` each node's link is limited by ``tc``'s ``tbf`` qdisc (inside a node the processes
talk over loopback: fast inside, slow between), with ``--delay`` it also gets a ``netem`` delay
(not every kernel has netem; the script says so and stops). Then it starts
``python -m plait train`` in every namespace as node ``i`` of an ``N x M`` job (torch elastic's
c10d rendezvous on node 0's address, gloo bound to the node's link), waits, and prints one JSON
object: each node's exit code and what its link carried (bytes and packets, from the veth
counters). Namespaces and processes are removed on success, on failure and on Ctrl-C; the exit
code is the first non-zero one of the nodes.

Nothing is changed outside the namespaces it creates (and their ``/etc/netns/<name>/`` files),
so several clusters can run at once.
Tests and ``scripts/bench_comm.py`` import :class:`Cluster`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.99.0"
PORT = 29500


@dataclass(frozen=True)
class Node:
    rank: int
    netns: str
    dev: str  # this node's end of its link (inside netns)
    addr: str


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def tc(netns: str, *args: str) -> None:
    done = subprocess.run(
        ["ip", "netns", "exec", netns, "tc", *args], capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"tc {' '.join(args)}: {done.stderr.strip()}")


def tbf_burst(rate: str) -> str:
    """A burst of 1 ms at ``rate``, at least 64 KiB (one segmentation-offloaded packet): small
    enough that a 1 MB message feels the rate."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    number = next(float(rate[: -len(u)]) * f for u, f in units.items() if rate.endswith(u))
    return f"{max(int(number / 8 / 1000), 64 * 1024)}b"


def can_make_namespaces() -> str | None:
    """None when this process can make namespaces, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    if subprocess.run(["which", "ip", "tc"], capture_output=True).returncode:
        return "needs iproute2 (ip, tc) to make network namespaces"
    probe = f"plait-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot make a network namespace here ({made.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Cluster:
    """``with Cluster(2, rate="1gbit") as cluster:`` N namespaces on a bridge, removed on exit."""

    def __init__(self, nodes: int, rate: str | None = None, delay: str | None = None):
        self.tag = uuid.uuid4().hex[:6]
        self.switch = f"plait-{self.tag}-sw"
        self.nodes = [
            Node(i, f"plait-{self.tag}-n{i}", f"pl{self.tag}n{i}", f"{SUBNET}.{i + 1}")
            for i in range(nodes)
        ]
        self.rate, self.delay = rate, delay
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Cluster:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        print(
            f"netns_cluster: namespaces {' '.join(n.netns for n in self.nodes)} on a bridge in "
            f"{self.switch}",
            file=sys.stderr,
            flush=True,
        )
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        self._name_the_nodes()
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes:
            peer = f"pl{self.tag}s{node.rank}"
            ip("netns", "add", node.netns)
            ip(
                "link",
                "add",
                node.dev,
                "netns",
                node.netns,
                "type",
                "veth",
                "peer",
                "name",
                peer,
                "netns",
                self.switch,
            )
            ip("-n", self.switch, "link", "set", peer, "master", "br0", "up")
            ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", node.dev)
            ip("-n", node.netns, "link", "set", node.dev, "up")
            ip("-n", node.netns, "link", "set", "lo", "up")
            self._shape(node)

    def _name_the_nodes(self) -> None:
        """Per-namespace ``hosts`` and ``resolv.conf`` (``ip netns exec`` mounts
        ``/etc/netns/<name>/*`` over ``/etc``): the nodes' addresses resolve from the file, and
        no name lookup waits for a DNS server the namespaces cannot reach (torch's rendezvous
        looks up every peer's name)."""
        hosts = f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n" + "".join(
            f"{n.addr} {n.netns}\n" for n in self.nodes
        )
        for node in self.nodes:
            config = Path("/etc/netns") / node.netns
            config.mkdir(parents=True, exist_ok=True)
            (config / "hosts").write_text(hosts)
            (config / "resolv.conf").write_text("# no DNS inside the cluster\n")

    def _shape(self, node: Node) -> None:
        """The node's outgoing traffic: netem delay (where it exists) and/or tbf rate."""
        parent = ["root"]
        if self.delay:
            try:
                tc(
                    node.netns,
                    "qdisc",
                    "add",
                    "dev",
                    node.dev,
                    "root",
                    "handle",
                    "1:",
                    "netem",
                    "delay",
                    self.delay,
                )
            except RuntimeError as e:
                raise RuntimeError(
                    f"--delay needs the kernel's netem qdisc, which this kernel "
                    f"lacks ({e}); leave out --delay (tbf's --rate works)"
                ) from e
            parent = ["parent", "1:1"]
        if self.rate:
            tc(
                node.netns,
                "qdisc",
                "add",
                "dev",
                node.dev,
                *parent,
                "handle",
                "10:",
                "tbf",
                "rate",
                self.rate,
                "burst",
                tbf_burst(self.rate),
                "latency",
                "100ms",
            )

    def popen(
        self, node: Node, argv: list[str], env: dict[str, str] | None = None, **kwargs
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace (its own session, so it can be killed)."""
        env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": node.dev,
            "PLAIT_LINK_DEV": node.dev,
            **(env or {}),
        }
        proc = subprocess.Popen(
            ["ip", "netns", "exec", node.netns, *argv], env=env, start_new_session=True, **kwargs
        )
        self.procs.append(proc)
        return proc

    def cut(self, node: Node) -> None:
        """Cut ``node`` off the others: its port on the bridge goes down (its own end stays up,
        so its processes see no error, only silence, as when a cable or switch port fails)."""
        ip("-n", self.switch, "link", "set", f"pl{self.tag}s{node.rank}", "down")

    def link_counters(self) -> list[dict[str, int]]:
        """Bytes and packets each node's link has sent and received so far (veth counters)."""
        counters = []
        for node in self.nodes:
            [link] = json.loads(ip("-n", node.netns, "-s", "-j", "link", "show", "dev", node.dev))
            stats = link["stats64"]
            counters.append(
                {
                    "tx_bytes": stats["tx"]["bytes"],
                    "rx_bytes": stats["rx"]["bytes"],
                    "tx_packets": stats["tx"]["packets"],
                    "rx_packets": stats["rx"]["packets"],
                }
            )
        return counters

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        for netns in [n.netns for n in self.nodes] + [self.switch]:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def train_command(
    cluster: Cluster,
    node: Node,
    nproc_per_node: int,
    overrides: list[str],
    nnodes: str | None = None,
) -> list[str]:
    """``plait train`` as node ``node`` of the cluster's job (``nnodes``: ``launcher.nnodes``,
    e.g. ``1:2`` for an elastic job; default the cluster's node count)."""
    job = [
        f"launcher.nnodes={nnodes or len(cluster.nodes)}",
        f"launcher.nproc_per_node={nproc_per_node}",
        f"launcher.node_rank={node.rank}",
        f"launcher.master_addr={cluster.nodes[0].addr}",
        f"launcher.master_port={PORT}",
        f"launcher.local_addr={node.addr}",
    ]
    if not any(o.startswith("run.name=") for o in overrides):
        job.append(f"run.name=netns-{cluster.tag}")
    return [sys.executable, "-m", "plait", "train", *job, *overrides]


def run_job(
    nodes: int,
    nproc_per_node: int,
    overrides: list[str],
    rate: str | None = None,
    delay: str | None = None,
    timeout: float = 1800,
) -> dict:
    """Train on a fresh cluster; each node's output goes to this process's stdout/stderr."""
    with Cluster(nodes, rate, delay) as cluster:
        before = cluster.link_counters()
        procs = [
            cluster.popen(node, train_command(cluster, node, nproc_per_node, overrides))
            for node in cluster.nodes
        ]
        deadline = time.monotonic() + timeout
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
            if codes[-1] != 0:  # one node failed: the others would wait for it forever
                break
        after = cluster.link_counters()
        return {
            "nodes": nodes,
            "nproc_per_node": nproc_per_node,
            "rate": rate,
            "delay": delay,
            "exit_codes": codes + [None] * (nodes - len(codes)),
            "links": [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)],
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--rate", help="tbf rate limit of each node's link, e.g. 1gbit")
    parser.add_argument("--delay", help="netem delay of each node's link, e.g. 5ms (needs netem)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole job")
    parser.add_argument("--json", type=Path, help="also write the summary to this file")
    parser.add_argument("overrides", nargs="*", help="plait train overrides (after --)")
    args = parser.parse_args(argv)
    reason = can_make_namespaces()
    if reason:
        print(f"netns_cluster: {reason}", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM unwind through Cluster.__exit__, which removes everything.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        summary = run_job(
            args.nodes, args.nproc_per_node, args.overrides, args.rate, args.delay, args.timeout
        )
    except KeyboardInterrupt:
        print("netns_cluster: interrupted; namespaces and processes removed", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"netns_cluster: {e}", file=sys.stderr)
        return 2
    text = json.dumps(summary)
    print(text, flush=True)
    if args.json:
        args.json.write_text(text + "\n")
    return next((c if c is not None else 124 for c in summary["exit_codes"] if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
