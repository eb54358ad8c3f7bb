"""Replay bundles: hold what the failing step needs, and save it when told.

What happens around step N (training thread unless said otherwise):

- first forward of N (`on_micro_batch_start`, micro-batch 0): a new capture
  holds references to the inputs, the RNG states, the version counters of
  buffers and (when small) a device-side copy of the buffers; every further
  micro-batch adds its inputs and RNG states;
- backward: references to the gradients reaching the model's outputs (the
  scaled values that travelled); at the end of the step's first backward
  pass, the sum of the parameters' version counters (`on_backward_end`);
- optimizer pre-step: a device-side copy of the parameters, taken into
  preallocated buffers, when there is no GradScaler (or N was asked for up
  front), so the bundle holds the weights the forward used (on the CPU,
  not when every statistic of the step so far is finite: nothing can ask
  for its bundle but a non-finite loss of finite gradients); held steps still
  undecided whose weights are still those of their forward (skipped steps)
  get a copy before the update overwrites them;
- `rec.step()`: the capture joins the held ones (at most `hold_steps`);
- writer thread, one step late: `on_step_summary(N)` evaluates the triggers
  (`triggers`) on N's copied statistics and records a decision (the
  writer-thread part, `BundleDecisions`, lives in `decisions`);
- next training-thread hook: a "no" releases the capture; a "yes" queues
  device-side copies of whatever is still live, and of the optimizer state
  as it is then, and hands the bundle to the writer thread, which copies it
  to the host and writes it (`directory`).

Sharded parameters (FSDP1, FSDP2) are held as this rank's local shards
(`layout.local_value`, read at each copy), and the bundle records where
each sits in the whole (`ModelInventory.placements`); the analyzer puts
the ranks' bundles of a step together. No collective is issued.

Nothing on the training path reads a device value: decisions use host-side
statistics, version counters and what the scaler already synchronised.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from pathlib import Path

import torch

from ..layout import PLAIN_TENSORS
from ..manifest import scaler_enabled
from ..format.plain import plain
from ..stats import iter_tensors
from ..format.tensor_codec import clone_tree, encode_inputs
from .decisions import BundleDecisions
from .directory import precision_flags
from .held import VERSION, ModelInventory, MicroBatch, PendingBundle, SnapshotPool, StepCapture, clone_now, rng_state
from .policy import BundlePolicy
from .triggers import BundleTriggers
from .window import WindowCapture

_PLAIN = frozenset(PLAIN_TENSORS)  # a forward's arguments all of these: held as they are


class BundleCapture:
    """Holds what recent steps need for a replay and saves a bundle when
    the writer thread's `BundleDecisions` says so.

    `run_dir`: where `bundles/` goes; `run_info`: the run's identity for
    bundle.json (run_id, rank, world_size, package_version, device_type,
    device_name, scaler); `post(job) -> bool`: hand a job to the writer
    thread without waiting; `on_change(saved, missed)`: the lists of saved
    and missed bundles changed (writer thread).

    `policy` (`BundlePolicy`): the options, validated there; `enabled`:
    the master switch (False: nothing is held or saved; the manifest still
    records the policy); `window`: False keeps no counterfactual window
    whatever `policy.window_steps` says (a sharded job's).
    """

    def __init__(self, model: torch.nn.Module, optimizer=None, scaler=None, *, policy: BundlePolicy,
                 enabled: bool = True, run_dir: Path, run_info: dict, post, on_change, window: bool = True):
        has_scaler = scaler_enabled(scaler)
        self.model = model
        self.optimizer = optimizer
        # `enabled` is the training thread's switch (a re-execution turns it
        # off for its forward); the writer thread decides on every step's
        # summary whenever bundles are on (`decides`): read there, the
        # switch dropped the decisions of steps written during a
        # re-execution, whose held captures then stayed until close.
        self.enabled = self.decides = bool(enabled)
        self.policy = policy
        triggers = BundleTriggers(policy.triggers, has_scaler=has_scaler, max_bundles=policy.max_bundles,
                                  min_loss_scale=policy.min_loss_scale, settle_steps=policy.settle_steps)
        self.steps = frozenset(policy.steps)
        self.hold_steps = policy.hold_steps
        self.clone_inputs = policy.clone_inputs
        snapshot_params = policy.snapshot_params
        if snapshot_params == "auto":
            snapshot_params = (not has_scaler and optimizer is not None
                               and hasattr(optimizer, "register_step_pre_hook"))
        self.config = policy.config(enabled=self.enabled, snapshot_params=snapshot_params)
        self.inventory = inv = ModelInventory(model)
        self._param_pool = SnapshotPool(inv.params, 2) if snapshot_params and inv.params else None
        self._always_snapshot = policy.snapshot_params is True
        # training thread
        self._host_memory = all(t.device.type == "cpu" for t in inv.params)
        # The writer decides one step late, later when it lags (on a CPU job
        # it shares the cores with the training): hold undecided steps a
        # little longer there, where they live in host memory.
        # A device job without a scaler: a step's row waits one step for its
        # facts (`reexecute.StepSentinel.hand_over`), so the writer's
        # decision comes a step later: one step more.
        self._hold_limit = self.hold_steps + (8 if self._host_memory else 0 if has_scaler else 1)
        self._buffer_pool = None
        if inv.buffers and inv.buffer_bytes() <= policy.snapshot_buffers_bytes:
            # One set per capture that can be held, plus the current one and
            # the one being finalized: a lagging writer must not leave a held
            # step without its forward's buffers (its bundle would not be exact).
            self._buffer_pool = SnapshotPool(inv.buffers, self._hold_limit + 2)
        # The counterfactual window (window.py): None when off, so that the
        # hooks below cost one attribute test.
        self.window = None
        if self.enabled and window and policy.window_steps > 0:
            self.window = WindowCapture(model, optimizer, scaler, inventory=inv, steps=policy.window_steps,
                                        max_bytes=policy.max_window_bytes, run_dir=run_dir,
                                        run_info=dict(run_info, has_scaler=has_scaler), post=self._post,
                                        loss_fn=policy.loss_fn)
            triggers.watch_window = True  # the writer notes the events that open a window
        # A held step's weights can be judged unchanged since its forward
        # only where no optimizer step followed it: a scaler's skip, or a
        # copy taken whatever the step (`_take_versions`).
        self._unstepped_kept = has_scaler or self._always_snapshot or self.window is not None
        self._triggers = triggers
        self._window_events: dict = {}
        self._current: StepCapture | None = None
        self._held: OrderedDict[int, StepCapture] = OrderedDict()
        self._awaiting_copy: list[StepCapture] = []  # held with no optimizer step since their forward
        self._evicted: set[int] = set()
        self._opt_steps = 0
        self._request_pending = False
        self._unposted: list = []
        self._post_to_writer = post
        self._closing = False
        self._closed = False
        tracker = getattr(scaler, "_growth_tracker", None) if has_scaler else None
        # A fresh scaler creates its tracker lazily (at 0); a CUDA one is
        # not read here (that would synchronise).
        tracker = 0 if tracker is None else (int(tracker.item()) if tracker.device.type == "cpu" else None)
        # writer thread (and the lock-guarded hand-over of its decisions)
        self.decisions = BundleDecisions(
            triggers, inventory=inv, run_dir=run_dir, run_info=dict(run_info, has_scaler=has_scaler, recorder=self.config),
            max_bundle_bytes=policy.max_bundle_bytes, growth_tracker=tracker, on_change=on_change)

    @property
    def saved(self) -> list[dict]:
        return self.decisions.saved

    @property
    def missed(self) -> list[dict]:
        return self.decisions.missed

    # ------------------------------------------------------ training thread
    def on_micro_batch_start(self, step: int, micro_batch: int, args, kwargs, autocast: dict | None) -> None:
        if not self.enabled:
            return
        if micro_batch == 0 or self._current is None:
            # The writer's decisions were taken at the last step's end (and
            # are at the optimizer's step): none here, a call less a step.
            if self._current is not None:
                self._release(self._current)  # a step that never reached rec.step()
            self._current = self._new_capture(step, autocast)
            if self.window is not None:
                self.window.on_step_start(step, self._current.autocast, self._current.precision)
        if self.clone_inputs:
            args, kwargs = clone_tree(args), clone_tree(kwargs)
        rng = rng_state()
        if not kwargs and _PLAIN.issuperset(map(type, args)):  # model(x, y): no tree to walk (mapped in C)
            versions = list(zip(args, map(VERSION, args)))
        else:
            versions = [(t, t._version) for t in iter_tensors((args, kwargs))]
        self._current.micro_batches.append(MicroBatch(args, kwargs, versions, rng))
        if self.window is not None:
            self.window.on_micro_batch(args, kwargs, rng, versions)

    def on_micro_batch_aborted(self) -> None:
        """The micro-batch just started raised in its forward: not replayed."""
        if self.enabled and self._current is not None and self._current.micro_batches:
            self._current.micro_batches.pop()
            if self.window is not None:
                self.window.on_micro_batch_aborted()

    def _new_capture(self, step: int, autocast: dict | None) -> StepCapture:
        cap = StepCapture(step)
        inv = self.inventory
        # The parameters' version sum is not read here but when the step's
        # first backward pass ends (`on_backward_end`).
        cap.buffer_versions = inv.buffer_versions() if inv.buffers else []  # no buffers: no call
        cap.opt_steps = self._opt_steps
        if self._buffer_pool is not None:
            cap.buffers = self._buffer_pool.take()
        cap.autocast = autocast if autocast is not None else {}  # shared: never changed in place, only replaced
        if self.window is not None:
            # Global switches that rarely change: read when a bundle is made
            # of the step (`_finalize`), not at every step's forward, unless
            # a window (which starts at any step) needs them now.
            cap.precision = precision_flags()
        if not self.model.training:
            cap.training = False
        if self._request_pending:
            cap.explicit.append("request")
            self._request_pending = False
        return cap

    def on_autocast(self, info: dict) -> None:
        """Autocast as the model's modules saw it, noted after this step's
        capture began (Accelerate enters it inside the root's forward)."""
        if self._current is not None:
            self._current.autocast = dict(info)
            if self.window is not None and self.window.steps and self.window.start == self._current.step:
                self.window.autocast = dict(info)

    def on_model_outputs(self, micro_batch: int, count: int) -> None:
        cap = self._current
        if self.enabled and cap is not None and micro_batch < len(cap.micro_batches):
            cap.micro_batches[micro_batch].outputs = count

    def on_model_output_grad(self, micro_batch: int, index: int, grad) -> None:
        cap = self._current
        if self.enabled and cap is not None and micro_batch < len(cap.micro_batches):
            cap.micro_batches[micro_batch].grads[index] = grad

    def on_backward_end(self, clean: bool = False) -> None:
        """The step's backward pass has ended and its gradients were read
        (`ParamGradCollector`; `clean`: their square sum is a finite host
        value): the parameters' version sum the step's weights are judged
        by (`_unchanged`), taken at the first pass's end where it can be
        needed (`_take_versions`). Not at the forward's start: there it touched
        every parameter's counter out of the caches, ~65 us of the
        launch-bound proxy's 8 ms step, where after the gradients' read it
        costs ~20 (`benchmarks/RESULTS.md`, 2026-12-07 15:00). What that
        leaves unseen: an in-place write inside the forward, after a
        parameter's use, where the backward does not use it (where it does,
        autograd raises); a write before the forward (a planted fault, a
        reload) gives weights the forward used, and one from here on is seen."""
        cap = self._current
        if self.enabled and cap is not None:
            self._take_versions(cap, clean)

    def _take_versions(self, cap, clean: bool) -> None:
        """Read `cap`'s version sum once, where its weights may yet be judged by it:
        its gradients are not clean (a copy before the update is taken, or
        a scaler skips), a bundle of it is asked for (`_asked`), or the job
        keeps unstepped steps' weights (`_unstepped_kept`). Otherwise the
        optimizer steps next (its pre-step hook counts it), after which
        `_unchanged` is False whatever the sum: on a clean step of a job
        without a scaler the 288 counters of the launch-bound proxy, ~45
        us of its cold step, are not read. Such a step is marked
        `versions_skipped`: its weights are never judged exact after (a
        bundle asked for it once its backward ended, or a loop that skips
        `optimizer.step()` itself, gets them as they are then, said not
        exact, never wrongly exact), unless the optimizer's pre-step hook
        finds it not clean after all (a gradient-norm spike, which the
        backward's end does not judge): the sum is read there, before the
        update, with the copy of the weights taken then."""
        if cap.param_version_sum is not None or (cap.versions_skipped and clean):
            return  # read, or marked and still clean
        if not clean or self._unstepped_kept or self._asked(cap):
            cap.param_version_sum = self.inventory.param_version_sum()
        else:
            cap.versions_skipped = True

    def _asked(self, cap) -> bool:
        """A bundle of `cap`'s step is asked for (`save_bundle()`, `bundle_steps`)."""
        return bool(cap.explicit) or cap.step in self.steps

    def on_optimizer_pre_step(self, clean_on_host: bool = False) -> None:
        """`clean_on_host`: the step's statistics so far are host values
        without a NaN or an Inf (and, judged by the sentinel, a gradient
        norm under its spike bound), so no automatic trigger but the loss
        can ask for it: its weights are not copied (a bundle of such a step
        says `copy_after_update`)."""
        if not self.enabled:
            return
        self._service()
        # The weights are about to change: held, undecided steps whose
        # weights are still those of their forward (skipped steps) get a copy.
        if self._awaiting_copy:
            # Only the steps held since the last optimizer step (skipped
            # ones) can still have the weights of their forward: the others
            # are not looked at (a CPU job holds ten, every step).
            versions = self.inventory.param_version_sum()  # read once, for every such step
            for cap in self._awaiting_copy:
                if (self._held.get(cap.step) is cap and cap.params is None and cap.opt_steps == self._opt_steps
                        and cap.param_version_sum == versions):
                    self._secure(cap, clone_now(self.inventory.params), "copy_before_next_update")
            self._awaiting_copy = []
        cap = self._current
        if cap is not None:
            # No backward pass was seen ending (gradients set by hand, a
            # compiled backward): the weights as the update finds them.
            self._take_versions(cap, clean_on_host)
        if cap is not None and cap.params is None:
            wanted = self._asked(cap)
            # `snapshot_params=True` (not "auto"): every step, clean or not (a
            # re-execution of a finite event, a loss spike, needs them too).
            snap = self._param_pool.take() if self._param_pool is not None and (
                wanted or not clean_on_host or self._always_snapshot) else None
            if snap is not None:
                self._secure(cap, snap, "pre_step_snapshot", pooled=True)
            elif wanted:
                self._secure(cap, clone_now(self.inventory.params), "pre_step_snapshot")
            opt = self.optimizer
            if opt is not None:  # as this step used them: a scheduler may change them later
                # Shallow copies ("params" dropped when a bundle is made).
                cap.optimizer_groups = list(map(dict, opt.param_groups))
        if self.window is not None:
            self.window.on_pre_step()
        self._opt_steps += 1

    def held(self, step: int) -> StepCapture | None:
        """What is held of `step`: the step being closed, or a held one."""
        cap = self._current
        if cap is not None and cap.step == step:
            return cap
        return self._held.get(step)

    def judged_clean(self, step: int) -> None:
        """A held step whose device facts, judged a step late
        (`reexecute.StepSentinel`), showed no event: its pooled weight copy
        goes back now, for the next steps' snapshots, as a clean step's does
        at its end (a later "yes" of the writer's copies the weights then,
        and says so)."""
        cap = self._held.get(step)
        if cap is not None and cap.params_pooled and cap.params is not None and not cap.explicit \
                and step not in self.steps:
            self._param_pool.give(cap.params)
            cap.params, cap.params_pooled = None, False

    def unchanged(self, cap) -> bool:
        """The weights are still those of `cap`'s forward (`_unchanged`)."""
        return self._unchanged(cap)

    def _secure(self, cap, params, source, pooled=False) -> None:
        cap.params, cap.params_source, cap.params_pooled = params, source, pooled
        cap.params_exact = self._unchanged(cap)

    def _unchanged(self, cap) -> bool:
        """No optimizer step since the capture's forward and no in-place write
        on any parameter since its backward's end (version counters live on
        the host; see `on_backward_end`)."""
        # None: neither a backward's end nor an optimizer step was seen
        # since the forward, or not read at a clean one (`_take_versions`):
        # undetermined, so not unchanged.
        return (cap.opt_steps == self._opt_steps and cap.param_version_sum is not None
                and cap.param_version_sum == self.inventory.param_version_sum())

    def on_step_end(self, step: int, *, loss, stepped: bool | None, clean: bool = False) -> None:
        """`clean`: the step's host facts showed no event (its decision may
        come late: `RunWriter` hands such steps over together); when too
        many steps are held, clean ones are given up first."""
        if not self.enabled:
            return
        cap, self._current = self._current, None
        if cap is not None:
            explicit = cap.explicit
        else:  # save_bundle() in a step without a recorded forward
            explicit = ["request"] if self._request_pending else []
            self._request_pending = False
        if step in self.steps and "step_list" not in explicit:
            explicit.append("step_list")
        if explicit or loss is None:
            # loss None: the summary then says NaN, which is not a non-finite loss
            self.decisions.note_step(step, explicit, no_loss=loss is None)
        if cap is not None and clean and not explicit and self.window is None:
            # The host facts showed no event and no window's rule (lost
            # updates) looks beyond them: the writer's decision is "no".
            # Let go now, never held (a CPU job held ten such steps, one
            # given up at every step).
            self._release(cap)
        elif cap is not None:
            cap.step, cap.stepped, cap.clean = step, stepped, clean
            if clean:
                if cap.params_pooled and cap.params is not None and not explicit:
                    # Its decision comes late (handed over with others) and
                    # is a "no" but for a rare trigger: the pooled copy goes
                    # back now, for the next steps (a later "yes" copies the
                    # weights then, and says so). A step asked for keeps it.
                    self._param_pool.give(cap.params)
                    cap.params, cap.params_pooled = None, False
                if not explicit:
                    # The gradients that reached the model's outputs are the
                    # largest thing a held step keeps (a language model's
                    # logits' gradient: vocabulary x tokens), and a CPU job
                    # holds up to `_hold_limit` (10) steps. A clean step's
                    # decision is "no" but where a rule of the writer's goes
                    # beyond the host facts (`bundle_meta`'s
                    # `grad_outputs_released` then says so).
                    for mb in cap.micro_batches:
                        if mb.grads:
                            mb.grads = {}
                            cap.grads_released = True
            held = self._held
            if step in held:
                self._release(held.pop(step))
            held[step] = cap
            if cap.params is None and cap.opt_steps == self._opt_steps:
                self._awaiting_copy.append(cap)  # no optimizer step since its forward (on_optimizer_pre_step)
            if len(held) > self._hold_limit:
                # The writer hands clean steps over together: on a CPU job
                # the oldest held step, a clean one, goes at every step.
                oldest = next(iter(held))
                old = held[oldest]
                if old.clean and not old.explicit and oldest not in self.steps:
                    del held[oldest]
                    evicted = self._evicted
                    if len(evicted) > 4096:
                        evicted.clear()
                    evicted.add(oldest)  # too late for the writer's decision
                    self._release(old)
                else:
                    self._evict()
        if self.window is not None:
            self.window.on_step_end(step, stepped)
        self._service()

    def _evict(self) -> None:
        """More steps held than `hold_steps`: the writer fell behind; give up
        the oldest clean ones first, then the oldest others. Steps asked for
        explicitly (save_bundle(), bundle_steps) are never given up: they are
        few by construction."""
        over = len(self._held) - self._hold_limit
        for clean in (True, False):  # the usual case: the oldest held step, a clean one
            for old_step in list(self._held):
                if over <= 0:
                    break
                old = self._held[old_step]
                if bool(old.clean) is not clean or old.explicit or old_step in self.steps:
                    continue
                del self._held[old_step]
                self._evicted.add(old_step)  # too late for the writer's decision
                self._release(old)
                over -= 1
        if len(self._evicted) > 4096:
            self._evicted.clear()

    def request(self) -> None:
        """`rec.save_bundle()`: save the step the next `rec.step()` closes."""
        if not self.enabled:
            return
        if self._current is None:
            self._request_pending = True
        elif "request" not in self._current.explicit:
            self._current.explicit.append("request")

    def _release(self, cap) -> None:
        if cap.params_pooled and cap.params is not None:
            self._param_pool.give(cap.params)
        if cap.buffers is not None:
            self._buffer_pool.give(cap.buffers)
        cap.params = cap.buffers = None
        cap.micro_batches = []

    def _service(self) -> None:
        """Apply the writer thread's decisions."""
        if not (self.decisions.decided or self._unposted or self.window is not None):
            return  # most calls: nothing decided since the last
        decided = self.decisions.take()
        if self.window is not None:
            # Noted before the decisions they came with (writer thread): taken after them.
            self._window_events.update(self._triggers.take_window_events())
        for step, order in decided.items():
            if self.window is not None:
                self.window.on_decision(step, order, self._window_events.pop(step, ()))
            cap = self._held.pop(step, None)
            if order is None:
                if cap is not None:
                    self._release(cap)
            elif cap is None:
                why = ("the writer decided after the step was released (raise hold_steps)"
                       if step in self._evicted else "the step was not captured (not recorded, or no forward)")
                self._post(functools.partial(self.decisions.miss, step, order["reasons"], why, refund=True))
            else:
                self._post(functools.partial(self.decisions.write, self._finalize(cap, order)))
        if self._unposted:
            jobs, self._unposted = self._unposted, []
            for job in jobs:
                self._post(job)

    def _finalize(self, cap, order) -> PendingBundle:
        """Queue device-side copies of what is still live; the rest are
        references nobody writes to any more."""
        inv = self.inventory
        p = PendingBundle()
        p.step, p.order, p.capture = cap.step, order, cap
        if cap.precision is None:
            cap.precision = precision_flags()
        if cap.params is None:
            exact = self._unchanged(cap)
            cap.params, cap.params_exact = clone_now(inv.params), exact
            cap.params_source = "copy_after_forward" if exact else "copy_after_update"
        elif cap.params_pooled:
            self._param_pool.forget(cap.params)
        p.params = cap.params
        if cap.buffers is not None:
            self._buffer_pool.forget(cap.buffers)
            p.buffers, bsource, bexact = cap.buffers, "forward_snapshot", True
        else:
            bexact = cap.buffer_versions == inv.buffer_versions()
            p.buffers = clone_now(inv.buffers)
            bsource = "copy_after_forward" if bexact else "copy_after_change"
        cap.params = cap.buffers = None
        p.inputs, p.specs = [], []
        for mb in cap.micro_batches:
            spec, tensors = encode_inputs(mb.args, mb.kwargs)
            p.specs.append(spec)
            p.inputs.append(tensors)
        opt = self.optimizer
        optimizer = None
        p.optimizer_state = []
        if opt is not None:
            hyper = [{k: v for k, v in g.items() if k != "params"} for g in cap.optimizer_groups or opt.param_groups]
            groups = [dict(h, params=inv.param_names_of(g["params"])) for h, g in zip(hyper, opt.param_groups)]
            # The state as it is now: the one the step's update used when no
            # optimizer step ran since its forward (a skipped step's).
            entries, tensors, placements = inv.optimizer_state(opt)
            p.optimizer_state = clone_now(tensors)
            before = cap.opt_steps == self._opt_steps
            optimizer = {"class": f"{type(opt).__module__}.{type(opt).__qualname__}",
                         "defaults": plain({k: v for k, v in opt.defaults.items() if k != "params"}, keep_nonfinite=True),
                         "param_groups": plain(groups, keep_nonfinite=True),
                         "state": [{"param": n, "key": key, **({"tensor": f"state.{v}"} if isinstance(v, int) else v),
                                    **({"placement": placements[v]} if isinstance(v, int) and placements[v] else {})}
                                   for n, key, v in entries],
                         "state_source": "copy_before_update" if before else "copy_after_update",
                         "state_exact": before}
        p.info = {"inputs_exact": all(t._version == v for mb in cap.micro_batches for t, v in mb.input_versions),
                  "buffers_source": bsource, "buffers_exact": bexact, "optimizer": optimizer}
        p.event = None
        cuda = [t.device for t in p.params + p.buffers + p.optimizer_state if t.device.type == "cuda"]
        if cuda:
            # The copies are queued on the training stream: the writer thread
            # waits on this event, the training thread never does.
            p.event = torch.cuda.Event()
            p.event.record(torch.cuda.current_stream(cuda[0]))
        return p

    def _post(self, job) -> None:
        """Hand a job to the writer thread (run inline once close() has it)."""
        if self._closing:
            job()
        elif not self._post_to_writer(job):
            # never wait on the training path: retry at the next hook
            self._unposted.append(job)

    # ------------------------------------------------------------ lifecycle
    def apply_decisions(self) -> None:
        """Hand the bundles decided so far to the writer thread (the
        recorder's flush, which then waits for that thread)."""
        if self.enabled:
            self._service()

    def on_step_summary(self, summary: dict) -> None:
        """Writer thread: a recorded step's host-side summary."""
        if self.decides:
            self.decisions.on_step_summary(summary)

    def close(self, *, write_decided: bool) -> None:
        """Called by the recorder after its writer thread has finished:
        write what was decided (inline, when `write_decided`), then drop
        every reference."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if write_decided:
            self._closing = True
            self._service()
        if self.window is not None:
            self.window.close(write=write_decided)
        for cap in list(self._held.values()) + ([self._current] if self._current else []):
            self._release(cap)
        self._held.clear()
        self._current = None
        self._unposted = []
        self._param_pool = self._buffer_pool = None
