"""Gradient all-reduce between "nodes" made of network namespaces (``scripts/netns_cluster.py``;
needs root): flat, ring, hierarchical and hierarchical+fp16, each through plait's reducer.

    sudo DS_ACCELERATOR=cpu python scripts/bench_comm.py --rates 1gbit 200mbit
    sudo DS_ACCELERATOR=cpu python scripts/bench_comm.py --sizes 1 64 --no-steps   # quicker
    sudo DS_ACCELERATOR=cpu python scripts/bench_comm.py --nproc-per-node 1 --sizes 0.01 \
        --repeats 1 --chunks-kb 4 --chunk-repeats 1 --rates --no-steps   # a smoke run, free link

On 2 nodes x 2 processes (``--nodes``, ``--nproc-per-node``) it prints three tables, each run on a
free link and on links limited by ``tc``'s tbf to each of ``--rates`` (``--delay`` adds a netem
delay where the kernel has netem):

1. per gradient size (``--sizes``, MB) and algorithm: the all-reduce time (median over
   ``--repeats``, slowest rank), the bytes that crossed between nodes per all-reduce (node 0's
   veth counters, tx + rx) and their ratio to ring's and to theory, and the algorithm bandwidth
   (size / time);
2. with a small buffer (``--chunks-kb``): the bytes each inter-node TCP connection sent per
   all-reduce (the kernel's ``bytes_sent``, from ``ss``) in units of one ring chunk S/(nL): the
   steps on the slow link, 2(nL-1) for ring and 2(n-1) for hierarchical, and the time;
3. the whole-step time of ``plait train`` for the tiny GPT and a mid-size GPT (``--mid``) under
   ddp with each algorithm (median step time after 3 warm-up steps, slowest rank).

All runs of a table are measured in one command, alternating algorithms, so the ratios compare
like with like on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from netns_cluster import PORT, Cluster, can_make_namespaces, run_job  # noqa: E402

from plait.testing import link_bytes_per_step, read_metrics  # noqa: E402

ALGORITHMS = {
    "flat": ["comm=flat"],
    "ring": ["comm=ring"],
    "hierarchical": ["comm=hierarchical"],
    "hierarchical+fp16": ["comm=hierarchical", "comm.compression=fp16"],
}
MID_GPT = ["model.n_layer=4", "model.n_embd=384", "model.n_head=6", "model.block_size=64"]


# ---------------------------------------------------------------------------------------------
# worker side: one process of the job, started by torchrun inside a node's namespace
# ---------------------------------------------------------------------------------------------


def link_bytes() -> int:
    stats = Path("/sys/class/net") / os.environ["PLAIT_LINK_DEV"] / "statistics"
    return sum(int((stats / name).read_text()) for name in ("tx_bytes", "rx_bytes"))


def bytes_sent_per_connection(own_addr: str) -> dict[str, int]:
    """Bytes sent so far on each TCP connection of this namespace to another node (``ss -ti``:
    a line per socket, then an indented line of its counters)."""
    out = subprocess.run(
        ["ss", "-tinH", "state", "established"], capture_output=True, text=True
    ).stdout
    sent, socket = {}, []
    for line in out.splitlines():
        if not line[:1].isspace():
            socket = line.split()
            continue
        local, peer = socket[2], socket[3]
        found = re.search(r"bytes_sent:(\d+)", line)
        if found and local.startswith(own_addr + ":") and not peer.startswith(own_addr + ":"):
            sent[f"{local}>{peer}"] = int(found[1])
    return sent


def reducers(topology, nnodes: int, nproc: int):
    """Each algorithm's reducer, built as ``plait train`` builds it (same order on every rank)."""
    from plait.plugin_manager import keep_selected, make_plugin_manager
    from plait.testing import compose

    built = {}
    for name, overrides in ALGORITHMS.items():
        cfg = compose(
            [
                "tracker=none",
                "device=cpu",
                f"launcher.nnodes={nnodes}",
                f"launcher.nproc_per_node={nproc}",
                "run.name=bench",
                *overrides,
            ]
        )
        pm = keep_selected(make_plugin_manager(cfg), cfg)
        built[name] = pm.hook.plait_grad_reducer(cfg=cfg, topology=topology)
    return built


