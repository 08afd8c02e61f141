"""Bad input is refused before any worker starts: `plait train` exits 2 with a message naming the
setting and the fix, prints no traceback, and leaves no run directory behind.

Every numeric setting of the core and of every built-in plugin (out of range), plus the data
files and combinations that used to fail inside the workers.
"""

import bz2
import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import plait.conf
from plait.cli import main

# (overrides, what the refusal says about each). Settings checked alike (one range table each)
# share a case: the refusal lists every problem at once. {tmp} is the data directory below.
CASES = [
    # the core's settings
    (
        "train.steps=0 train.batch_size=0 train.grad_accum_steps=0 train.seq_len=0 "
        "train.grad_clip=-1 train.log_every=0 train.eval_every=-5 train.eval_batches=0 "
        "train.peak_flops=0 train.stop_at=0",
        [
            "train.steps=0 is out of range: set train.steps >= 1",
            "set train.batch_size >= 1",
            "set train.grad_accum_steps >= 1",
            "set train.seq_len >= 1",
            "train.grad_clip=-1.0 is out of range: set train.grad_clip >= 0 (0 turns clipping off)",
            "set train.log_every >= 1",
            "set train.eval_every >= 0 (0: no evaluation)",
            "set train.eval_batches >= 1",
            "train.peak_flops=0.0 is out of range: set train.peak_flops > 0",
            "train.stop_at=0 is out of range: set train.stop_at >= 1",
        ],
    ),
    (
        "parallel.tp=0 parallel.pp=-2 parallel.ep=0 launcher.nproc_per_node=0 launcher.nnodes=0 "
        "launcher.timeout_s=0 seed=-1",
        [
            "parallel.tp=0 is out of range: set parallel.tp >= 1",
            "set parallel.pp >= 1",
            "parallel.ep=0 is out of range: set parallel.ep >= 1",
            "set launcher.nproc_per_node >= 1",
            "set launcher.nnodes >= 1",
            "set launcher.timeout_s >= 1",
            "seed=-1 is out of range: set seed in [0, 4294967295]",
        ],
    ),
    ("parallel.dp=0", ["parallel.dp=0 is out of range: set parallel.dp >= 1, or -1"]),
    # context parallelism: the setting, the backend, and what the issue names
    (
        "parallel.cp=0 context_parallel.backend=flash",
        ["parallel.cp=0 is out of range: set parallel.cp >= 1"],
    ),
    (
        "context_parallel.backend=flash",
        ["context_parallel.backend=flash: choose one of ring, ulysses"],
    ),
    (
        "parallel.cp=4 launcher.nproc_per_node=4 train.seq_len=36",
        [
            "train.seq_len=36 is not divisible by 8 for context_parallel.backend=ring with "
            "parallel.cp=4 (zigzag load balancing cuts each sequence into 2·cp chunks): choose "
            "train.seq_len as a multiple of 8"
        ],
    ),
    (
        "parallel.cp=4 launcher.nproc_per_node=4 context_parallel.backend=ulysses model.n_head=2",
        [
            "context_parallel.backend=ulysses with parallel.cp=4: the heads (model.n_head=2) are not "
            "divisible by cp, and Ulysses gives each rank heads / cp of them: choose parallel.cp "
            "dividing 2, or context_parallel.backend=ring"
        ],
    ),
    (
        "model=custom model._target_=torch.nn.Identity parallel.cp=2",
        [
            "parallel.cp=2: plait cannot replace the attention of model._target_=torch.nn.Identity: "
            "the model carries no context_parallel_plan"
        ],
    ),
    (
        "model=hf model.path={tmp}/bloom model.pretrained=false parallel.cp=2 "
        "launcher.nproc_per_node=2 train.seq_len=32",
        [
            "parallel.cp=2: plait cannot replace the attention of model._target_="
            "plait.plugins.hf.model.build_hf: BloomForCausalLM's attention does not go through "
            "transformers' attention interface (ALL_ATTENTION_FUNCTIONS), where plait puts its "
            "exchange; use a model that has one (plait's GPT: model=gpt_tiny, gpt2_small; model=hf "
            "with Llama-family attention) or parallel.cp=1"
        ],
    ),
    ("device=tpu", ["device=tpu: choose auto, cpu or cuda"]),
    (
        "launcher.allocator=mimalloc",
        ["launcher.allocator=mimalloc: choose one of auto, tcmalloc, jemalloc, glibc, glibc_mmap"],
    ),
    (
        "launcher.decommit_above=0",
        [
            "launcher.decommit_above=0.0: give the share of the job's memory cap above which "
            "tcmalloc hands freed memory back, in (0, 1] (1: never; default 0.8)"
        ],
    ),
    # adamw
    (
        "optimizer.lr=-1 optimizer.min_lr=-1e-4 optimizer.warmup_steps=-1 optimizer.decay_steps=0 "
        "optimizer.weight_decay=-0.1 optimizer.betas=[0.9,1.5] optimizer.eps=-1e-8",
        [
            "optimizer.lr=-1.0 is out of range: set optimizer.lr >= 0",
            "set optimizer.min_lr >= 0",
            "set optimizer.warmup_steps >= 0 (0: no warm-up)",
            "set optimizer.decay_steps >= 1",
            "set optimizer.weight_decay >= 0",
            "optimizer.betas=[0.9, 1.5] is out of range: set each of optimizer.betas in [0, 1)",
            "set optimizer.eps >= 0",
        ],
    ),
    ("optimizer.betas=[0.9]", ["optimizer.betas=[0.9] needs two numbers (beta1, beta2)"]),
    # checkpoint, pipeline, local launcher, W&B: each plugin checks its own
    (
        "checkpoint.every=-1 checkpoint.keep_last=-1 pipeline.microbatches=0 "
        "pipeline.virtual_stages=0 launcher.node_rank=-1 launcher.master_port=70000 "
        "launcher.max_restarts=-1 launcher.start_method=thread tracker=wandb tracker.mode=loud",
        [
            "set checkpoint.every >= 0 (0: only at the end)",
            "set checkpoint.keep_last >= 0 (0 keeps all)",
            "set pipeline.microbatches >= 1",
            "set pipeline.virtual_stages >= 1",
            "set launcher.node_rank >= 0",
            "set launcher.master_port in [0, 65535]",
            "set launcher.max_restarts >= 0",
            "launcher.start_method=thread: choose one of forkserver, spawn",
            "tracker.mode=loud: choose offline, online or disabled",
        ],
    ),
    (
        "fault.max_bad_steps=0 fault.spike_factor=-1",
        ["set fault.max_bad_steps >= 1", "set fault.spike_factor >= 0 (0: off)"],
    ),
    # the straggler detector and the collective watchdog
    (
        "fault.straggler_factor=0.5 fault.straggler_window=0 fault.straggler_action=kill "
        "fault.collective_timeout_s=0",
        [
            "fault.straggler_factor=0.5 is out of range: set fault.straggler_factor > 1 (or 0: off)",
            "set fault.straggler_window >= 1",
            "fault.straggler_action=kill: choose warn or exclude",
            "fault.collective_timeout_s=0.0 is out of range: set fault.collective_timeout_s > 0 (or "
            "null: off)",
        ],
    ),
    (
        "fault.straggler_action=exclude fault.straggler_factor=0",
        [
            "fault.straggler_action=exclude takes the straggler's node out of an elastic job, but "
            "launcher.nnodes=1 is fixed: give a range (e.g. launcher.nnodes=1:2)",
            "but checkpoint.every=0 writes one only at the end: set checkpoint.every=N",
            "fault.straggler_action=exclude with fault.straggler_factor=0 (the detector off)",
        ],
    ),
    # replication: node-local checkpoints and their peers
    (
        "checkpoint.replicas=-1",
        ["checkpoint.replicas=-1 is out of range: set checkpoint.replicas >= 0"],
    ),
    (
        "checkpoint.replicas=1",
        [
            "checkpoint.replicas=1 keeps each node's checkpoint part on peer nodes' own "
            "disks, but without checkpoint.local_dir every node writes into the shared",
            "set checkpoint.local_dir=<a directory on each node's own disk>",
            "checkpoint.replicas=1 with 1 node(s): a node's part is kept on "
            "checkpoint.replicas other nodes, so it must be below the node count: set "
            "checkpoint.replicas=0 (launcher.nnodes=1 has no peer node)",
        ],
    ),
    (
        "launcher.nnodes=2 launcher.master_port=29500 checkpoint.local_dir={tmp}/local checkpoint.replicas=2",
        ["checkpoint.replicas=2 with 2 node(s)", "set checkpoint.replicas=1"],
    ),
    (
        "checkpoint.local_dir={tmp}/local checkpoint.async_save=true",
        [
            "checkpoint.async_save=true cannot write node-local checkpoints (checkpoint.local_dir): set "
            "checkpoint.async_save=false, or unset checkpoint.local_dir"
        ],
    ),
    (
        "launcher.node_rank=1",
        ["launcher.node_rank=1 with launcher.nnodes=1: give each node its rank, 0 to 0"],
    ),
    ("launcher.nnodes=2 run.name=r", ["launcher.nnodes=2 needs launcher.master_port=<port>"]),
    # elastic: launcher.nnodes=MIN:MAX
    (
        "launcher.nnodes=2:1",
        [
            "launcher.nnodes=2:1 is out of range: set launcher.nnodes >= 1, or "
            "MIN:MAX with 1 <= MIN <= MAX"
        ],
    ),
    (
        "launcher.nnodes=1:2 parallel.dp=2 parallel.pp=2 pipeline.microbatches=2",
        [
            "launcher.nnodes=1:2 needs launcher.master_port=<port>",
            "launcher.nnodes=1:2 goes on after a node leaves by restarting the group at the smaller "
            "size, which spends a restart: set launcher.max_restarts >= 1",
            "launcher.nnodes=1:2 changes the world size, but parallel.dp=2 is fixed: set "
            "parallel.dp=-1",
            "launcher.nnodes=1:2 with parallel.pp=2: a smaller world keeps the global batch by "
            "accumulating more micro-batches, but the schedule's pipeline.microbatches is fixed",
        ],
    ),
    (
        "launcher.nnodes=3:4 launcher.nproc_per_node=1 launcher.master_port=29500 "
        "launcher.max_restarts=1",
        [
            "launcher.nnodes=3:4: at 3 node(s) dp is 3, which cannot share the 4 micro-batches of a "
            "step (train.grad_accum_steps=1 x dp 4 at 4 nodes), so train.batch_size=64 cannot be "
            "kept: set train.grad_accum_steps to a multiple of 3"
        ],
    ),
    # launcher=ray: nothing is submitted where no cluster answers (tests/test_ray.py: real runs)
    (
        "launcher=ray launcher.address=127.0.0.1:1 launcher.max_restarts=-1 "
        "launcher.placement_strategy=ROUND launcher.nnodes=1:2",
        [
            "launcher.address=127.0.0.1:1: no Ray cluster answers at 127.0.0.1:1 (Connection "
            "refused): start one there (`ray start --head`)",
            "set launcher.max_restarts >= 0",
            "launcher.placement_strategy=ROUND: choose one of PACK, SPREAD",
            "launcher.nnodes=1:2 under launcher=ray: Ray Train's elastic range counts workers, not "
            "nodes",
        ],
    ),
    ("launcher=ray launcher.address=auto", ["launcher.address=auto: no Ray cluster"]),
    # launcher=kubernetes: refused before anything is submitted (tests/test_kubernetes.py)
    (
        "launcher=kubernetes launcher.dry_run=true launcher.kind=CronJob launcher.job_name=Exp_1 "
        "launcher.env={{PET_NNODES:4}}",
        [
            "launcher=kubernetes needs launcher.image=<the container image the pods run",
            "launcher.env sets PET_NNODES: the operator sets torchrun's PET_ variables",
            "launcher.kind=CronJob: choose one of auto, TrainJob, PyTorchJob",
            "launcher.job_name=Exp_1: Kubernetes takes lower-case letters, digits and '-'",
        ],
    ),
    (
        "launcher=kubernetes launcher.image=reg/plait:1 launcher.kind=TrainJob launcher.nnodes=1:2",
        [
            "launcher.nnodes=1:2 with launcher.kind=TrainJob: a TrainJob has no elastic policy",
            "every pod writes its checkpoints into run.root={tmp_path}, which lies on none of "
            "launcher.volumes",
        ],
    ),
    (
        "launcher=kubernetes launcher.image=reg/plait:1 launcher.nnodes=3:2",
        [
            "launcher.nnodes=3:2 is out of range: set launcher.nnodes >= 1, or MIN:MAX with "
            "1 <= MIN <= MAX"
        ],
    ),
    # models; with tp and pp on, the plugins that build the model to check it skip quietly
    (
        "model.n_layer=0 model.n_head=0 model.n_embd=0 model.block_size=0 model.dropout=1.0 "
        "parallel.tp=2 parallel.pp=2 launcher.nproc_per_node=4 pipeline.microbatches=2",
        [
            "model.n_layer=0 is out of range: set model.n_layer >= 1",
            "set model.n_head >= 1",
            "set model.n_embd >= 1",
            "set model.block_size >= 1",
            "set model.dropout in [0, 1)",
        ],
    ),
    (
        "model=llama_tiny model.num_key_value_heads=0 model.rms_norm_eps=0",
        ["set model.num_key_value_heads >= 1", "set model.rms_norm_eps > 0"],
    ),
    (
        "model=custom model._target_=torch.nn.Embedding +model.num_embeddings=-3 "
        "+model.embedding_dim=4",
        ["model._target_=torch.nn.Embedding cannot be built with these settings (RuntimeError"],
    ),
    # mixture of experts and expert parallelism
    (
        "model.n_experts=-1 model.top_k=0 model.moe_every=0 model.aux_loss_coeff=-1 "
        "model.z_loss_coeff=-0.1 model.capacity_factor=0 model.expert_hidden=0",
        [
            "model.n_experts=-1 is out of range: set model.n_experts >= 0 (0: dense MLPs)",
            "set model.top_k >= 1",
            "set model.moe_every >= 1",
            "set model.aux_loss_coeff >= 0",
            "set model.z_loss_coeff >= 0",
            "model.capacity_factor=0.0 is out of range: set model.capacity_factor > 0",
            "set model.expert_hidden >= 1",
        ],
    ),
    (
        "model.n_experts=6 parallel.ep=4 launcher.nproc_per_node=4",
        [
            "parallel.ep=4 does not divide model.n_experts=6: each expert-parallel rank holds "
            "n_experts/ep experts; choose parallel.ep in [1, 2], or model.n_experts as a multiple "
            "of 4"
        ],
    ),
    (
        "model.n_experts=4 parallel.ep=4",
        [
            "parallel.ep=4 is larger than the data-parallel world "
            "dp=2: experts are spread over data-parallel ranks"
        ],
    ),
    (
        "model.n_experts=4 parallel.ep=3 launcher.nproc_per_node=4",
        [
            "parallel.ep=3 does not divide the data-parallel world dp=4: choose parallel.ep in "
            "[1, 2, 4]"
        ],
    ),
    (
        "model.n_experts=4 model.top_k=5 model.router=tanh",
        [
            "model.top_k=5 is larger than model.n_experts=4: each token goes to top_k different "
            "experts; set model.top_k <= 4",
            "model.router=tanh: choose one of softmax, sigmoid",
        ],
    ),
    (
        "parallel.ep=2",
        [
            "parallel.ep=2 spreads a mixture of experts' experts over ranks, but "
            "model.n_experts=0 (dense MLPs): set model.n_experts to a multiple of 2"
        ],
    ),
    (
        "model.n_experts=4 parallel.ep=2 strategy=zero3",
        [
            "strategy=zero3 with parallel.ep=2: DeepSpeed partitions ZeRO-3 parameters over the whole "
            "dp group"
        ],
    ),
    (
        "model.n_experts=4 parallel.ep=2 strategy=zero0",
        ["strategy=zero0 with parallel.ep=2: DeepSpeed's stage-0 gradient norm"],
    ),
    (
        "model.n_experts=4 parallel.ep=2 strategy=fsdp strategy.replicate=2 "
        "launcher.nproc_per_node=4",
        [
            "strategy.replicate=2 with parallel.ep=2: plait shards experts over their "
            "expert-data-parallel group, not over HSDP's replica groups"
        ],
    ),
    (
        "strategy=fsdp parallel.pp=2 pipeline.schedule=zero_bubble launcher.nproc_per_node=2",
        [
            "pipeline.schedule=zero_bubble with strategy=fsdp: the zero-bubble schedules split each "
            "backward into input and weight gradients"
        ],
    ),
    (
        "model.n_experts=4 parallel.ep=2 strategy=local_sgd",
        ["plugin 'local_sgd' does not support ep parallelism (parallel.ep=2)"],
    ),
    (
        "model.n_experts=4 precision=fp16",
        [
            "precision=fp16 with model.n_experts: the router's "
            "auxiliary losses enter the backward unscaled"
        ],
    ),
    (
        "model.n_experts=4 parallel.tp=2 tensor_parallel.sequence_parallel=true",
        [
            "tensor_parallel.sequence_parallel=true: the tensor-parallel plan of model._target_="
            "plait.plugins.models.gpt.GPT has no 'sequence_scatter' entry"
        ],
    ),
    # model=hf, checkpoint.hf_every, pipeline.layers (tests/test_hf.py: the checkpoint files)
    (
        "model=hf",
        [
            "model=hf needs model.path=<a directory with config.json and *.safetensors, or a "
            "model name already in the local Hugging Face cache>"
        ],
    ),
    (
        "checkpoint.hf_every=-1 parallel.pp=2 pipeline.microbatches=2 pipeline.layers=nosuch",
        [
            "checkpoint.hf_every=-1 is out of range: set checkpoint.hf_every >= 0 (0: never)",
            "pipeline.layers=nosuch: GPT (the model) has no child 'nosuch'; it has ['embed', 'blocks', "
            "'norm', 'head']",
        ],
    ),
    # model=hf mixtures of experts under parallel.ep (tests/test_hf_moe.py: the checkpoints)
    (
        "model=hf model.path={tmp}/qwen3_moe6 model.pretrained=false train.seq_len=32 "
        "parallel.ep=4 launcher.nproc_per_node=4",
        [
            "parallel.ep=4 does not divide the 6 experts per layer of model.path={tmp}/qwen3_moe6 "
            "(num_experts in its config.json): each expert-parallel rank holds num_experts/ep "
            "experts; choose parallel.ep in [1, 2]"
        ],
    ),
    (
        "model=hf model.path={tmp}/llama model.pretrained=false train.seq_len=32 parallel.ep=2",
        [
            "parallel.ep=2: LlamaForCausalLM (model.path={tmp}/llama) has no base_model_ep_plan in its "
            "config, so it has no mixture-of-experts layers to spread: set parallel.ep=1"
        ],
    ),
    # model=hf: a forward pipeline stages cannot run faithfully (tests/test_hf_fidelity.py)
    (
        "model=hf model.path={tmp}/granite model.pretrained=false train.seq_len=32 "
        "parallel.pp=2 pipeline.microbatches=2 launcher.nproc_per_node=2",
        [
            "parallel.pp=2 (2 stages of [1, 1] layers): GraniteForCausalLM's pipeline stages do "
            "not compute its own forward: on a seeded stand-in of it (2 x 32 tokens)",
            "set parallel.pp=1 (ddp, ZeRO and FSDP run its forward whole)",
        ],
    ),
    (
        "checkpoint.hf_every=5",
        [
            "checkpoint.hf_every=5 writes Hugging Face's format, which needs a "
            "transformers model (model._target_=plait.plugins.hf.model."
            "build_hf or model._target_=plait.plugins.hf.llama.build_llama), "
            "not model._target_=plait.plugins.models.gpt.GPT: set "
            "checkpoint.hf_every=0"
        ],
    ),
    # DeepSpeed's own checks of the zero_optimization section
    (
        "strategy=zero2 strategy.deepspeed.zero_optimization.reduce_bucket_size=-1",
        [
            "strategy.deepspeed.zero_optimization.reduce_bucket_size=-1 is refused by DeepSpeed "
            "(Input should be greater than 0)"
        ],
    ),
    # fault=torchft: a strategy that cannot take part, a lighthouse that does not answer, fewer
    # replica groups than the quorum minimum, groups that do not fit on a node, an elastic node
    # range, the quorum settings out of range
    ("fault=torchft strategy=zero2", ["fault=torchft: strategy=zero2 cannot take part"]),
    ("fault=torchft strategy=local_sgd", ["fault=torchft: strategy=local_sgd cannot take part"]),
    ("fault=torchft strategy=diloco", ["fault=torchft: strategy=diloco cannot take part"]),
    (
        "fault=torchft fault.lighthouse=http://127.0.0.1:9",
        ["fault.lighthouse=http://127.0.0.1:9 does not answer: no answer within 3 s"],
    ),
    (
        "fault=torchft fault.min_replicas=3",
        [
            "fault.min_replicas=3, but strategy=ddp forms 2 replica group(s) here (dp=2): no "
            "quorum could ever form; set fault.min_replicas <= 2"
        ],
    ),
    (
        "fault=torchft launcher.nnodes=2 launcher.nproc_per_node=3 parallel.tp=2 "
        "launcher.master_port=29500",
        ["launcher.nproc_per_node=3 does not hold whole replica groups of 2 processes"],
    ),
    (
        "fault=torchft parallel.pp=2 pipeline.balance=time pipeline.microbatches=2 "
        "train.grad_accum_steps=2 launcher.nproc_per_node=4",
        ["pipeline.balance=time with fault=torchft: each replica group runs as a torch job"],
    ),
    (
        "fault=torchft launcher.nnodes=1:2 launcher.master_port=29500 launcher.max_restarts=1",
        ["fault=torchft with launcher.nnodes=1:2: replica groups leave and rejoin each step"],
    ),
    (
        "fault=torchft fault.min_replicas=0 fault.join_timeout_ms=-1 fault.quorum_tick_ms=0 "
        "fault.heartbeat_timeout_ms=0 fault.manager_timeout_s=0 fault.quorum_timeout_s=0 "
        "fault.lighthouse_port=70000",
        [
            "fault.min_replicas=0 is out of range: set fault.min_replicas >= 1",
            "set fault.join_timeout_ms >= 0",
            "set fault.quorum_tick_ms >= 1",
            "set fault.heartbeat_timeout_ms >= 1",
            "set fault.manager_timeout_s > 0",
            "set fault.quorum_timeout_s > 0",
            "set fault.lighthouse_port in [0, 65535] (0: chosen, docs/fault.md)",
        ],
    ),
    # data
    (
        "data.val_fraction=1",
        ["data.val_fraction=1.0 is out of range: set data.val_fraction in [0, 1)"],
    ),
    (
        "train.eval_every=5 data.val_fraction=0",
        ["train.eval_every=5 with data.val_fraction=0 leaves no validation split"],
    ),
    (
        "data.path={tmp}/corpus.txt",
        [
            "data.path={tmp}/corpus.txt is ignored by data=stdlib (the "
            "standard library's source): add data=text"
        ],
    ),
    (
        "data=tokens data.path={tmp}/corpus.txt",
        [
            "looks like text, not tokens: to train on it as "
            "text use data=text data.path={tmp}/corpus.txt"
        ],
    ),
    (
        "data=tokens data.path={tmp}/odd.bin",
        ["has 4097 bytes, not a whole number of uint16 tokens"],
    ),
    (
        "data=tokens data.path={tmp}/truncated.bin",
        ["starts with llm.c's magic 20240520 but does not fit its layout"],
    ),
    (
        "data=tokens data.path={tmp}/gpt2.bin",
        ["holds token ids up to 50256, but the model's embedding has 256 rows"],
    ),
    ("data=tokens data.path={tmp} train.eval_every=5", ["is a directory without val.bin"]),
    (
        "data=text data.path={tmp}/corpus.txt",
        ["fewer than one global batch of train.batch_size=64"],
    ),
    (
        "data=text data.path={tmp}/no_text.parquet",
        [
            "data.path={tmp}/no_text.parquet: {tmp}/no_text.parquet has no column 'text' (its "
            "columns: id, content): set data.text_field=<the text column>"
        ],
    ),
    (
        "model.vocab_size=128",
        [
            "data=stdlib holds token ids up to 255, but the model's embedding "
            "has 128 rows: raise the model's vocabulary to at least 256"
        ],
    ),
    # downstream tasks (lm-evaluation-harness), refused before any model is loaded
    (
        "eval.every=5",
        [
            "eval.every=5 evaluates nothing without eval.tasks: name the tasks "
            "(eval.tasks=[plait_tiny_mc]) or drop eval.every"
        ],
    ),
    (
        "eval.tasks=[plait_tiny_mcc,hellaswg]",
        [
            "eval.tasks: unknown task 'plait_tiny_mcc'; closest: plait_tiny_mc",
            "eval.tasks: unknown task 'hellaswg'; closest: hellaswag",
        ],
    ),
    (
        "data=tokens data.path={tmp}/train.bin eval.tasks=[plait_tiny_gen]",
        [
            "eval.tasks: 'plait_tiny_gen' is a generation task (output_type: generate_until), but "
            "there is no tokenizer to decode what the model generates"
        ],
    ),
    (
        "eval.tasks=[plait_tiny_mc] eval.every=0 eval.limit=0 eval.num_fewshot=-1 "
        "eval.micro_batch_size=0",
        [
            "set eval.every >= 1",
            "set eval.limit >= 1",
            "set eval.num_fewshot >= 0",
            "set eval.micro_batch_size >= 1",
        ],
    ),
    (
        "eval.tasks=[plait_tiny_mc] parallel.cp=2 launcher.nproc_per_node=2",
        [
            "eval.tasks with parallel.cp=2: scoring a sequence split over context-parallel ranks is "
            "not supported"
        ],
    ),
    (
        "data=shards data.path={tmp}/old_shards data.verify=true",
        [
            "data.verify=true, but data.path={tmp}/old_shards has an index.json without shard "
            "checksums (written by plait prepare before they were recorded): run plait prepare "
            "again",
            "or set data.verify=false",
        ],
    ),
]


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    (tmp / "corpus.txt").write_text("plait trains on text.\n" * 180)  # 3960 bytes
    rng = np.random.default_rng(0)
    (tmp / "odd.bin").write_bytes(rng.integers(0, 256, 4097, dtype=np.uint8).tobytes())
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, 5000]  # llm.c's GPT-2 header promising 5000 tokens, 100 follow
    (tmp / "truncated.bin").write_bytes(header.tobytes() + np.zeros(100, np.uint16).tobytes())
    gpt2 = rng.integers(0, 50257, 20000).astype(np.uint16)
    gpt2[0] = 50256  # <|endoftext|>
    gpt2.tofile(tmp / "gpt2.bin")
    (tmp / "train.bin").write_bytes(np.zeros(20000, np.uint16).tobytes())  # a dir without val.bin
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [1], "content": ["a"]}), tmp / "no_text.parquet")
    import transformers as T  # config-only model=hf directories

    small = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    T.LlamaConfig(**small).save_pretrained(tmp / "llama")
    T.Qwen3MoeConfig(
        moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, **small
    ).save_pretrained(tmp / "qwen3_moe6")
    # Granite: its base model multiplies inputs_embeds, which a later pipeline stage repeats
    T.GraniteConfig(embedding_multiplier=2.0, **small).save_pretrained(tmp / "granite")
    # Bloom: ALiBi attention of its own, no context parallelism
    T.BloomConfig(vocab_size=512, hidden_size=64, n_layer=2, n_head=4).save_pretrained(
        tmp / "bloom"
    )
    # shards whose index.json predates the checksums (as plait prepare wrote it before them)
    assert main(["prepare", f"data.path={tmp}/corpus.txt", f"out={tmp}/old_shards"]) == 0
    index = json.loads((tmp / "old_shards" / "index.json").read_text())
    for shard in index["shards"]:
        del shard["xxh3_64"]
    (tmp / "old_shards" / "index.json").write_text(json.dumps(index))
    return tmp


