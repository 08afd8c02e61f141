"""lm-evaluation-harness on plait's models, for real (``plugins/eval``, docs/eval.md).

- A ``model=hf`` checkpoint trained by plait: ``plait eval`` scores what the harness's own
  Hugging Face backend (``HFLM``) scores on the ``plait export format=hf`` output, same task and
  limit: the accuracy exactly, every log-likelihood within 1e-4; with every socket connection
  refused (nothing reaches the network).
- Runs under dp=2 and tp=2 x pp=2 log ``eval/<task>/acc`` every 2 steps, equal to ``plait
  eval`` of the checkpoint saved at that step (each request's log-likelihood within 1e-4, each
  generation the same text); in ``metrics.jsonl``, W&B and ``plait report``.
- A 2-trial Optuna sweep (two learning rates, one far too small) maximizes ``eval/plait_tiny_mc/acc``
  and picks the trial with the higher score.
- ``plait eval``'s refusals happen before any model is loaded (exit 2).
- The harness's own task index is parsed once per installed harness, then read from plait's
  cache: the same tasks, groups and tags, and only plait's directory indexed afresh.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hf_models import corpus_files, write_checkpoint

from plait.cli import main
from plait.plugins.report.figures import build
from plait.plugins.report.runs import find_runs
from plait.testing import TEST_OVERRIDES, read_metrics, read_wandb_run, run_training

TASKS = "tasks=[plait_tiny_mc,plait_tiny_gen]"
LIMIT = 12
IN_TRAINING = [
    "eval.tasks=[plait_tiny_mc,plait_tiny_gen]",
    "eval.every=2",
    f"eval.limit={LIMIT}",
    "eval.micro_batch_size=4",
    "checkpoint.every=2",
    "checkpoint.keep_last=3",
]


@pytest.fixture
def no_network(monkeypatch):
    """Every socket connection outside loopback fails the test (gloo's own, on loopback,
    still connect)."""
    real = socket.socket.connect

    def connect(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and not host.startswith(("127.", "localhost", "::1", "/")):
            raise AssertionError(f"a connection to {address} was attempted")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


def samples(results: dict, task: str) -> dict[int, list]:
    """Each document's responses (log-likelihoods and greedy flags, or generated text)."""
    return {s["doc_id"]: s["resps"] for s in results["samples"][task]}


def assert_same_scores(ours: dict, theirs: dict) -> None:
    """Accuracies (and every other metric) equal, log-likelihoods within 1e-4, generations
    equal."""
    for task in ("plait_tiny_mc", "plait_tiny_gen"):
        if task not in theirs["results"]:
            continue
        for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
            if metric in theirs["results"][task]:
                assert ours["results"][task][metric] == theirs["results"][task][metric], (
                    task,
                    metric,
                )
        a, b = samples(ours, task), samples(theirs, task)
        assert a.keys() == b.keys() and len(a) == LIMIT
        for doc in a:
            if task == "plait_tiny_mc":
                assert [r[0][1] for r in a[doc]] == [r[0][1] for r in b[doc]]
                assert [r[0][0] for r in a[doc]] == pytest.approx(
                    [r[0][0] for r in b[doc]], abs=1e-4
                )
            else:
                assert a[doc] == b[doc]