def timed_reduce(reducer, group, numel: int, times: int = 1) -> float:
    """``times`` all-reduces of fresh ``numel`` fp32 buckets, back to back between two
    barriers; the slowest rank's seconds per all-reduce."""
    import torch
    import torch.distributed as dist

    from plait.engine.buckets import FlatBucket

    buckets = [FlatBucket(0, [torch.ones(numel)], last=True) for _ in range(times)]
    dist.barrier()
    start = time.perf_counter()
    for bucket in buckets:
        reducer.reduce(bucket, group).wait()
    elapsed = torch.tensor([(time.perf_counter() - start) / times])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def worker(args) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from plait.topology import Topology

    nnodes, nproc = args.nodes, args.nproc_per_node
    cfg = OmegaConf.create(
        {
            "device": "cpu",
            "launcher": {"timeout_s": 1800, "nnodes": nnodes, "nproc_per_node": nproc},
            "parallel": {"dp": -1, "tp": 1, "pp": 1},
            "train": {"grad_accum_steps": 1},
        }
    )
    topology = Topology.initialize(cfg)
    group = topology.group("dp")
    built = reducers(topology, nnodes, nproc)
    lead = topology.rank == 0
    results = []
    for mb in args.sizes:
        numel = int(mb * 2**20) // 4
        for name, reducer in built.items():
            timed_reduce(reducer, group, numel)  # warm-up: connections, buffers
            before = link_bytes()
            times = [timed_reduce(reducer, group, numel) for _ in range(args.repeats)]
            crossed = (link_bytes() - before) / args.repeats
            results.append(
                {
                    "table": "sizes",
                    "mb": mb,
                    "algorithm": name,
                    "time_s": statistics.median(times),
                    "cross_bytes": crossed,
                }
            )
    numel = args.chunks_kb * 1024 // 4
    own_addr = os.environ["PLAIT_NODE_ADDR"]
    chunk = numel * 4 / topology.dims.dp  # ring: S/(nL); hierarchical: (S/L)/n, the same
    for name, reducer in built.items() if args.chunk_repeats else ():
        timed_reduce(reducer, group, numel)  # connections exist from here on
        dist.barrier()
        counting = topology.local_rank == 0  # one process per node reads its sockets
        before = bytes_sent_per_connection(own_addr) if counting else {}
        seconds = timed_reduce(reducer, group, numel, args.chunk_repeats)
        dist.barrier()
        after = bytes_sent_per_connection(own_addr) if counting else {}
        chunks = {c: (after[c] - before.get(c, 0)) / args.chunk_repeats / chunk for c in after}
        every = [None] * topology.dims.world_size
        dist.all_gather_object(every, {c: round(n, 3) for c, n in chunks.items() if n > 0.5})
        results.append(
            {
                "table": "chunks",
                "kb": args.chunks_kb,
                "algorithm": name,
                "time_s": seconds,
                "chunks": {c: n for node in every for c, n in node.items()},
            }
        )
    if lead:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()
    from plait.testing import exit_without_teardown

    exit_without_teardown()  # as plait's workers end (no abort at interpreter teardown)


# ---------------------------------------------------------------------------------------------
# driver side: clusters, workers, plait train runs, tables
# ---------------------------------------------------------------------------------------------


def collectives(args, rate: str | None, delay: str | None = None) -> list[dict]:
    """Run the worker on every node of a fresh cluster; rank 0's results."""
    with tempfile.TemporaryDirectory() as tmp, Cluster(args.nodes, rate, delay) as cluster:
        out = Path(tmp) / "results.json"
        procs = []
        for node in cluster.nodes:
            argv = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={args.nodes}",
                f"--nproc-per-node={args.nproc_per_node}",
                f"--node-rank={node.rank}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={cluster.nodes[0].addr}:{PORT}",
                f"--local-addr={node.addr}",
                "--rdzv-id=bench",
                f"--rdzv-conf=is_host={int(node.rank == 0)}",
                __file__,
                "--worker",
                f"--out={out}",
                f"--nodes={args.nodes}",
                f"--nproc-per-node={args.nproc_per_node}",
                f"--repeats={args.repeats}",
                f"--chunks-kb={args.chunks_kb}",
                f"--chunk-repeats={args.chunk_repeats}",
                "--sizes",
                *map(str, args.sizes),
            ]
            procs.append(
                cluster.popen(node, argv, {"PLAIT_NODE_ADDR": node.addr, "OMP_NUM_THREADS": "1"})
            )
        for proc in procs:
            if proc.wait() != 0:
                raise SystemExit(f"bench_comm: a worker failed (exit {proc.returncode})")
        return [dict(r, rate=link_name(rate, delay)) for r in json.loads(out.read_text())]


