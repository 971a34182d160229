"""The training loop every rank runs once torch.distributed is up."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hpctrain.checkpoint.manager import CheckpointManager
from hpctrain.checkpoint.memory import MemorySnapshots, current_plan
from hpctrain.checkpoint.rng import RNG
from hpctrain.data import build_dataset, eos_id
from hpctrain.train.batch import BatchLayout
from hpctrain.train.sampler import IGNORE, StepSampler, data_trace
from hpctrain.distributed.mesh import build_mesh
from hpctrain.models.llama import build_meta, init_param_
from hpctrain.parallel import parallelize
from hpctrain.parallel.stateful import ModelState, OptimizerState
from hpctrain.core.compose import to_dict
from hpctrain.core.rundir import list_complete, write_atomic, write_outcome
from hpctrain.core.spec import EngineSpec, engine_spec
from hpctrain.core import faults
from hpctrain.train.metrics import MetricsLogger, peak_rss_bytes
from hpctrain.train.optim import build_optimizer
from hpctrain.train.preempt import Preemption
from hpctrain.train.profile import PhaseMemory, Profiler
from hpctrain.train.progress import Progress, Schedule
from hpctrain.train.router_stats import RouterStats
from hpctrain.train.scaler import MIN_SCALE, LossScaler
from hpctrain.train.stragglers import Stragglers
from hpctrain.core.schema import Config, TrainConfig
from hpctrain.checkpoint.hf_weights import load_hf
from hpctrain.parallel.float8 import after_optimizer_step
from hpctrain.parallel.pipeline import build_schedule, forward_only
from hpctrain.train.trackers import from_config
from hpctrain.train import preference
from hpctrain.models.lora import adapters_disabled

log = logging.getLogger("hpctrain")


@dataclass
class Outcome:
    status: str  # completed | preempted | nonfinite
    step: int  # optimizer steps done
    losses: list
    checkpoint: str | None = None
    nonfinite: dict | None = None  # status nonfinite: the step that stopped the run, its loss and gradient norm


# What became of a step's update (Trainer.train_step). OVERFLOW: train.precision=fp16's gradients overflowed at
# the loss scale on some rank; the step is skipped on every rank and the scale halves (hpctrain.train.scaler),
# an expected event apart from train.on_nonfinite's SKIPPED.
APPLIED, SKIPPED, STOPPED, OVERFLOW = "applied", "skipped", "stopped", "overflow"


def nonfinite_action(train: TrainConfig, skipped: int) -> str:
    """SKIPPED or STOPPED: what a step whose loss or gradient norm is not finite does, the run having
    skipped `skipped` steps before it."""
    if train.on_nonfinite == "skip" and skipped < train.max_skipped_steps:
        return SKIPPED
    return STOPPED


def grad_norm_and_clip(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """The global gradient norm over every shard on every mesh dimension (data, tensor, and the
    pipeline stages of other ranks); clips in place when max_norm > 0."""
    # DTensors of different meshes (expert parallel's experts beside the dense weights) cannot share
    # one foreach kernel: one norm per mesh, combined.
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    sq = None
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # sums squares over the data, tensor and expert dimensions
        sq = norm.float() ** 2 if sq is None else sq + norm.float() ** 2
    if sq is None:
        sq = torch.zeros((), device=params[0].device if params else "cpu")
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)  # each stage holds different parameters
    norm = sq.sqrt()
    if max_norm > 0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm


class Trainer:
    def __init__(self, spec: EngineSpec, run_dir: str, device: torch.device):
        """`spec`: the run as the engine runs it (hpctrain.core.spec.engine_spec), its config with it."""
        cfg = spec.config
        self.cfg, self.spec, self.run_dir, self.device = cfg, spec, run_dir, device
        self.rank = dist.get_rank()
        self.meshes = build_mesh(self.spec.layout, device.type)
        self.dp_mesh = self.meshes["dp"]

        init = partial(lambda m, name, t, gen: init_param_(name, t, m, gen), cfg.model)
        self.par = parallelize(build_meta(cfg.model, cfg.data.seq_len), self.meshes, self.spec, device, init, seed=cfg.train.seed,
                               pin_memory=bool(cfg.offload.pin_memory))
        self.parts = self.par.parts
        # train.objective=dpo, reference=copy: the starting weights again, built and sharded as the policy
        # (the same parallelize, seed and init_from), frozen and never stepped; base needs no second model.
        self.ref_parts = None
        if spec.dpo_reference == "copy":
            ref = parallelize(build_meta(cfg.model, cfg.data.seq_len), self.meshes, self.spec, device, init,
                              seed=cfg.train.seed, pin_memory=bool(cfg.offload.pin_memory)).parts
            for part in ref:
                part.requires_grad_(False)
                part.eval()
            self.ref_parts = ref
        self.params = [p for part in self.parts for p in part.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(
            self.params, cfg.optim, cfg.train.steps, offload=cfg.offload,
            zero_group=self.dp_mesh.get_group() if self.spec.data_parallel == "zero1" else None,
            shard_group=self.dp_mesh.get_group() if self.spec.data_parallel == "replicate_zero1" else None)
        self.pp_group = self.meshes.group("pp") if self.spec.pipeline else None
        self.routers = RouterStats(self.parts, cfg.model.moe.experts, cfg.model.moe.bias_update_rate,
                                   self.dp_mesh.get_group(), self.pp_group, device, blocks=cfg.model.n_layers)
        # A micro-batch's share of the step's loss; pipeline schedules divide the gradients themselves.
        # Each cp rank's balancing losses are its part of the sequence's, and the gradients are averaged
        # over the cp ranks (which are data-parallel ranks for them): x cp makes the sum the whole's.
        self._aux_scale = (1.0 if self.spec.pipeline else 1.0 / self.spec.microbatches) * self.spec.layout.cp
        self.routers.set_aux_scale(self._aux_scale)
        self.schedule = self._pipeline_schedule() if self.spec.pipeline else None
        eos = eos_id(cfg)
        if cfg.data.document_mask and eos is None:  # the login node refuses this; a rank must not mask nothing
            raise ValueError("data.document_mask=true needs an end-of-document id: data.eos_id or the shards' eos_id")
        self.batch = BatchLayout(eos, cfg.data.document_mask, cfg.data.document_positions,
                                 self.meshes["cp"].get_local_rank(),
                                 self.spec.layout.cp)
        dataset = build_dataset(cfg)
        self.sampler_masked = dataset.has_loss_mask
        self.rows = 2 if spec.dpo else 1  # sequences per sample: a preference pair is two
        self.dpo_metrics: dict = {}  # the last step's preference.METRICS
        self.sampler = StepSampler(dataset, cfg.train.global_batch, cfg.train.micro_batch,
                                   self.meshes["data"].get_local_rank(), self.meshes["data"].size(), cfg.data.seed,
                                   trace=data_trace(run_dir))  # HPCTRAIN_DATA_TRACE=1 only
        self.progress = Progress()
        # train.precision=fp16: dynamic loss scaling, its state in checkpoints (only then: checkpoints of other
        # precisions, older ones included, have no "scaler" entry and need none).
        self.scaler = (LossScaler(device, cfg.train.fp16.init_scale, cfg.train.fp16.growth_interval)
                       if self.spec.loss_scaling else None)
        self.step_scale: float | None = None  # the loss scale the last step's backward ran with
        state = {
            # checkpoint.weights=adapters: the LoRA adapters alone, the frozen base re-read from model.init_from
            "model": ModelState(self.parts, self.spec.checkpoint_weights == "adapters", cfg.model.init_from),
            "optim": OptimizerState(self.parts, self.optimizer),
            "scheduler": Schedule(self.scheduler, self.optimizer),
            "data": self.sampler,
            "progress": self.progress,
            "rng": RNG(),
        }
        if self.scaler is not None:
            state["scaler"] = self.scaler
        self.ckpt = CheckpointManager(run_dir, cfg.checkpoint, state, total_steps=cfg.train.steps,
                                      meta={"layout": asdict(self.spec.layout), "config": to_dict(cfg)})
        # checkpoint.memory_every: snapshots into the node's memory directory, which the node agent makes
        # and names (HPCTRAIN_MEMORY_DIR); without an agent (torchrun, tests of the loop alone) there are none.
        memory_dir = os.environ.get("HPCTRAIN_MEMORY_DIR")
        self.snapshots = (MemorySnapshots(self.ckpt, memory_dir, cfg.checkpoint.memory_every, current_plan(run_dir))
                          if cfg.checkpoint.memory_every > 0 and memory_dir else None)
        self._val_data = None
        self.resumed_from: int | None = None
        self.stragglers = Stragglers(cfg.launcher.straggler_ratio, cfg.launcher.straggler_steps)

    @classmethod
    def of(cls, cfg: Config, run_dir: str, device: torch.device) -> "Trainer":
        """The trainer of a composed config on this process group's ranks."""
        return cls(engine_spec(cfg, dist.get_world_size()), run_dir, device)

    @property
    def step(self) -> int:
        return self.progress.step

    @step.setter
    def step(self, value: int) -> None:
        self.progress.step = value

    def save(self, blocking: bool = True) -> None:
        self.ckpt.save(self.step, blocking=blocking)

    def close(self, wait: bool = True) -> None:
        """Stop the checkpoint threads (fit does at a run's end). wait=False: the teardown after a failure,
        before this process builds a new Trainer: nothing in flight is waited for."""
        self.ckpt.close(wait=wait)

    def resume(self, warn) -> None:
        """Continue from the newest complete checkpoint in the run directory, if there is one; else
        start from model.init_from's weights where given (and model.lora.init_from's adapters)."""
        self.resumed_from = self.ckpt.resume(warn)
        if self.ref_parts is not None:  # the reference is the start, whatever checkpoint the policy resumes
            self._load_start(self.ref_parts)
        if self.resumed_from is not None:
            if self.ckpt.objects["model"].base_left_out:  # an adapter-only checkpoint: the base, checked the same
                load_hf(self.parts, self.cfg.model.init_from, self.cfg.model)
                log.info("frozen base from %s (the checkpoint holds the adapters)", self.cfg.model.init_from)
            return self._quantize_base()
        self._load_start(self.parts)
        self._quantize_base()

    def _quantize_base(self) -> None:
        """QLoRA (model.lora.quantize=nf4): the frozen base to NF4, once its full-precision weights are loaded
        (hpctrain.parallel.quantize); the last thing resume does."""
        if self.spec.lora and self.spec.lora.quantize == "nf4":
            from hpctrain.parallel.quantize import quantize_base

            self.base_nf4_bytes = quantize_base(self.parts)
            log.info("base of the adapted layers in NF4: %.1f MiB on this rank", self.base_nf4_bytes / 2**20)

    def _load_start(self, parts) -> None:
        """model.init_from's weights (and model.lora.init_from's adapters) into `parts`, where given."""
        if self.cfg.model.init_from:
            load_hf(parts, self.cfg.model.init_from, self.cfg.model)
            log.info("weights from %s", self.cfg.model.init_from)
        if self.spec.lora and self.cfg.model.lora.init_from:
            from hpctrain.checkpoint.peft_format import load_peft

            n = load_peft(parts, self.cfg.model.lora.init_from, self.cfg.model)
            log.info("%d adapter tensors from %s", n, self.cfg.model.lora.init_from)

    # ------------------------------------------------------------ one step

    def _sync_context(self, last: bool):
        """Reduce gradients after every micro-batch, or only after a step's last (spec.grad_sync)."""
        sync = last or self.spec.grad_sync == "microbatch"
        m = self.parts[0]
        if hasattr(m, "no_sync"):  # DDP
            return contextlib.nullcontext() if sync else m.no_sync()
        if hasattr(m, "set_requires_gradient_sync"):  # FSDP2
            m.set_requires_gradient_sync(sync)
            if not self.spec.sharding.params:
                # ZeRO-2: parameters stay gathered for the whole step, one all-gather per step
                # (FSDP2 would reshard after every backward and gather again in the next forward).
                m.set_reshard_after_backward(last)
        return contextlib.nullcontext()

    def _compute_context(self):
        """Loss parallel keeps the logits split over the vocabulary under tensor parallel; autocast
        runs the matmuls in the spec's compute dtype where parameters are not cast (DDP, ZeRO-1)."""
        stack = contextlib.ExitStack()
        if self.spec.layout.tp > 1:
            stack.enter_context(loss_parallel())
        if self.spec.dtypes.autocast:
            stack.enter_context(torch.autocast(self.device.type, dtype=getattr(torch, self.spec.dtypes.compute)))
        return stack

    def loss_fn(self, loss: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """This micro-batch's part of the step's loss: its summed token losses, which the model's output layer
        computes given the targets (hpctrain.models.loss), times _loss_scale. (A pipeline schedule passes the
        targets again: the last stage's forward has had them.)"""
        return loss * self._loss_scale

    _loss_scale = 1.0

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward runs on: times fp16's loss scale (hpctrain.train.scaler), else itself."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def _train_loss_fn(self, loss: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """loss_fn as a pipeline schedule runs it in training: the schedule runs backward on what it returns,
        so fp16's loss scale is applied here (the losses it hands back are scaled: _pipeline_forward_backward
        divides them again)."""
        return self._scaled(self.loss_fn(loss, targets))

    def _scale_loss_for(self, micro, pipelined: bool, masked: bool) -> None:
        """The step's loss is the mean over the trained tokens of the whole global batch (chat data: the
        assistant's; else every token), however they fall on micro-batches and ranks. Data-parallel
        gradients are averaged over dp_mesh (context-parallel ranks included) and pipeline schedules
        divide by the micro-batches: both are undone here."""
        if masked:
            n = torch.tensor(float(sum(int((y != IGNORE).sum()) for _, y in micro)), device=self.device)
            dist.all_reduce(n, group=self.meshes.group("data"))
            count = max(n.item(), 1.0)
        else:
            count = self.cfg.train.global_batch * self.cfg.data.seq_len
        self._loss_scale = self.dp_mesh.size() * (len(micro) if pipelined else 1) / count

    def _pipeline_schedule(self):
        # heavy (~2 s: it pulls in torch._dynamo): only ranks of a pipelined layout pay for it
        from torch.distributed.pipelining import PipelineStage

        stages = [PipelineStage(part, s, self.par.num_stages, self.device, group=self.pp_group)
                  for part, s in zip(self.parts, self.par.stage_indices)]
        return build_schedule(stages, self.spec.pipeline.schedule, self.spec.microbatches, self._train_loss_fn)

    _memory: Optional[PhaseMemory] = None  # profile.memory: peak memory per phase (set by fit)

    def _phase(self, name: str):
        """A phase of the step whose peak memory profile.memory records; nothing when it is off."""
        return contextlib.nullcontext() if self._memory is None else self._memory.phase(name)

    def _reference_logps(self, x, y, kw) -> torch.Tensor:
        """Each row's log-probability of its completion under the reference (no gradients)."""
        with torch.no_grad():
            if self.ref_parts is not None:
                return -self.ref_parts[0](x, targets=y, **kw)
            with adapters_disabled(self.parts[0]):
                return -self.parts[0](x, targets=y, **kw)

    def _dpo_loss(self, x, y, kw) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch's pairs (rows interleaved chosen/rejected): its part of the step's loss, the mean
        over the global batch's pairs (data-parallel gradients are averaged over dp: x dp undoes it), and its
        metric sums (preference.pair_sums)."""
        d = self.cfg.train.dpo
        ref = self._reference_logps(x, y, kw)
        logps = -self.parts[0](x, targets=y, **kw)
        pairs = preference.pair_losses(logps, ref, (y != IGNORE).sum(dim=-1), str(d.loss), d.beta,
                                       d.label_smoothing)
        loss = pairs.sum() * (self.dp_mesh.size() / self.cfg.train.global_batch)
        return loss, preference.pair_sums(logps, ref, d.beta)

    def _dpo_metrics(self, sums: torch.Tensor) -> dict:
        """The step's metrics: the micro-batches' and data-parallel ranks' sums over the global batch's pairs."""
        dist.all_reduce(sums, group=self.meshes.group("data"))
        return dict(zip(preference.METRICS, (sums / self.cfg.train.global_batch).tolist()))

    def _dpo_forward_backward(self, micro) -> torch.Tensor:
        loss_sum = torch.zeros((), device=self.device)
        sums = torch.zeros(len(preference.METRICS), device=self.device)
        for i, (x, y) in enumerate(micro):
            x, y, kw = self._on_device(*self.batch(x, y))
            with self._sync_context(i == len(micro) - 1), self._compute_context():
                with self._phase("forward"):
                    loss, s = self._dpo_loss(x, y, kw)
                with self._phase("backward"):
                    self._scaled(loss).backward()
            loss_sum += loss.detach()
            sums += s
        self.dpo_metrics = self._dpo_metrics(sums)
        return self._poisoned(loss_sum)

    def _forward_backward(self, micro) -> torch.Tensor:
        if self.spec.dpo:
            return self._dpo_forward_backward(micro)
        loss_sum = torch.zeros((), device=self.device)
        self._scale_loss_for(micro, pipelined=False, masked=self.sampler_masked)
        for i, (x, y) in enumerate(micro):
            x, y, kw = self._on_device(*self.batch(x, y))
            with self._sync_context(i == len(micro) - 1), self._compute_context():
                with self._phase("forward"):
                    loss = self.loss_fn(self.parts[0](x, targets=y, **kw))
                with self._phase("backward"):
                    self._scaled(loss).backward()
            loss_sum += _plain(loss.detach())
        return self._poisoned(loss_sum)

    def _poisoned(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's loss, before any reduction; HPCTRAIN_FAULT="nonfinite:step=N,rank=R" makes rank R's
        NaN at step N while its gradients stay finite: only the loss can tell the other ranks."""
        if faults.armed("nonfinite", step=self.step + 1, rank=self.rank) is None:
            return loss
        return loss + float("nan")

    def _inf_gradient(self) -> None:
        """HPCTRAIN_FAULT="infgrad:step=N,rank=R[,param=NAME]": an infinity in one of rank R's gradients at step
        N (the first parameter whose name contains NAME, or the first), written after backward (and so after
        data parallel's reduction): no other rank holds it, only the trainer's agreement can tell them. Under
        fp16 an overflow; otherwise a non-finite gradient (train.on_nonfinite)."""
        fault = faults.armed("infgrad", step=self.step + 1, rank=self.rank)
        if fault is None:
            return
        with torch.no_grad():
            for part in self.parts:
                for name, p in part.named_parameters():
                    g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    # (an FSDP shard may hold no element of a small parameter)
                    if g is not None and g.numel() and str(fault.get("param", "")) in name:
                        g.view(-1)[0] = float("inf")
                        return

    def _on_device(self, x, y, kw):
        kw = {k: v.to(self.device, non_blocking=True) for k, v in kw.items()}
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True), kw

    def _pipeline_forward_backward(self, micro) -> torch.Tensor:
        self._scale_loss_for(micro, pipelined=True, masked=self.sampler_masked)
        x, y, kw = self._on_device(*self.batch(torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])))
        losses: list = []
        args = (x,) if self.par.first else ()
        with self._compute_context():
            # return_outputs=False: the last stage would otherwise keep every micro-batch's logits.
            # kw (positions, documents) reach every stage's forward, split into micro-batches as x is.
            # The targets also reach every stage's forward: the last one's output layer computes the loss.
            self.schedule.step(*args, target=y if self.par.last else None, losses=losses, return_outputs=False,
                               targets=y, **kw)
        # Only the rank holding the last stage knows the loss; the pipeline group sums it out.
        loss = (torch.stack([_plain(l.detach()).float() for l in losses]).mean() if self.par.last
                else torch.zeros((), device=self.device))
        if self.scaler is not None:  # the schedule's losses are scaled (_train_loss_fn); a power of two: exact
            loss = loss / self.scaler.value
        loss = self._poisoned(loss)
        dist.all_reduce(loss, group=self.pp_group)  # a non-finite loss too reaches every stage
        return loss

    # What became of the last step's update: APPLIED; or, its loss or gradient norm not finite, SKIPPED (the
    # step counts, weights and optimizer state unchanged) or STOPPED (nothing changed, not even the step
    # count: the run ends); under fp16, OVERFLOW (as SKIPPED, but counted apart, by the scaler).
    update = APPLIED

    def _action(self, loss: torch.Tensor, norm: torch.Tensor) -> str:
        """What becomes of this step's update, the same on every rank: `loss` is the mean over the ranks and
        `norm` the global norm, so any rank's non-finite value is every rank's; under fp16 the ranks also agree
        on an overflow (hpctrain.train.scaler), and the scaler backs off or grows."""
        if self.scaler is None:
            finite = bool(torch.isfinite(loss) & torch.isfinite(norm))
            return APPLIED if finite else nonfinite_action(self.cfg.train, self.progress.skipped)
        self.step_scale = self.scaler.value
        overflow = self.scaler.agree(norm)
        self.scaler.update(overflow)
        if not bool(torch.isfinite(loss)):
            return nonfinite_action(self.cfg.train, self.progress.skipped)
        if not overflow:
            return APPLIED
        if self.step_scale < MIN_SCALE:  # halving has not helped: the gradient is not finite at any scale
            return nonfinite_action(self.cfg.train, self.progress.skipped)
        self.scaler.overflows += 1
        return OVERFLOW

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: its loss (the mean over the ranks) and global gradient norm; self.update says what
        became of its update."""
        micro = self.sampler.next_step()
        if self.scaler is not None:  # the balancing losses' gradients join the scaled loss's: scaled alike
            self.routers.set_aux_scale(self._aux_scale * self.scaler.value)
        if self.schedule is not None:
            with self._phase("forward_backward"):  # interleaved inside the pipeline schedule
                loss = self._pipeline_forward_backward(micro)
        else:
            loss = self._forward_backward(micro)
        self._inf_gradient()
        with self._phase("optimizer"):
            if self.scaler is not None:  # the norm, clipping and the update see true gradients
                self.scaler.unscale_(self.params)
            # The norm is computed whatever optim.grad_clip says: the update depends on it being finite.
            norm = grad_norm_and_clip(self.params, self.cfg.optim.grad_clip, self.pp_group)
            # Every data-parallel rank saw different samples: the step's loss is their mean. Reduced before
            # the update, it carries a non-finite loss of any rank (the pipeline stages have the last one's)
            # to every rank, as the norm carries a non-finite gradient: all decide alike, no collective more.
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dp_mesh.get_group())
            self.update = self._action(loss, norm)
            if self.update == APPLIED:
                self.optimizer.step()
                after_optimizer_step(self.parts, self.spec)  # fp8 all-gather: the scales of the next gather
            self.optimizer.zero_grad(set_to_none=True)
            if self.update == STOPPED:
                return loss, norm
            self.scheduler.step()
            self.routers.after_step(move_biases=self.update == APPLIED)
        self.progress.step += 1
        self.progress.skipped += self.update == SKIPPED
        self.progress.tokens_seen += self.cfg.train.global_batch * self.rows * self.cfg.data.seq_len
        return loss, norm

    # ------------------------------------------------------------ validation

    def evaluate(self, beat=lambda *a, **k: None) -> float:
        """Mean loss over eval.batches global batches of the validation split. A sampler of its own
        reads the same samples every time, so the training stream and its RNG never move."""
        cfg = self.cfg
        if self._val_data is None:
            self._val_data = build_dataset(cfg, "val")
        sampler = StepSampler(self._val_data, cfg.train.global_batch, cfg.train.micro_batch,
                              self.meshes["data"].get_local_rank(), self.meshes["data"].size(), cfg.data.seed)
        total = torch.zeros((), device=self.device)
        for part in self.parts:
            part.eval()
        try:
            with torch.no_grad():
                for _ in range(cfg.eval.batches):
                    beat(self.step, "eval")
                    total += self._eval_batch(sampler.next_step())
        finally:
            for part in self.parts:
                part.train()
        dist.all_reduce(total, op=dist.ReduceOp.AVG, group=self.dp_mesh.get_group())
        return total.item() / cfg.eval.batches

    def _eval_batch(self, micro) -> torch.Tensor:
        if self.spec.dpo:  # the preference loss of the batch's pairs (the loop runs under no_grad)
            loss = torch.zeros((), device=self.device)
            for x, y in micro:
                x, y, kw = self._on_device(*self.batch(x, y))
                with self._compute_context():
                    loss += self._dpo_loss(x, y, kw)[0].detach()
            return loss
        # forward_only (pipelines) averages over micro-batches, as a schedule does
        self._scale_loss_for(micro, pipelined=self.schedule is not None,
                             masked=self._val_data.has_loss_mask)
        if self.schedule is None:
            loss = torch.zeros((), device=self.device)
            for x, y in micro:
                x, y, kw = self._on_device(*self.batch(x, y))
                with self._compute_context():
                    loss += _plain(self.loss_fn(self.parts[0](x, targets=y, **kw)).detach())
            return loss
        p = self.spec.pipeline
        owner = [r for s in range(p.stages) for r in range(p.ranks) if s in p.stage_ids(r)]
        with self._compute_context():
            loss = forward_only(dict(zip(self.par.stage_indices, self.parts)), owner,
                                self.meshes["pp"].get_local_rank(), self.pp_group,
                                [self.batch(x, y) for x, y in micro],
                                lambda out, y: _plain(self.loss_fn(out, y)), self.device)
        dist.all_reduce(loss, group=self.pp_group)  # from the rank of the last stage to every pp rank
        return loss

    def _eval_due(self) -> bool:
        every = self.cfg.eval.every
        return every > 0 and (self.step % every == 0 or self.step == self.cfg.train.steps)

    # ------------------------------------------------------------ the run

    def fit(self, preemption: Preemption | None = None, watchdog=None) -> Outcome:
        """Train to train.steps (or until the ranks agree to stop), resuming first. `watchdog`
        (hpctrain.train.watchdog) is told of every step and of the phases allowed to be slow."""
        cfg = self.cfg
        beat = watchdog.beat if watchdog is not None else (lambda *a, **k: None)
        beat(self.step, "load")
        self.resume(log.warning)
        logger = self._logger()
        # profile.*: off by default, and then nothing is made and nothing is measured.
        prof = (Profiler(cfg.profile, self.run_dir, self.rank, self.device, logger.event if logger else None)
                if cfg.profile.steps else None)
        mem = self._memory = PhaseMemory(self.device) if cfg.profile.memory else None
        preemption = preemption or Preemption().install()
        status, losses, nonfinite = "completed", [], None
        first = True
        try:
            while self.step < cfg.train.steps:
                beat(self.step, "start" if first else "step")  # the first step compiles and warms up
                if prof is not None:
                    prof.begin(self.step + 1)
                if mem is not None:
                    mem.begin_step()
                lr = self.scheduler.get_last_lr()[0]
                t0 = time.perf_counter()
                loss, norm = self.train_step()
                loss_v, norm_v, action = loss.item(), float(norm), self.update  # .item() waits for the step
                if action == STOPPED:
                    status, nonfinite = "nonfinite", self._stop_nonfinite(logger, loss_v, norm_v, lr, t0)
                    break
                flags = {APPLIED: {}, OVERFLOW: {"overflow": True}}.get(action, {"nonfinite": True})
                if action == SKIPPED and logger:
                    logger.event(f"step {self.step}: loss {loss_v:.4g}, gradient norm {norm_v:.4g}: not finite, the "
                                 f"update is skipped ({self.progress.skipped} of at most train.max_skipped_steps="
                                 f"{cfg.train.max_skipped_steps} in this run)")
                beat(self.step, "step")
                faults.after_step(self.step, self.rank)
                dt = time.perf_counter() - t0
                if not first:
                    beat(self.step, "step", dt)
                first = False
                losses.append(loss_v)
                val = self.evaluate(beat) if self._eval_due() else None
                # checkpoint.memory_every: the state after this step, copied before anything else runs
                flags = {**flags, **(self.snapshots.after_step(self.step) if self.snapshots else {})}
                if mem is None:  # with profile.memory the row waits for the step's save, to carry its peak
                    self._log(logger, loss_v, norm_v, lr, dt, val, extra=flags)
                if preemption.agreed(self.device if self.device.type == "cuda" else None):
                    status = "preempted"
                    if logger:
                        logger.event(f"{preemption.requested_by or 'a signal to another rank'}: saving step "
                                     f"{self.step} on every rank, then stopping")
                    beat(self.step, "save")
                    self._measured_save(lambda: self.ckpt.save(self.step, blocking=True))
                    if mem is not None:
                        self._log(logger, loss_v, norm_v, lr, dt, val, extra={**flags, **mem.take()})
                    break
                beat(self.step, "save")
                self._measured_save(lambda: self.ckpt.after_step(self.step))
                if mem is not None:
                    if self.step == cfg.train.steps:  # the end's save, measured with its step
                        self._measured_save(self._save_end)
                    self._log(logger, loss_v, norm_v, lr, dt, val, extra={**flags, **mem.take()})
                if prof is not None:
                    prof.end(self.step)
            if prof is not None:
                prof.close()  # a window a preemption cut short: what it recorded
            if status == "completed":
                beat(self.step, "save")
                self._save_end()
            self.ckpt.close()
        finally:
            if prof is not None:
                prof.close(export=False)  # a failed run: stop profiling, write nothing
            preemption.uninstall()
            if logger:
                logger.close()
        saved = self.ckpt.last_saved
        if status == "nonfinite":  # the newest checkpoint of the run, whichever start wrote it
            newest = list_complete(self.ckpt.root)
            checkpoint = str(newest[-1][1]) if newest else None
        else:
            checkpoint = str(self.ckpt.root / f"step-{saved:08d}") if saved is not None else None
        outcome = Outcome(status, self.step, losses, checkpoint, nonfinite)
        if self.rank == 0:
            write_outcome(self.run_dir, outcome.__dict__ | {"losses": None})
        return outcome

    def _stop_nonfinite(self, logger, loss: float, norm: float, lr: float, t0: float) -> dict:
        """The step after self.step went non-finite and the run stops there: its row in metrics.jsonl and
        a line for people; no save follows (the summary says what to do)."""
        step = self.step + 1
        self._log(logger, loss, norm, lr, time.perf_counter() - t0, step=step, extra={"nonfinite": True})
        if logger:
            logger.event(f"step {step}: loss {loss:.4g}, gradient norm {norm:.4g}: not finite; the update is not "
                         f"applied and the run stops (train.on_nonfinite={self.cfg.train.on_nonfinite}"
                         + (f", {self.progress.skipped} step(s) skipped already" if self.progress.skipped else "")
                         + "), without saving")
        return {"step": step, "loss": loss, "grad_norm": norm}

    def _save_end(self) -> None:
        """The end of a completed run: checkpoint.every's last save, and with checkpoint.final (the default)
        the last step whatever checkpoint.every says, so that a run ends with a model to export. Not again
        when this start resumed from that very step."""
        self.ckpt.finish(self.step)
        if self.cfg.checkpoint.final and self.ckpt.last_saved != self.step and self.resumed_from != self.step:
            self.ckpt.save(self.step, blocking=True)

    def _measured_save(self, save) -> None:
        """Run save(), a checkpoint call that saves this step or not; under profile.memory a save's
        peak memory is the step's checkpoint phase."""
        if self._memory is None:
            return save()
        with self._memory.phase("checkpoint"):
            save()
        pending = self.ckpt.pending  # an async save still being written counts
        if self.ckpt.last_saved != self.step and (pending is None or pending.step != self.step):
            self._memory.values.pop("checkpoint", None)  # nothing was saved

    def _logger(self) -> Optional[MetricsLogger]:
        if self.rank != 0:
            return None
        truncate_metrics(self.run_dir, self.step)
        logger = MetricsLogger(self.run_dir, self.cfg.train.steps,
                               trackers=from_config(self.cfg, self.run_dir, self.step))
        if self.resumed_from is not None:
            memory = (self.ckpt.restored or {}).get("kind") == "memory"
            logger.event(f"resumed from {'memory snapshot' if memory else 'checkpoint'} step {self.resumed_from}")
        return logger

    def _log(self, logger, loss: float, norm: float, lr: float, dt: float, val: float | None = None,
             extra: dict | None = None, step: int | None = None) -> None:
        """The row of `step` (default: the step just done); a non-finite step's row is always written."""
        step = self.step if step is None else step
        extra = dict(extra or {})
        if self.progress.skipped:  # the run's count: the progress line and the summary show it
            extra["skipped_steps"] = self.progress.skipped
        if self.scaler is not None:  # fp16: the scale this step's backward ran with, the run's overflows
            extra["loss_scale"] = self.step_scale
            if self.scaler.overflows:
                extra["overflow_steps"] = self.scaler.overflows
        if (step % self.cfg.train.log_every and step != self.cfg.train.steps and val is None
                and not extra.get("nonfinite") and not extra.get("overflow")):
            return
        spread = self.stragglers.observe(dt)  # a collective: every rank, at every logged step
        routing = self.routers.metrics()  # a collective over the pipeline stages, likewise
        if not logger:
            return
        tps = self.cfg.train.global_batch * self.rows * self.cfg.data.seq_len / dt
        extra.update(self.dpo_metrics)
        peak = self.cfg.cluster.peak_tflops * 1e12 * dist.get_world_size()
        logger.log(step, loss=loss, grad_norm=norm, lr=lr, tokens_per_s=tps,
                   mfu=tps * self.spec.flops_per_token / peak, mem_bytes=self._mem_bytes(), step_time_s=dt,
                   tokens=self.progress.tokens_seen, **spread, **routing,
                   **({} if val is None else {"val_loss": val} if self.spec.dpo else  # a preference loss: no perplexity
                      {"val_loss": val, "val_ppl": math.exp(min(val, 700.0))}),
                   **extra)
        warning = self.stragglers.warning()
        if warning:
            log.warning("%s", warning)
            logger.event(f"warning: {warning}")

    def _mem_bytes(self) -> int:
        if self._memory is not None:  # it resets the peak counters for each phase, and keeps the peak
            return self._memory.peak_since_start()
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return peak_rss_bytes()


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss parallel is a (replicated) DTensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def truncate_metrics(run_dir: str, step: int) -> None:
    """Forget logged steps after the one we resume from: they are about to be trained again, and
    metrics.jsonl keeps one record per step of the run as it finally happened."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    write_atomic(path, "".join(line + "\n" for line in keep))