def plait_eval(checkpoint: Path, out: Path, tasks: str = TASKS, limit: int = LIMIT) -> dict:
    assert main(["eval", str(checkpoint), tasks, f"limit={limit}", f"out={out}"]) == 0
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------
# plait eval against the harness's own Hugging Face backend
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_plait_eval_of_a_model_hf_checkpoint_equals_the_harness_hf_backend_on_its_export(
    tmp_path, no_network
):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from plait.plugins.eval.registry import task_manager

    source = write_checkpoint(tmp_path / "llama", "llama")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for file in corpus_files(20, 3):
        shutil.copy(file, corpus / file.name)
    assert (
        main(
            [
                "prepare",
                f"data.path={corpus}",
                f"out={tmp_path / 'shards'}",
                f"data.tokenizer={source}",
                "data.num_workers=1",
            ]
        )
        == 0
    )
    run = run_training(
        tmp_path / "run",
        [
            "model=hf",
            f"model.path={source}",
            "data=shards",
            f"data.path={tmp_path / 'shards'}",
            "train.steps=3",
            "launcher.nproc_per_node=1",
        ],
    )
    assert main(["export", str(run), "format=hf", f"out={tmp_path / 'export'}"]) == 0
    ours = plait_eval(run, tmp_path / "ours.json", "tasks=[plait_tiny_mc]")

    hf = HFLM(
        pretrained=str(tmp_path / "export"),
        backend="causal",
        device="cpu",
        dtype="float32",
        batch_size=8,
        max_length=32,
    )  # plait's window: train.seq_len
    theirs = simple_evaluate(
        model=hf,
        tasks=["plait_tiny_mc"],
        limit=LIMIT,
        log_samples=True,
        task_manager=task_manager(None, ("plait_tiny_mc",)),
    )
    assert_same_scores(ours, theirs)
    # the scores are the trained model's: not every choice equally likely
    lls = [r[0][0] for resps in samples(ours, "plait_tiny_mc").values() for r in resps]
    assert len(set(lls)) == len(lls)


# ---------------------------------------------------------------------------------------------
# during training, as the model is sharded
# ---------------------------------------------------------------------------------------------


def assert_logged_scores_equal_plait_eval_of_each_checkpoint(run: Path, tmp_path: Path) -> None:
    logged = {m["step"]: m for m in read_metrics(run) if "eval/plait_tiny_mc/acc" in m}
    assert sorted(logged) == [2, 4]
    for step, metrics in logged.items():
        assert {
            "eval/plait_tiny_mc/acc",
            "eval/plait_tiny_mc/acc_norm",
            "eval/plait_tiny_gen/exact_match",
        } <= metrics.keys()
        during = json.loads((run / "eval" / f"step{step}.json").read_text())
        ours = plait_eval(run / "checkpoints" / f"step_{step:08d}", tmp_path / f"{step}.json")
        assert_same_scores(during, ours)
        assert metrics["eval/plait_tiny_mc/acc"] == ours["results"]["plait_tiny_mc"]["acc,none"]
        assert (
            metrics["eval/plait_tiny_gen/exact_match"]
            == ours["results"]["plait_tiny_gen"]["exact_match,none"]
        )
    # the two evaluations scored different weights
    assert samples(
        json.loads((run / "eval" / "step2.json").read_text()), "plait_tiny_mc"
    ) != samples(json.loads((run / "eval" / "step4.json").read_text()), "plait_tiny_mc")


@pytest.mark.slow
def test_dp2_logs_task_scores_every_n_steps_equal_to_plait_eval_of_that_step(tmp_path):
    """Also in W&B (offline, read back) and drawn by ``plait report``."""
    run = run_training(
        tmp_path / "dp2", ["launcher.nproc_per_node=2", "tracker=wandb", *IN_TRAINING]
    )
    assert_logged_scores_equal_plait_eval_of_each_checkpoint(run, tmp_path)
    logged = {
        m["step"]: m["eval/plait_tiny_mc/acc"]
        for m in read_metrics(run)
        if "eval/plait_tiny_mc/acc" in m
    }
    history = read_wandb_run(run)["history"]
    assert {
        h["_step"]: h["eval/plait_tiny_mc/acc"] for h in history if "eval/plait_tiny_mc/acc" in h
    } == logged
    assert main(["report", str(run), f"out={tmp_path / 'report.html'}"]) == 0
    [figure] = [f for f in build(find_runs([str(run)])) if f.id == "eval_scores"]
    assert {(s["metric"], tuple(s["x"])) for s in figure.data["series"]} == {
        (f"eval/{name}", (2, 4))
        for name in ("plait_tiny_mc/acc", "plait_tiny_mc/acc_norm", "plait_tiny_gen/exact_match")
    }
    assert (tmp_path / "report-eval_scores.png").stat().st_size > 0