def step_times(args, rate: str | None, delay: str | None = None) -> list[dict]:
    """Median whole-step time of ``plait train`` (slowest rank) per model and algorithm."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, extra in [("tiny", []), ("mid", MID_GPT)]:
            for name, overrides in ALGORITHMS.items():
                run = Path(tmp) / f"{model}-{name}"
                summary = run_job(
                    args.nodes,
                    args.nproc_per_node,
                    [
                        "tracker=none",
                        "model=gpt_tiny",
                        *extra,
                        *overrides,
                        "train.seq_len=64",
                        f"train.steps={args.steps}",
                        "train.batch_size=16",
                        f"run.root={tmp}",
                        f"run.name={run.name}",
                        "+plugins=[plait.testing:link_counter]",
                    ],
                    rate=rate,
                    delay=delay,
                )
                if any(summary["exit_codes"]):
                    raise SystemExit(f"bench_comm: plait train failed: {summary}")
                lines = read_metrics(run)
                results.append(
                    {
                        "table": "steps",
                        "model": model,
                        "algorithm": name,
                        "rate": link_name(rate, delay),
                        "step_s": statistics.median(m["step_time_s/max"] for m in lines[3:]),
                        "cross_bytes": link_bytes_per_step(run, 3),
                    }
                )
    return results


def link_name(rate: str | None, delay: str | None) -> str:
    return " + ".join(x for x in (rate, delay) if x) or "free"


def theory_ratio(nodes: int, local: int) -> float:
    """Hierarchical / ring bytes across nodes: (n-1) L / (nL-1)."""
    return (nodes - 1) * local / (nodes * local - 1)


def print_tables(results: list[dict], args) -> None:
    n, local = args.nodes, args.nproc_per_node
    print(
        f"\n## all-reduce on {n} nodes x {local} processes (theory hierarchical/ring bytes = "
        f"(n-1)L/(nL-1) = {theory_ratio(n, local):.3f})\n"
    )
    print(
        "| link | MB | algorithm | time ms | cross-node MB | x ring bytes | x theory | algbw MB/s |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    rows = [r for r in results if r["table"] == "sizes"]
    for r in rows:
        ring = next(
            x
            for x in rows
            if x["rate"] == r["rate"] and x["mb"] == r["mb"] and x["algorithm"] == "ring"
        )
        size = r["mb"] * 2**20
        ratio = r["cross_bytes"] / ring["cross_bytes"]
        expected = {
            "ring": 1.0,
            "hierarchical": theory_ratio(n, local),
            "hierarchical+fp16": theory_ratio(n, local) / 2,
        }.get(r["algorithm"])
        vs_theory = f"{ratio / expected:.3f}" if expected else "-"
        print(
            f"| {r['rate']} | {r['mb']:g} | {r['algorithm']} | {r['time_s'] * 1e3:.1f} | "
            f"{r['cross_bytes'] / 1e6:.2f} | {ratio:.3f} | {vs_theory} | "
            f"{size / r['time_s'] / 1e6:.0f} |"
        )
    print(
        f"\n## steps on the slow link: chunks each inter-node connection carries per "
        f"all-reduce ({args.chunks_kb} KiB buffer; bytes sent per direction / chunk "
        f"S/(nL); theory ring 2(nL-1) = {2 * (n * local - 1)}, hierarchical 2(n-1) = "
        f"{2 * (n - 1)})\n"
    )
    print("| link | algorithm | time ms | connection directions | chunks per direction |")
    print("| --- | --- | ---: | ---: | --- |")
    for r in (r for r in results if r["table"] == "chunks"):
        counts = sorted(r["chunks"].values(), reverse=True)
        print(
            f"| {r['rate']} | {r['algorithm']} | {r['time_s'] * 1e3:.2f} | {len(counts)} | "
            f"{', '.join(f'{c:.2f}' for c in counts)} |"
        )
    steps = [r for r in results if r["table"] == "steps"]
    if steps:
        print("\n## whole step of plait train (ddp), median step time, slowest rank\n")
        print("| link | model | algorithm | step s | x flat | cross-node MB per step |")
        print("| --- | --- | --- | ---: | ---: | ---: |")
        for r in steps:
            flat = next(
                x
                for x in steps
                if x["rate"] == r["rate"] and x["model"] == r["model"] and x["algorithm"] == "flat"
            )
            print(
                f"| {r['rate']} | {r['model']} | {r['algorithm']} | {r['step_s']:.3f} | "
                f"{r['step_s'] / flat['step_s']:.3f} | {r['cross_bytes'] / 1e6:.2f} |"
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunks-kb", type=int, default=64)
    parser.add_argument("--chunk-repeats", type=int, default=20)
    parser.add_argument(
        "--rates",
        nargs="*",
        default=["1gbit", "200mbit"],
        help="tbf rates of the limited links, each measured in turn after the "
        "free link (none: the free link only)",
    )
    parser.add_argument("--delay", help="netem delay on the limited links too (needs netem)")
    parser.add_argument("--steps", type=int, default=10, help="plait train steps per run")
    parser.add_argument("--no-steps", action="store_true", help="skip the plait train table")
    parser.add_argument("--json", type=Path, help="also write every result to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    reason = can_make_namespaces()
    if reason:
        print(f"bench_comm: {reason}", file=sys.stderr)
        return 2
    results = []
    links = [(None, None)] + [(rate, args.delay) for rate in args.rates]
    for rate, delay in links:
        results += collectives(args, rate, delay)
    for rate, delay in links if not args.no_steps else ():
        results += step_times(args, rate, delay)
    print_tables(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
