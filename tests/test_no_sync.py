"""No host synchronisation in a training step of any method (issue 46): every method's router
hooks, `router_loss`, backward, `set_progress`, `on_step_end` and the trainer's `RoutingMeter`
make none of the calls that make the host wait for an accelerator, beyond what `none` makes.

A CPU run cannot see a device wait, so the check is structural. A dispatch mode records the
operators that wait on a GPU (`.item()`, `bool(t)`, `int(t)`, `nonzero`, boolean-mask indexing,
`bincount`, `torch.tensor(...)` of host data, ...), and patched `Tensor.to` / `.cpu` / `.tolist`
/ `.numpy` record a copy between host and device: a move of a tensor that the step did not make
and the model does not own (a constant kept on the host and copied each forward, or built by a
factory without a device, `torch.zeros(E).to(device)`), or a copy to the host. Each event is
attributed to rpb when rpb's code is on its stack, and events are counted (a multiset): an
allowed wait covers as many events as it makes, no more. The one allowance is the method's own
(`RouterMethod.host_waits_per_moe_layer`: lbl's sequence-wise loss), which bench/gpu_check.py
reads too. With CUDA, the same step also runs under `torch.cuda.set_sync_debug_mode`, which
counts real syncs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import make_batch, make_model
from family_models import ROUTED_TYPES, family_base, family_prior
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import rpb
from rpb.methods import METHODS, RouterMethod, make_method
from rpb.prior import extract_prior
from rpb.trainer import RoutingMeter

RPB_DIR = str(Path(rpb.__file__).parent)

# Every method and the options that change its per-step path.
VARIANTS = [
    ("none", {}),
    ("lbl", {}),
    ("lbl", {"pooling": "pooled"}),
    ("lbl", {"pooling": "per_layer"}),
    ("rpb", {}),
    ("rpb", {"keep_bias_at_eval": True}),
    ("rpb", {"bias_on": "logits"}),
    ("rpb_marginal", {}),
    ("rpb_marginal", {"bias_on": "logits"}),
    ("rpb_adaptive", {}),
    ("rpb_interp", {}),
    ("rpb_anneal", {}),
    ("rpb_coact", {}),
    ("anchor_weight", {}),
    ("anchor_logit", {}),
    ("anchor_kl", {}),
    ("hard", {}),
    ("hard", {"gate_from": "base"}),
]
# How the recorder sees the one wait a method makes on purpose (its `host_waits_per_moe_layer`:
# lbl's sequence-wise loss, `sequence_lbl`, selects the sequences with tokens by a boolean mask):
# per MoE layer, the forward `index` in rpb's code and the backward `index_put` in autograd's.
KNOWN_WAIT = "aten.index (boolean mask) at methods.py:sequence_lbl"
KNOWN_WAIT_BACKWARD = "aten.index_put (boolean mask)"
# JetMoE's router returns its expert counts as a host list (its own `.tolist()`, which the
# library's forward makes too): rpb copies that list to the device (from pinned memory, without
# blocking, on CUDA) and, when it steers, builds one the same way.
JETMOE = {
    "aten.lift_fresh at route.py:parse_output",
    "Tensor.to: a host tensor moved to the device at route.py:parse_output",
    "Tensor.tolist: a copy to the host at route.py:build_output",
}
# The unit tier's models (the grouped DeepSeek-V3 is conftest's); every family in the slow test.
ARCHS = ["deepseek_v3", "deepseek_v3_grouped", "qwen3_moe"]

# Operators whose result the host must wait for when their input is on an accelerator.
_WAITS = {
    "aten._local_scalar_dense",  # .item(), bool(t), int(t), float(t)
    "aten.is_nonzero",
    "aten.nonzero",
    "aten.masked_select",
    "aten.bincount",
    "aten.unique_dim",
    "aten._unique",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.equal",
}
_INDEX = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"}


def _from_rpb() -> str | None:
    """The innermost frame of rpb's code on the stack (file:function), if any."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(RPB_DIR):
            return f"{Path(frame.filename).name}:{frame.name}"
    return None


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _Factories(TorchFunctionMode):
    """Tags what a factory (`torch.zeros`, `torch.arange`, ...: no tensor argument) returns by
    whether its call named a device: the dispatcher fills `device=cpu` into every factory, so
    below the Python call `torch.zeros(E)` and `torch.zeros(E, device=x.device)` look alike."""

    def __init__(self, recorder: SyncRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _tensors((args, kwargs)) and getattr(func, "__module__", None) == "torch":
            explicit = kwargs.get("device") is not None
            for t in _tensors(out):
                self.recorder._on_device[_storage(t)] = explicit
        return out


class SyncRecorder(TorchDispatchMode):
    """Plays a GPU run on the CPU: every tensor is tagged as on the device (the model's
    parameters and buffers, the batch, what an operator makes from them or with an explicit
    `device`, what `.to(device)` returns) or on the host (everything else: what was built before
    the steps, e.g. from the router prior, or by a factory called without a device). While
    `recording`, it records (what, where) for each host wait on a device tensor, each
    `torch.tensor(...)`, each host tensor moved to the device or copied into or used in a device
    tensor's operator, and each copy of a device tensor to the host; `where` is rpb's innermost
    frame, or None for the model's own code."""

    def __init__(self, resident: list[torch.Tensor]) -> None:
        super().__init__()
        self.events: list[tuple[str, str | None]] = []
        self.recording = True
        self._on_device: dict[int, bool] = {_storage(t): True for t in resident}
        self._patches: list[tuple[str, object]] = []
        self._inner = 0  # > 0 while a patched method runs its original

    def on_device(self, tensor: torch.Tensor) -> bool:
        return self._on_device.get(_storage(tensor), False)

    def _record(self, what: str) -> None:
        if self.recording:
            self.events.append((what, _from_rpb()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        inputs = _tensors((args, kwargs))
        device = [t for t in inputs if self.on_device(t)]
        host = [t for t in inputs if not self.on_device(t) and t.dim() > 0]
        if name == "aten.lift_fresh" or (device and name in _WAITS):  # torch.tensor(host data)
            self._record(name)
        elif device and name == "aten.repeat_interleave" and kwargs.get("output_size") is None:
            if func._overloadname.startswith("Tensor"):
                self._record(name + " (tensor repeats)")
        elif device and name in _INDEX:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in indices or ()
            ):
                self._record(name + " (boolean mask)")
        if device and host:
            self._record(f"{name}: a host tensor used on the device")
        out = func(*args, **kwargs)
        tag = bool(device) or ("device" in kwargs and not inputs)
        seen = {_storage(t) for t in inputs}
        for t in _tensors(out):
            if _storage(t) not in seen:  # a view keeps its base's tag
                self._on_device[_storage(t)] = tag
        return out

    def _call(self, original, *args, **kwargs):
        """`original(...)`, with the patched methods passing through while it runs (the
        factory mode hands a Tensor method's call back to its patched attribute)."""
        self._inner += 1
        try:
            return original(*args, **kwargs)
        finally:
            self._inner -= 1

    def _wrap(self, name: str, wrapper) -> None:
        original = getattr(torch.Tensor, name)
        self._patches.append((name, original))
        setattr(torch.Tensor, name, functools.partialmethod(wrapper, original))

    def __enter__(self):
        recorder = self

        def to(tensor, original, *args, **kwargs):
            if recorder._inner:  # the factory mode handing the same call back: done already
                return original(tensor, *args, **kwargs)
            target = kwargs.get("device")
            for a in args:
                if isinstance(a, torch.device | str | int) and not isinstance(a, bool):
                    target = a
                elif isinstance(a, torch.Tensor):
                    target = "cpu" if not recorder.on_device(a) else a.device
            if target is None:
                return recorder._call(original, tensor, *args, **kwargs)
            if target == "cpu":  # spelt out: to the host wherever the model is
                if recorder.on_device(tensor):
                    recorder._record("Tensor.to: a copy to the host")
                return recorder._call(original, tensor, *args, **kwargs)
            if recorder.on_device(tensor):
                return recorder._call(original, tensor, *args, **kwargs)
            recorder._record("Tensor.to: a host tensor moved to the device")
            kwargs["copy"] = True  # a copy of its own, as on a GPU
            out = recorder._call(original, tensor, *args, **kwargs)
            recorder._on_device[_storage(out)] = True
            return out

        def to_host(tensor, original, *args, **kwargs):
            if recorder.on_device(tensor) and not recorder._inner:
                recorder._record(f"Tensor.{original.__name__}: a copy to the host")
            return recorder._call(original, tensor, *args, **kwargs)

        self._wrap("to", to)
        for name in ("cpu", "tolist", "numpy"):
            self._wrap(name, to_host)
        self._factories = _Factories(self).__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in reversed(self._patches):
            setattr(torch.Tensor, name, original)
        self._patches = []
        result = super().__exit__(*exc)
        self._factories.__exit__(*exc)
        return result


@functools.cache
def _base_and_prior(arch: str):
    base = make_model(arch)
    batches = [make_batch(seed=s) for s in range(2)]
    prior = extract_prior(
        base, batches, model_id="tiny", revision="r0", corpus_hash="0" * 64, progress=False
    )
    return base, prior


def _step_events(arch: str, name: str, options: dict, cuda: bool = False) -> list:
    """What the third training step records (the first two warm caches up): SyncRecorder's
    events on the CPU, the sync debug mode's warnings on CUDA."""
    return _step_run(arch, name, options, cuda)[0]


def _step_run(arch: str, name: str, options: dict, cuda: bool = False) -> tuple[list, int]:
    """`_step_events`, and the waits per MoE layer the method allows itself
    (`host_waits_per_moe_layer`, read while it is attached)."""
    base, prior = _base_and_prior(arch)
    model = copy.deepcopy(base)
    device = torch.device("cuda" if cuda else "cpu")
    model.to(device).train()
    method = make_method(name, **options).attach(model, prior)
    meter = RoutingMeter()  # the trainer's per-step routing counts
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [{k: v.to(device) for k, v in make_batch(seed=s).items()} for s in range(3)]
    resident = [*model.parameters(), *model.buffers(), *(t for b in batches for t in b.values())]
    recorder = None if cuda else SyncRecorder(resident)
    caught: list = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")  # lbl's double-count warning is not the point here
        if recorder is not None:
            stack.enter_context(recorder)
        for step, batch in enumerate(batches):
            last = step == len(batches) - 1
            if recorder is not None:
                recorder.recording = last
            if cuda and last:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
                caught = stack.enter_context(warnings.catch_warnings(record=True))
                warnings.simplefilter("always")
            method.set_progress(step, len(batches))
            meter.start_step()
            out = model(**batch)
            router = method.router_loss(attention_mask=batch["attention_mask"])
            (out.loss + router).backward()
            meter.add_routing(method.control, batch["attention_mask"])
            meter.add_losses(out.loss, router)
            optimizer.step()
            optimizer.zero_grad()
            method.on_step_end()
            meter.end_step()
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
    allowed = method.host_waits_per_moe_layer()
    method.detach()
    if recorder is not None:
        return recorder.events, allowed
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    return syncs, allowed


def allowance(waits_per_layer: int, n_layers: int) -> tuple[Counter, Counter]:
    """The recorder's events that a method's allowed waits cover, rpb's and the model's own
    (autograd's): one forward mask in `sequence_lbl` and its backward per MoE layer."""
    if not waits_per_layer:
        return Counter(), Counter()
    assert waits_per_layer == 2, f"no recorder pattern for {waits_per_layer} waits per layer"
    return Counter({KNOWN_WAIT: n_layers}), Counter({KNOWN_WAIT_BACKWARD: n_layers})


def excess(events: list, waits_per_layer: int, n_layers: int) -> tuple[Counter, Counter]:
    """rpb's events beyond the allowance (counted: a second mask at an allowed place shows), and
    the model's own events with the allowed backward ones taken out."""
    ours = Counter(f"{what} at {where}" for what, where in events if where is not None)
    own = Counter(what for what, where in events if where is None)
    allowed_ours, allowed_own = allowance(waits_per_layer, n_layers)
    return ours - allowed_ours, own - allowed_own


def step_problem(arch: str, name: str, options: dict, baseline: Counter) -> str | None:
    """What a method's training step waits for beyond its allowance and `none`'s, if anything."""
    events, waits_per_layer = _step_run(arch, name, options)
    n_layers = len(_base_and_prior(arch)[1].base_weights)
    ours, own = excess(events, waits_per_layer, n_layers)
    if ours or own != baseline:
        return f"{name} {options}: {dict(ours) or ''} {dict(own - baseline) or ''}"
    return None


@pytest.mark.parametrize("arch", ARCHS)
def test_no_method_waits_for_the_device_in_a_training_step(arch):
    """Every method's step makes no wait and no host<->device copy from rpb's code, and as many
    of the model's own as `none` does."""
    baseline = Counter(what for what, _ in _step_events(arch, "none", {}))
    problems = [step_problem(arch, name, options, baseline) for name, options in VARIANTS]
    problems = [p for p in problems if p]
    assert not problems, f"{arch}:\n" + "\n".join(problems)


class _HostBuiltTensor(RouterMethod):
    """Bad on purpose: builds a tensor on the host each step and moves it to the device."""

    def _loss(self, control, attention_mask):
        device = next(self.model.parameters()).device
        return torch.zeros(control.handles[0].num_experts).to(device).sum()


class _MaskTwice(METHODS["lbl"]):
    """Bad on purpose: lbl's allowed mask made twice per layer (the second without gradient,
    so only its forward waits, at the allowed place in rpb's code)."""

    def _loss(self, control, attention_mask):
        loss = super()._loss(control, attention_mask)
        with torch.no_grad():
            super()._loss(control, attention_mask)
        return loss


@pytest.mark.parametrize(
    ("bad", "name", "shows"),
    [
        (_HostBuiltTensor, "none", "Tensor.to: a host tensor moved to the device"),
        (_MaskTwice, "lbl", KNOWN_WAIT),
    ],
    ids=["host-zeros-to-device", "lbl-mask-twice"],
)
def test_the_check_flags_a_deliberately_bad_method(monkeypatch, bad, name, shows):
    """The check above fails on a method that waits: `torch.zeros(E).to(device)` in a step,
    and a second boolean mask hidden behind lbl's allowed one."""
    arch = "deepseek_v3"  # lbl's sequence-wise loss (per-layer pooling) and its allowance
    baseline = Counter(what for what, _ in _step_events(arch, "none", {}))
    assert step_problem(arch, name, {}, baseline) is None  # the real method passes
    monkeypatch.setitem(METHODS, name, bad)
    problem = step_problem(arch, name, {}, baseline)
    assert problem is not None and shows in problem, problem


def test_the_recorder_sees_each_kind_of_wait():
    """The recorder itself: each pattern the issue found is recorded, and nothing else."""
    host = torch.ones(3)  # built before the steps: on the host
    with SyncRecorder([]) as rec:
        x = torch.arange(4.0, device="cpu")  # on the device
        cached = host.to(x.device)  # moved once (a cache of it is on the device)
        rec.events.clear()
        x.sum().item()
        x[x > 1].sum()
        torch.tensor([1.0, 2.0])
        host.to(x.device)  # moved again in this step
        torch.zeros(3).to(x.device)  # a factory without a device: built on the host
        torch.zeros(3, device=x.device).to(x.device)  # built on the device: no copy
        host[1:].to(x.device)  # a view of it is still on the host
        cached.to(x.device)  # no copy
        x[1:] + host  # a host tensor in a device operator
        bool(x.any())
        x.cpu()
        x.to("cpu")
        host.tolist()  # on the host already: no wait
        (x * 2).sum(-1)  # no wait
    whats = [w for w, _ in rec.events]
    assert whats == [
        "aten._local_scalar_dense",
        "aten.index (boolean mask)",
        "aten.lift_fresh",
        "Tensor.to: a host tensor moved to the device",
        "Tensor.to: a host tensor moved to the device",
        "Tensor.to: a host tensor moved to the device",
        "aten.add: a host tensor used on the device",
        "aten._local_scalar_dense",
        "Tensor.cpu: a copy to the host",
        "Tensor.to: a copy to the host",
    ], whats


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_no_method_syncs_more_than_none_on_cuda(arch):
    """On a GPU, torch.cuda's sync debug mode counts the real waits: as many as `none`'s, plus
    at most the method's own allowance (`host_waits_per_moe_layer` x MoE layers, the one
    bench/gpu_check.py's `syncs` applies)."""
    baseline = len(_step_events(arch, "none", {}, cuda=True))
    n_layers = len(_base_and_prior(arch)[1].base_weights)
    extra = {}
    for name, options in VARIANTS:
        syncs, waits_per_layer = _step_run(arch, name, options, cuda=True)
        allowed = waits_per_layer * n_layers
        if len(syncs) - baseline > allowed:  # the comparison gpu_check's `syncs` makes
            extra[f"{name} {options}"] = f"{len(syncs) - baseline:+d} (allowed {allowed})"
    assert not extra, f"{arch}: syncs beyond none's ({baseline}): {extra}"


@pytest.mark.slow  # every routed family: about two minutes on one core
@pytest.mark.parametrize("model_type", ROUTED_TYPES)
def test_no_method_waits_for_the_device_on_any_family(model_type, monkeypatch):
    """The same check on every family rpb routes (tests/family_models.py's tiny models)."""
    monkeypatch.setattr(
        sys.modules[__name__],
        "_base_and_prior",
        lambda arch: (family_base(arch), family_prior(arch)),
    )
    problems = []
    n_layers = len(family_prior(model_type).base_weights)
    for name, options in VARIANTS:
        events, waits_per_layer = _step_run(model_type, name, options)
        ours = excess(events, waits_per_layer, n_layers)[0]
        if model_type == "jetmoe":  # the model's own list, once per layer
            ours -= Counter(dict.fromkeys(JETMOE, n_layers))
        if ours:
            problems.append(f"{name} {options}: {dict(ours)}")
    assert not problems, f"{model_type}:\n" + "\n".join(problems)