@pytest.mark.slow
def test_tp2_pp2_logs_task_scores_every_n_steps_equal_to_plait_eval_of_that_step(tmp_path):
    """Tensor-parallel shards with a vocab-parallel head, the last pipeline stage holding the
    logits: scored through the pipeline engine's forward, on 4 processes."""
    run = run_training(
        tmp_path / "tp2pp2",
        [
            "parallel.tp=2",
            "parallel.pp=2",
            "pipeline.microbatches=2",
            "launcher.nproc_per_node=4",
            *IN_TRAINING,
        ],
    )
    assert_logged_scores_equal_plait_eval_of_each_checkpoint(run, tmp_path)


# ---------------------------------------------------------------------------------------------
# a sweep optimizes a task score
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_2_trial_optuna_sweep_maximizes_a_task_score(tmp_path):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    small = [o for o in TEST_OVERRIDES if not o.startswith("train.steps=")]
    assert (
        main(
            [
                "train",
                "-m",
                "hydra/sweeper=optuna",
                "hydra/sweeper/sampler=random",
                "hydra.sweeper.sampler.seed=0",  # draws both learning rates
                "hydra.sweeper.n_trials=2",
                "hydra.sweeper.n_jobs=1",
                "hydra.sweeper.direction=maximize",
                f"hydra.sweeper.storage={tmp_path}/j.journal",
                "hydra.sweeper.study_name=acc",
                "optimizer.lr=choice(1e-6,3e-2)",
                *small,
                "train.steps=6",
                "optimizer.decay_steps=6",
                "launcher.nproc_per_node=1",
                "tune.objective=eval/plait_tiny_mc/acc",
                "eval.tasks=[plait_tiny_mc]",
                "eval.micro_batch_size=32",
                f"run.root={tmp_path}",
                "run.name=acc",
            ]
        )
        == 0
    )
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "j.journal")))
    trials = optuna.load_study(study_name="acc", storage=storage).get_trials()
    assert len(trials) == 2 and {t.params["optimizer.lr"] for t in trials} == {1e-6, 3e-2}
    for trial in trials:  # each trial's value is its run's task score, scored at its last step
        last = read_metrics(Path(trial.user_attrs["run_dir"]))[-1]
        assert last["step"] == 6 and trial.value == last["eval/plait_tiny_mc/acc"]
        assert "eval/loss" not in last  # the objective did not turn on the validation loss
    values = [t.value for t in trials]
    assert values[0] != values[1], "the two learning rates scored alike: nothing to pick"
    best = yaml.safe_load((tmp_path / "acc" / "optimization_results.yaml").read_text())
    assert best["best_value"] == max(values)
    assert (
        best["best_params"]["optimizer.lr"]
        == trials[values.index(max(values))].params["optimizer.lr"]
    )


@pytest.mark.slow
def test_pbt_ranks_its_members_by_a_task_score_and_replaces_the_lower(tmp_path):
    from plait import api

    small = [o for o in TEST_OVERRIDES if not o.startswith("train.steps=")]
    api.multirun(
        [
            "hydra/sweeper=pbt",
            "hydra.sweeper.population=2",
            "hydra.sweeper.rounds=2",
            "hydra.sweeper.steps_per_round=3",
            "hydra.sweeper.quantile=0.5",
            "hydra.sweeper.direction=maximize",
            "hydra.sweeper.resample_probability=0",
            "hydra.sweeper.seed=0",
            "optimizer.lr=1e-6,3e-2",
            *small,
            "optimizer.decay_steps=6",
            "launcher.nproc_per_node=1",
            "tune.objective=eval/plait_tiny_mc/acc",
            "eval.tasks=[plait_tiny_mc]",
            "eval.micro_batch_size=32",
            f"run.root={tmp_path}",
            "run.name=pbt",
        ]
    )
    sweep = tmp_path / "pbt"
    lineage = [json.loads(line) for line in (sweep / "pbt_lineage.jsonl").open()]
    for member in lineage:  # each score is the member's task score at the end of its round
        [end] = [
            m
            for m in read_metrics(sweep / member["name"])
            if m["step"] == (member["round"] + 1) * 3
        ]
        assert member["score"] == end["eval/plait_tiny_mc/acc"], member
    first = {m["name"]: m for m in lineage if m["round"] == 0}
    assert first["m0"]["score"] != first["m1"]["score"]
    better = max(first.values(), key=lambda m: m["score"])
    worse = min(first.values(), key=lambda m: m["score"])
    second = {m["name"]: m for m in lineage if m["round"] == 1}
    assert worse["name"] not in second and better["name"] in second
    [child] = [m for m in second.values() if m["name"] not in first]
    assert child["parent"] == better["name"]