@pytest.mark.parametrize("overrides,messages", CASES, ids=[c[0][:40] for c in CASES])
def test_bad_input_is_refused_before_launch(overrides, messages, data_files, tmp_path, capsys):
    overrides = overrides.format(tmp=data_files).split()
    code = main(
        [
            "train",
            "device=cpu",
            "train.batch_size=64",
            f"run.root={tmp_path}",
            "run.name=r",
            *overrides,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "plait: plait refused this plan:" in err
    for message in messages:
        assert message.format(tmp=data_files, tmp_path=tmp_path) in err
    assert not (tmp_path / "r").exists()


def test_a_kubernetes_submit_without_credentials_or_to_an_unknown_namespace_is_refused(
    tmp_path, capsys, monkeypatch
):
    """For a real submit (not launcher.dry_run) plait asks the cluster first. The cluster is
    tests/fake_kube_api.py's stand-in (no API server can run here); nothing is created."""
    pytest.importorskip("kubernetes", reason="pip install -e '.[kubernetes]'")
    from fake_kube_api import FakeKubeApi

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    submit = [
        "train",
        "launcher=kubernetes",
        "launcher.image=reg/plait:1",
        "device=cpu",
        f"run.root={tmp_path}",
        "run.name=r",
    ]
    assert main(submit) == 2
    assert "launcher=kubernetes found no Kubernetes credentials" in capsys.readouterr().err
    with FakeKubeApi(namespaces={"default"}, crds={"trainjobs.trainer.kubeflow.org"}) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kube_config(tmp_path)))
        assert main([*submit, "launcher.namespace=nosuch"]) == 2
        assert (
            "launcher.namespace=nosuch: the cluster has no such namespace"
            in capsys.readouterr().err
        )
        assert api.created == []
    assert not (tmp_path / "r").exists()


