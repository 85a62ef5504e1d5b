"""Measured memory: live tensor bytes on CPU (deterministic), the allocator's peak on CUDA.

On CUDA the caching allocator keeps statistics: `torch.cuda.max_memory_allocated` after
`reset_peak_memory_stats` is the peak of one step, exactly the quantity the cost model predicts
(allocator fragmentation and the CUDA context come on top; `memory_reserved` shows them).

CPU PyTorch keeps no allocator statistics and RSS is noisy (glibc keeps freed pages, the
interpreter and libraries move it by tens of MiB), so on CPU we count what the allocator would:
`LiveBytes` is a TorchDispatchMode that sees every op's outputs, registers each new storage
(outputs aliasing an input -- views, in-place ops -- are not new) with a `weakref.finalize` that
subtracts its bytes when the storage dies, and keeps the running peak. Storages created before
the mode was entered (weights, optimizer state) are the caller's `baseline`. Autograd runs CPU
backward on the calling thread with the dispatch mode stack propagated, so backward is counted;
tensors made on other threads (a transport's receive thread) and inside tensor subclasses'
dispatch (DTensor's local ops under tensor parallelism) are not.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch

from geotrain.torch_compat import TorchDispatchMode, fsdp_param_groups, tree_flatten


def _storage(t: torch.Tensor):
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return None  # tensor subclasses (DTensor, FakeTensor): their local storage is not reachable here
    if t.device.type == "meta":
        return None
    return t.untyped_storage()


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under the mode that are still alive, and their peak."""

    def __init__(self, watch: Iterable = ()) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        # Storages allocated and freed by resizing (FSDP2's gathered weights): no op creates them,
        # so their size is read after every op instead.
        self.watch = {st._cdata: st for st in watch}
        self.peak = self._watched()

    def _watched(self) -> int:
        return sum(st.nbytes() for st in self.watch.values())

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 -- torch's signature
        out = func(*args, **(kwargs or {}))
        inputs = set(self.watch)
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and (st := _storage(t)) is not None:
                inputs.add(st._cdata)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or (st := _storage(t)) is None:
                continue
            key = st._cdata
            if key in inputs or key in self.live or st.nbytes() == 0:
                continue
            self.live[key] = st.nbytes()
            self.current += st.nbytes()
            weakref.finalize(st, self._free, key)
        self.peak = max(self.peak, self.current + (self._watched() if self.watch else 0))
        return out

    def reset_peak(self) -> None:
        self.peak = self.current + self._watched()


def fsdp_gathered_storages(modules: Iterable[torch.nn.Module]) -> list:
    """The storages FSDP2 gathers weights into (allocated by `resize_` at each all-gather, freed by
    resizing to 0), found through FSDP2's parameter groups -- private attributes, read defensively:
    if a torch version renames them, the gathered weights go uncounted rather than the run failing."""
    out = []
    for root in modules:
        for sub in root.modules():
            get_state = getattr(sub, "_get_fsdp_state", None)
            groups = fsdp_param_groups(get_state()) if get_state is not None else []
            for fp in (fp for group in groups for fp in getattr(group, "fsdp_params", ()) or ()):
                for t in [*getattr(fp, "all_gather_outputs", ()), *getattr(fp, "_unsharded_inner_tensors", ())]:
                    if isinstance(t, torch.Tensor):
                        out.append(t.untyped_storage())
    return out


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind some tensors (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)  # a DTensor's local shard
        if isinstance(t, torch.Tensor) and (st := _storage(t)) is not None:
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def state_tensors(modules: Iterable[torch.nn.Module], optimizer: torch.optim.Optimizer | None) -> Iterator:
    """Every tensor a training rank holds between steps: weights, buffers, gradients, optimizer state."""
    for m in modules:
        yield from m.parameters()
        yield from m.buffers()
        yield from (p.grad for p in m.parameters() if p.grad is not None)
    if optimizer is not None:
        opt = getattr(optimizer, "optim", optimizer)  # ZeRO-1: the local partition's optimizer
        for st in opt.state.values():
            yield from (v for v in st.values() if isinstance(v, torch.Tensor))


class StepPeak:
    """The peak bytes of one training step: `with peak.step(state): ...`, then `peak.bytes`.

    CUDA: the allocator's peak since the step began (everything allocated, weights included).
    CPU: `baseline` (the distinct storages of `state`, counted when the step begins) plus the
    peak of what the step itself allocates (LiveBytes, with `watch`: FSDP2's gathered weights)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes = 0
        self.baseline = 0

    @contextlib.contextmanager
    def step(self, state: Iterable[torch.Tensor], watch: Iterable = ()):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device)
            return
        self.baseline = tensor_bytes(state)
        mode = LiveBytes(watch)
        with mode:
            yield
        self.bytes = self.baseline + mode.peak


