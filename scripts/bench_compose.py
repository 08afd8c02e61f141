"""What composing a config costs a process that composes many (a test session, the planner's
search): plait's ``compose_config`` (each choice of config options merged once per process,
:mod:`plait.composed`) against Hydra's own compose of the same overrides, in one command.

    DS_ACCELERATOR=cpu python scripts/bench_compose.py                 # 3 rounds of 12 configs
    DS_ACCELERATOR=cpu python scripts/bench_compose.py --rounds 1

Each round composes the same configs, as tests compose them: the tiny-run settings, one of
``--strategies``, and a run directory and step count of the round's own (values). The two sides
alternate config by config. Printed: the milliseconds per config of each side by round (the
first round of plait's side merges each choice; the others reuse it), the ratio Hydra / plait
over all rounds, and the load average. Timings on a shared machine are noise: run it alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--strategies", nargs="+", default=["ddp", "zero1", "zero2", "zero3", "fsdp", "local_sgd"]
    )
    args = parser.parse_args()

    from omegaconf import open_dict

    from plait.composed import compose
    from plait.plan import CONFIG_NAME, compose_config, hydra_app
    from plait.plugin_manager import make_plugin_manager
    from plait.testing import TEST_OVERRIDES

    pm = make_plugin_manager()

    def hydras(overrides: list[str]) -> None:
        with hydra_app(pm) as hydra:
            cfg = compose(hydra, CONFIG_NAME, overrides)
        with open_dict(cfg):
            del cfg["hydra"]

    sides = {"hydra": hydras, "plait": lambda overrides: compose_config(overrides, pm)}
    seconds: dict[str, list[list[float]]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        for side in sides:
            seconds[side].append([])
        for i, strategy in enumerate(args.strategies * 2):
            values = [f"run.root=/tmp/round{round_}", f"train.steps={i + 1}"]
            overrides = [*TEST_OVERRIDES, f"strategy={strategy}", *values]
            for side, fn in sides.items():
                start = time.perf_counter()
                fn(overrides)
                seconds[side][-1].append(time.perf_counter() - start)
    print("| round | hydra ms/config | plait ms/config |")
    print("| ---: | ---: | ---: |")
    for round_ in range(args.rounds):
        hydra_ms, plait_ms = (1e3 * statistics.mean(seconds[s][round_]) for s in sides)
        print(f"| {round_ + 1} | {hydra_ms:.1f} | {plait_ms:.1f} |")
    total = {side: sum(map(sum, rounds)) for side, rounds in seconds.items()}
    configs = args.rounds * 2 * len(args.strategies)
    print(f"hydra / plait over {configs} configs: {total['hydra'] / total['plait']:.1f}x")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