def test_refusal_reaches_the_terminal_without_a_traceback(data_files, tmp_path):
    """The two inputs the issue names, through a real `python -m plait` process."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait",
            "train",
            "device=cpu",
            f"run.root={tmp_path}",
            "run.name=r",
            "optimizer.lr=-1",
            "data=tokens",
            f"data.path={data_files}/corpus.txt",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "optimizer.lr=-1.0 is out of range: set optimizer.lr >= 0" in done.stderr
    assert f"use data=text data.path={data_files}/corpus.txt" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not any(tmp_path.iterdir())


def test_an_unknown_value_is_refused_once_and_lists_only_what_a_user_can_choose(tmp_path, capsys):
    """A precision or device the core does not know is one refusal (the core's), not one per
    active plugin; an unknown option of a config group lists the group's options, without the
    ``base_*`` schemas plugins store for them or Hydra's search path."""
    code = main(["train", "precision=fp7", "device=tpu", f"run.root={tmp_path}", "run.name=r"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert [line for line in err.splitlines() if "fp7" in line] == [
        "  - precision=fp7: choose one of fp32, bf16, fp16"
    ]
    assert [line for line in err.splitlines() if "tpu" in line] == [
        "  - device=tpu: choose auto, cpu or cuda (each process takes the GPU of its local rank)"
    ]
    options = Path(plait.conf.__file__).parent / "strategy"
    strategies = sorted(p.stem for p in options.glob("*.yaml"))
    for command in (["train"], ["plan"], ["train", "-m"]):
        code = main([*command, "strategy=zero9", f"run.root={tmp_path}", "run.name=r"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.splitlines() == [
            "plait: plait refused this plan:",
            f"  - strategy=zero9: no such option; choose one of {', '.join(strategies)}",
        ]
    assert not any(tmp_path.iterdir())


# plait prepare: bad input is refused before anything is tokenized or written (no out=), naming
# the file. {tmp} is the directory of bad_corpora below.
PREPARE_CASES = [
    (
        "data.path={tmp}/no_text_column.parquet",
        [
            "{tmp}/no_text_column.parquet has no column 'text' (its columns: id, content): set "
            "data.text_field=<the text column>"
        ],
    ),
    (
        "data.path={tmp}/no_text_column.parquet data.text_field=id",
        ["column 'id' holds int64, not text"],
    ),
    (
        "data.path={tmp}/not_gzip.jsonl.gz",
        ["{tmp}/not_gzip.jsonl.gz does not decompress as gzip (BadGzipFile"],
    ),
    (
        "data.path={tmp}/truncated.jsonl.bz2",
        [
            "{tmp}/truncated.jsonl.bz2 does not decompress as bz2 (EOFError: Compressed file ended "
            "before the end-of-stream marker was reached)"
        ],
    ),
    (
        "data.path={tmp}/field.jsonl",
        [
            "{tmp}/field.jsonl line 3 has no field 'text' (it has: id, content): set "
            "data.text_field=<the field holding the text>"
        ],
    ),
    (
        "data.path={tmp}/field.jsonl data.text_field=id",
        ["{tmp}/field.jsonl line 1: field 'id' holds int, not text"],
    ),
    ("data.path={tmp}/broken.jsonl", ["{tmp}/broken.jsonl line 2 is not JSON"]),
    (
        "data.path={tmp}/splits data.split=test",
        [
            "{tmp}/splits has no split 'test' (its splits: train, validation): set "
            "data.split=<one of them>"
        ],
    ),
    ("data.path={tmp}/binary.bin", ["{tmp}/binary.bin is not text (it holds NUL bytes)"]),
    (
        "data.path=nobody/no-such-dataset",
        [
            "data.path entry nobody/no-such-dataset matches no file, and no dataset of that name is "
            "in the local Hugging Face cache",
            "nothing is downloaded",
        ],
    ),
    (
        "data.path={tmp}/field.jsonl data.task_mb=0",
        ["data.task_mb=0.0 is out of range: set data.task_mb > 0"],
    ),
    (
        "data.path={tmp}/field.jsonl launcher=slurm launcher.tasks=0 launcher.retries=-1",
        [
            "launcher.tasks=0 is out of range: set launcher.tasks >= 1",
            "launcher.retries=-1 is out of range: set launcher.retries >= 0",
        ],
    ),
]


@pytest.fixture(scope="module")
def bad_corpora(tmp_path_factory):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = tmp_path_factory.mktemp("corpora")
    pq.write_table(pa.table({"id": [1, 2], "content": ["a", "b"]}), tmp / "no_text_column.parquet")
    (tmp / "not_gzip.jsonl.gz").write_bytes(b'{"text": "not compressed"}\n')
    lines = b"".join(b'{"text": "line %d"}\n' % i for i in range(5000))
    (tmp / "truncated.jsonl.bz2").write_bytes(bz2.compress(lines)[:-100])
    (tmp / "field.jsonl").write_text('{"id": 1, "text": "a"}\n\n{"id": 2, "content": "b"}\n')
    (tmp / "broken.jsonl").write_text('{"text": "a"}\n{"text": "b"\n')
    rows = datasets.Dataset.from_dict({"text": ["a", "b"]})
    datasets.DatasetDict({"train": rows, "validation": rows}).save_to_disk(tmp / "splits")
    (tmp / "binary.bin").write_bytes(gzip.compress(b"x" * 1000))
    return tmp


@pytest.mark.parametrize(
    "overrides,messages", PREPARE_CASES, ids=[c[0][:40] for c in PREPARE_CASES]
)
def test_bad_corpus_is_refused_before_any_work(overrides, messages, bad_corpora, tmp_path, capsys):
    overrides = overrides.format(tmp=bad_corpora).split()
    code = main(["prepare", *overrides, f"out={tmp_path}/out"])
    err = capsys.readouterr().err
    assert code == 2, err
    for message in messages:
        assert message.format(tmp=bad_corpora) in err
    assert not (tmp_path / "out").exists()


def test_a_prepare_refusal_reaches_the_terminal_without_a_traceback(bad_corpora, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait",
            "prepare",
            f"data.path={bad_corpora}/field.jsonl",
            f"out={tmp_path}/out",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert f"{bad_corpora}/field.jsonl line 3 has no field 'text'" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not any(tmp_path.iterdir())