# ---------------------------------------------------------------------------------------------
# refused before any model is loaded
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_gpt(tmp_path_factory) -> Path:
    return run_training(
        tmp_path_factory.mktemp("gpt") / "run", ["launcher.nproc_per_node=1", "train.steps=1"]
    )


@pytest.fixture
def no_model_load(monkeypatch):
    import plait.export

    def consolidate(path):
        raise AssertionError("the checkpoint was read before the refusal")

    monkeypatch.setattr(plait.export, "consolidate", consolidate)


def test_plait_eval_refuses_an_unknown_task_naming_the_closest(trained_gpt, no_model_load, capsys):
    assert main(["eval", str(trained_gpt), "tasks=[plait_tiny_mcc,hellaswg]"]) == 2
    err = capsys.readouterr().err
    assert "tasks: unknown task 'plait_tiny_mcc'; closest: plait_tiny_mc" in err
    assert "tasks: unknown task 'hellaswg'; closest: hellaswag" in err


def test_plait_eval_refuses_a_generation_task_without_a_tokenizer(
    trained_gpt, no_model_load, tmp_path, capsys
):
    config = yaml.safe_load((trained_gpt / "config.yaml").read_text())
    config["data"] = {
        "name": "tokens",
        "path": str(tmp_path / "train.bin"),
        "sharding": config["data"]["sharding"],
    }  # token files do not say their tokenizer
    run = tmp_path / "tokens_run"
    shutil.copytree(trained_gpt, run)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["eval", str(run), "tasks=[plait_tiny_gen]"]) == 2
    assert (
        "tasks: 'plait_tiny_gen' is a generation task (output_type: generate_until), but "
        "there is no tokenizer to decode what the model generates"
    ) in capsys.readouterr().err


def test_plait_eval_refusal_reaches_the_terminal_without_a_traceback(trained_gpt):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait",
            "eval",
            str(trained_gpt),
            "tasks=[plait_tiny_mcc]",
            "limit=0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "limit=0 is out of range: set limit >= 1" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.slow
def test_the_harness_index_is_parsed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    from lm_eval.tasks._index import TaskIndex

    from plait.plugins.eval.registry import SHIPPED, _manager

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    paths = (str(SHIPPED),)
    made = _manager.__wrapped__(paths, include_defaults=True)  # the function, not its memo
    [cache] = tmp_path.glob("lm_eval-*.pickle")
    built = []
    build = TaskIndex.build
    monkeypatch.setattr(
        TaskIndex, "build", staticmethod(lambda p, **o: built.append(list(p)) or build(p, **o))
    )
    read = _manager.__wrapped__(paths, include_defaults=True)
    assert built == [[SHIPPED]]  # the harness's ~15,000 files were not parsed again
    assert "hellaswag" in read.task_index and "plait_tiny_mc" in read.task_index
    assert (read.all_subtasks, read.all_groups, read.all_tags) == (
        made.all_subtasks,
        made.all_groups,
        made.all_tags,
    )
    assert {n: (e.kind, e.yaml_path) for n, e in read.task_index.items()} == {
        n: (e.kind, e.yaml_path) for n, e in made.task_index.items()
    }


def test_a_cache_directory_that_cannot_be_written_costs_the_cache_not_the_check(tmp_path):
    from plait.plugins.eval.registry import read_or_make

    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache directory would be: mkdir fails
    assert read_or_make(blocked / "plait" / "index.pickle", lambda: {"task": 1}) == {"task": 1}
    fresh = tmp_path / "cache" / "index.pickle"
    assert read_or_make(fresh, lambda: {"task": 2}) == {"task": 2}
    assert read_or_make(fresh, lambda: {"task": 3}) == {"task": 2}  # read back, not made
