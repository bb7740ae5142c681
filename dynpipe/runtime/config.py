"""The configuration of a training run: plain data, validated on construction.

Kept apart from the training loop so the command line can take its flags and defaults from
these dataclasses (``dynpipe.cliargs``) without importing torch's pipelining machinery.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dynpipe.errors import UserError
from dynpipe.planner.plan import SCHEDULES
from dynpipe.runtime.adapt.config import AdaptConfig
from dynpipe.runtime.optim import OptimConfig

__all__ = ["TrainConfig"]


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs besides the topology.

    ``dynpipe train`` makes a flag of every field (``dynpipe.cliargs``): the entries below
    are its help ("unset" is None, the flag not given).

    model: zoo name or package.module:factory.
    model_args: the model's keyword config (``--model-arg KEY=VALUE``).
    data: the data source: synthetic, digits, cifar10, imagefolder, text or pystdlib (this
        Python's standard library sources as bytes, for gpt/bert).
    data_path: local dataset path (real datasets are read from here only, never downloaded).
    data_workers: processes loading batches ahead on the first and last stage's ranks
        (0: in the training process; unset: on CUDA up to 4, within this host's cores per
        rank, and 0 on CPU, where workers would take cores from the stages).
    device_batches: > 0 makes that many batches once, keeps them on the device and cycles
        them (step s trains on batch s mod N): the GPUs measured without the loader, for
        benchmarks. 0: every step its own batch, through the loader.
    steps: training steps to run.
    batch_size: samples per step, split into ``microbatches``.
    microbatches: microbatches per step (unset: the plan's, else 4).
    schedule: pipeline schedule (unset: the plan's, else 1f1b); interleaved-1f1b, zb, zbv
        and dualpipev are torch's multi-stage schedules; 2bw is PipeDream-2BW's delayed
        weight update, which changes what training computes (docs/schedules.md).
    chunks: virtual stages per rank without a plan (unset: 2 under a multi-stage
        schedule, else 1).
    stages: without a plan, this many equal-layer stages (unset: the world size over
        ``dp``).
    dp: pipeline replicas (data parallelism): N ranks run dp pipelines of N/dp stages on a
        (dp, pp) device mesh, each taking its share of every batch, gradients averaged
        across them (unset: the plan's, else 1).
    plan: plan JSON (from ``dynpipe plan``).
    optim: optimizer and learning-rate schedule.
    bf16: bfloat16 autocast on GPU.
    fp16: float16 autocast on GPU with one dynamic loss scale for the whole pipeline: an inf
        or NaN gradient on any rank skips the step on every rank and halves the scale; 2000
        clean steps in a row double it (``dynpipe.runtime.scaler``).
    recompute: activation recomputation: none, all (every layer keeps only its input and
        runs its forward again in the backward), or auto (the cheapest layers that make each
        stage fit its device's memory, chosen again whenever layers move); unset: the
        plan's own list, else none.
    memory_gb: GiB of device memory a stage may fill, for --recompute auto (unset: 90% of
        the GPU's free memory at start-up).
    compile: compile every layer with torch.compile, one layer at a time and in place
        (per-layer timing, migration and checkpoints unchanged; ``docs/performance.md``).
    compile_backend: the torch.compile backend of ``compile`` (inductor; aot_eager runs
        without a C++ compiler and gives eager's numbers bit for bit).
    timing: the per-microbatch stage timers.
    seed: seed of the model's weights and the data.
    log: JSONL run-log path, written by the last stage's rank (unset:
        runs/<model>-<time>/log.jsonl).
    tensorboard: also write the run log's scalars and adaptation decisions as TensorBoard
        event files in this folder, live (needs pip install 'dynpipe[tb]').
    log_every: steps between the gathers of per-stage timings (one small collective).
    save_every: checkpoint every N steps (0: never).
    save_dir: checkpoint folder: every save a fresh ckpt-<step>-<id> subfolder there,
        published atomically (``dynpipe.runtime.checkpoint``).
    keep_checkpoints: published checkpoints kept in save_dir (older ones are deleted).
    resume: checkpoint folder (or a save_dir: its newest) to resume from under this run's
        plan; "auto": the newest in save_dir under the plan and adaptation state it was saved
        with, or a fresh start when there is none.
    max_restarts: relaunch the workers up to N times when one dies, each time resuming from
        the run's newest checkpoint (needs save_every and save_dir; implies --resume auto).
    progress: the progress bar.
    adapt: repartitioning policy (``static`` never repartitions); its ``monitor_every``
        replaces ``log_every`` when adapting, since one gather serves both.
    scenario: interference scenario TOML (``recipes/scenarios/``).
    predictor: trained slowdown predictor (.json or .json.gz from ``dynpipe predictor
        fit``), for ``--adapt adaptive`` or ``restart``.
    telemetry: device telemetry sampled in a side thread and gathered with stage times.
    gc_every: steps between Python garbage collections, made at the same step on every rank
        so no rank stalls the others mid-step (0: Python's own collector).
    eval_every: evaluate on the held-out split every N steps and after the last (0: never),
        logging ``eval`` records: loss, top-1 accuracy, perplexity for gpt/bert.
    eval_batches: batches (of ``batch_size``) per evaluation (unset: the held-out split
        once, at most 50; 10 for synthetic data).
    freeze: freeze converged leading layers once the loss has stopped falling and their
        gradient norms are flat (PipeTransformer's idea; CHANGES WHAT TRAINING COMPUTES).
    freeze_every: steps between freeze checks (the window the loss and a layer's gradient
        norm are averaged over).
    freeze_threshold: relative rate per window under which the loss has stopped falling
        (against the fastest fall seen) and a layer's gradient norm is flat (against its
        mean).
    freeze_alpha: the largest fraction of the layers still training that one check may
        freeze (at least one; the last layer always trains).
    freeze_patience: windows the trends are fitted over (a check decides on the last
        ``freeze_patience + 1`` windows; 1: the last two).
    autodp: with ``freeze``: host more pipeline replicas on the GPUs a frozen prefix frees,
        live, when the adaptation rule predicts it pays (PipeTransformer's AutoDP).
    """

    model: str = "mlp"
    model_args: dict[str, Any] = field(default_factory=dict)
    data: str = "synthetic"
    data_path: str | None = None
    data_workers: int | None = field(default=None, metadata={"metavar": "N"})
    device_batches: int = field(default=0, metadata={"metavar": "N"})
    steps: int = 100
    batch_size: int = 32
    microbatches: int | None = None
    schedule: str | None = field(default=None, metadata={"choices": SCHEDULES})
    chunks: int | None = field(default=None, metadata={"metavar": "V"})
    stages: int | None = None
    dp: int | None = field(default=None, metadata={"metavar": "R"})
    plan: str | None = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    bf16: bool = False
    fp16: bool = False
    recompute: str | None = field(default=None, metadata={"choices": ("none", "all", "auto")})
    memory_gb: float | None = field(default=None, metadata={"metavar": "GB"})
    compile: bool = False
    compile_backend: str = "inductor"
    timing: bool = True
    seed: int = 0
    log: str | None = None
    tensorboard: str | None = field(default=None, metadata={"metavar": "DIR"})
    log_every: int = 10
    save_every: int = 0
    save_dir: str | None = None
    keep_checkpoints: int = field(default=3, metadata={"metavar": "N"})
    resume: str | None = None
    max_restarts: int = field(default=0, metadata={"metavar": "N"})
    progress: bool = True
    adapt: AdaptConfig = field(default_factory=lambda: AdaptConfig(mode="static"))
    scenario: str | None = None
    predictor: str | None = None
    telemetry: bool = True
    gc_every: int = field(default=50, metadata={"metavar": "N"})
    eval_every: int = field(default=0, metadata={"metavar": "N"})
    eval_batches: int | None = field(default=None, metadata={"metavar": "N"})
    freeze: bool = False
    freeze_every: int = field(default=20, metadata={"metavar": "N"})
    freeze_threshold: float = 0.05
    freeze_alpha: float = 0.5
    freeze_patience: int = field(default=10, metadata={"metavar": "N"})
    autodp: bool = False

    def __post_init__(self) -> None:
        if self.fp16 and self.bf16:
            raise UserError(
                "--fp16 and --bf16 both ask for the autocast dtype; give one (--bf16 needs no "
                "loss scale where the GPU supports it)"
            )
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise UserError(f"--memory-gb must be > 0 GiB, got {self.memory_gb}")
        if self.steps < 0:
            raise UserError(f"--steps must be >= 0, got {self.steps}")
        if self.batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.data_workers is not None and self.data_workers < 0:
            raise UserError(f"--data-workers must be >= 0, got {self.data_workers}")
        if self.device_batches < 0:
            raise UserError(
                f"--device-batches must be >= 0 (0: load every step's batch), got "
                f"{self.device_batches}"
            )
        if self.dp is not None and self.dp < 1:
            raise UserError(f"--dp must be >= 1 (pipeline replicas), got {self.dp}")
        if self.gc_every < 0:
            raise UserError(
                f"--gc-every must be >= 0 (0: Python's own collector), got {self.gc_every}"
            )
        if self.log_every < 1:
            raise UserError(f"--log-every must be >= 1, got {self.log_every}")
        if self.eval_every < 0 or (self.eval_batches is not None and self.eval_batches < 1):
            raise UserError(
                f"--eval-every must be >= 0 (0: no evaluation) and --eval-batches >= 1, got "
                f"{self.eval_every} and {self.eval_batches}"
            )
        if self.microbatches is not None and self.microbatches < 1:
            raise UserError(
                f"--microbatches must be >= 1, got {self.microbatches}; leave it out for the "
                "plan's (or 4)"
            )
        if self.keep_checkpoints < 1:
            raise UserError(f"--keep-checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.max_restarts and not (self.save_dir and self.save_every):
            raise UserError(
                f"--max-restarts {self.max_restarts} needs --save-every K --save-dir DIR: a "
                "relaunch resumes from the newest checkpoint, and without one it would start over"
            )
        if self.resume == "auto" and not self.save_dir:
            raise UserError("--resume auto needs --save-dir DIR, the folder it resumes from")
        if self.predictor and self.adapt.mode not in ("adaptive", "restart"):
            raise UserError(
                f"--predictor is read only by --adapt adaptive or restart, not --adapt "
                f"{self.adapt.mode}; drop --predictor or use --adapt adaptive"
            )
        if self.adapt.mode == "restart" and not (self.save_dir or self.log):
            raise UserError(
                "--adapt restart needs --save-dir or --log: relaunched workers must "
                "find the checkpoint in a folder every worker agrees on"
            )
        if self.adapt.elastic and self.dp is not None and self.dp > 1:
            raise UserError(
                f"--elastic changes the stage count of one pipeline; --dp {self.dp} replicas "
                "are not supported with it (drop --elastic or --dp)"
            )
        if self.autodp and not self.freeze:
            raise UserError(
                "--autodp hosts pipeline replicas on the GPUs that freezing frees; it needs "
                "--freeze (add --freeze, which changes what training computes, or drop --autodp)"
            )
        if self.freeze and not self.autodp and self.dp is not None and self.dp > 1:
            raise UserError(
                f"--freeze is for one pipeline unless --autodp; --dp {self.dp} replicas are "
                "not supported with it (drop --freeze or --dp, or add --autodp)"
            )
        if self.freeze:
            from dynpipe.runtime.freeze import FreezeRule

            FreezeRule(
                every=self.freeze_every,
                threshold=self.freeze_threshold,
                alpha=self.freeze_alpha,
                patience=self.freeze_patience,
            )
            # A freeze may move layers: at a window's end, so no window mixes two plans.
            window = self.adapt.monitor_every if self.adapt.adapting else self.log_every
            if self.freeze_every % window:
                flag = "--monitor-every" if self.adapt.adapting else "--log-every"
                raise UserError(
                    f"--freeze-every {self.freeze_every} is not a multiple of the monitoring "
                    f"window ({flag} {window}); use a multiple such as "
                    f"{window * max(1, round(self.freeze_every / window))}"
                )
        if self.save_every and not self.save_dir:
            raise UserError("--save-every needs --save-dir DIR to write checkpoints into")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def of_logged_model(cls, conf: dict[str, Any], adapt: AdaptConfig) -> TrainConfig:
        """What a run log's header (``conf``: its ``to_dict``) records of the model and its
        batches, with ``adapt``: enough to rebuild the run's model and cost its layers, as
        the replay tools do (the rest of the run's settings are left at their defaults)."""
        return cls(
            model=conf["model"],
            model_args=conf["model_args"],
            data=conf.get("data", "synthetic"),
            batch_size=conf["batch_size"],
            microbatches=conf["microbatches"],
            adapt=adapt,
            progress=False,
        )
