"""Everything that crosses the process boundary, each with its wire form.

    this process                                   a worker
    ------------                                   --------
    CompileRequest.to_wire()  ---- COMPILE_JOB --->  CompileRequest.from_wire() -> compile_graph
    CompileResult.from_wire() <------------------   CompileResult.to_wire()  (artifact out of band)
    BenchRequest.to_wire()    ---- BENCH_JOB ----->  BenchRequest.from_wire()  -> bench_tiers
    BenchReply.from_wire()    <------------------   BenchReply.to_wire()     (records as dicts)

A wire form is made of plain values only (dicts, lists, str, int, float, bool, None, bytes, and
a ``pickle.PickleBuffer`` where an artifact travels out of band): the receiving side needs no
class of the sender's, and an executor may carry it with any serializer that carries bytes.
Inputs travel as metadata only (``InputMeta``): parameters are graph inputs and may be
gigabytes, so their values never travel; constants the graph holds travel inside the graph.

Torch-free: workers import this before torch.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field, fields
from typing import Any

from hotswap.executors.base import BENCH_JOB, COMPILE_JOB
from hotswap.profiles.records import KernelBreakdown, Paired, TierBench, record_from_dict

__all__ = ["BENCH_JOB", "COMPILE_JOB", "BenchReply", "BenchRequest", "CachedEntry",
           "CompileRequest", "CompileResult", "InputMeta"]

# COMPILE_JOB and BENCH_JOB: the jobs' names, where every job an executor runs is named.


@dataclass(frozen=True)
class InputMeta:
    """One graph input. ``shape`` holds example (hint) sizes; ``sizes`` names the symbol of each
    dynamic dim (``None`` where static). A SymInt input has ``symbol`` set and ``hint``."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    device: str
    requires_grad: bool
    sizes: tuple[str | None, ...] = ()
    symbol: str | None = None
    hint: int = 0
    # A dynamic view's strides by expression (None where static); empty when contiguous.
    strides: tuple[str | None, ...] = ()
    # A plain Python input (None, bool, int, float), sent by value (dtype "constant").
    value: bool | int | float | None = None
    # Dynamo marked it static (a parameter or buffer, or ``mark_static_address``) and it is
    # aligned: inductor assumes its address fixed, as under torch.compile, and skips the
    # per-call alignment check it makes of every other GPU input.
    static: bool = False

    @property
    def is_tensor(self) -> bool:
        return self.symbol is None and self.dtype != "constant"

    @property
    def symbols(self) -> list[tuple[str, int]]:
        if self.symbol is not None:
            return [(self.symbol, self.hint)]
        found = [(name, hint) for name, hint in zip(self.sizes, self.shape, strict=False) if name]
        return found + [(expr, hint) for expr, hint in zip(self.strides, self.stride, strict=False)
                        if expr and expr.isidentifier()]

    def to_wire(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in fields(self)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> InputMeta:
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in data.items()}
        return cls(**values)


# Scheduling hints for the caller's pool (CompileRequest.measured, BenchRequest.again): no
# worker reads them, so one of an older hotswap (a cluster's) takes a request without them.
_HINTS = frozenset({"measured", "again"})


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the hints ``cls`` lacks (any other key it lacks still fails)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names or k not in _HINTS}


def _metas_to_wire(metas: tuple[InputMeta, ...]) -> list[dict[str, Any]]:
    return [m.to_wire() for m in metas]


def _metas_from_wire(data: list[dict[str, Any]]) -> tuple[InputMeta, ...]:
    return tuple(InputMeta.from_wire(m) for m in data)


@dataclass(frozen=True)
class CachedEntry:
    """An entry the worker reads from the artifact cache itself, so that the user's process
    neither pickles nor sends its bytes (tens of MB for a GPU tier, copied holding the GIL)."""

    cache_dir: str
    key: str


@dataclass(frozen=True)
class CompileRequest:
    graph_id: str
    tier: str
    config_patches: dict[str, Any]
    graph_bytes: bytes           # transport.ship_graph(); unpickled only in the worker
    inputs: tuple[InputMeta, ...]
    grad_enabled: bool
    num_threads: int | None = None  # the caller's intra-op threads (CPU graphs; C++ codegen)
    # dynamo's compile id of the frame this graph came from ("0/0"): the worker compiles
    # under it, so its TORCH_TRACE logs sit under the caller's frame in tlparse.
    compile_id: str = ""
    # The gate measures the result as soon as it is loaded: the local pool holds the worker
    # for that measurement (executors.base.hold_for). Nothing in the worker reads it.
    measured: bool = False
    # Per node of the graph, the repeated region it belongs to (-1: none), for a tier that
    # compiles each distinct region once (shipping/regions.py); empty: the whole graph.
    regions: tuple[int, ...] = ()
    # Compile the graph as this many contiguous parts, one per worker at once, served in turn
    # (a tier's ``parts``): the compile service splits such a job (service/parts.py) and sets
    # ``part`` in each; an executor that does not compiles the whole graph.
    parts: int = 1
    part: int = -1

    def to_wire(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "inputs": _metas_to_wire(self.inputs), "regions": list(self.regions)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> CompileRequest:
        return cls(**{**_known(cls, data), "inputs": _metas_from_wire(data["inputs"]),
                      "regions": tuple(int(r) for r in data.get("regions", ()))})


@dataclass(frozen=True)
class CompileResult:
    graph_id: str
    tier: str
    # artifacts.pack_entry(artifact, files): the saved artifact, plus the files the compile
    # added to the worker's inductor cache (compiled C++ kernels above all: inductor bundles
    # triton kernels into the artifact, not C++ ones), restored where it loads. Packed in the
    # worker, so that the user's process never copies it: it travels out of band and arrives
    # as a view into the pool's receive buffer.
    entry: bytes | memoryview

    def to_wire(self) -> dict[str, Any]:
        return {"graph_id": self.graph_id, "tier": self.tier,
                "entry": pickle.PickleBuffer(self.entry)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> CompileResult:
        entry = data["entry"]
        if isinstance(entry, pickle.PickleBuffer):  # not through a pickle (an in-process call)
            entry = entry.raw()
        return cls(data["graph_id"], data["tier"], entry)


@dataclass(frozen=True)
class BenchRequest:
    graph_id: str
    entries: dict[str, bytes | CachedEntry]  # tier -> artifacts.pack_entry(...), or where
    inputs: tuple[InputMeta, ...]
    grad_enabled: bool
    graph_bytes: bytes = b""         # transport.ship_graph(); adds an "eager" row when given
    budget_ms: float = 200.0         # per tier
    purpose: str = "compare"         # "gate" or "compare"
    breakdown: bool = False          # also profile each tier's kernels
    num_threads: int | None = None   # the caller's intra-op threads: time what it will run
    # tier -> the inductor config it compiled with; its artifact loads under it (load_entry)
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # (serving, candidate): time these two against each other in interleaved rounds
    # (profiles/bench.measure_pair; "eager" is the graph as it is) instead of one by one.
    pair: tuple[str, ...] = ()
    rounds: int = 0                  # of the pair's measurement (0: its default)
    # The gate may measure the pair again at once (a CPU graph): the local pool holds the
    # worker briefly for that (executors.base.hold_for). Nothing in the worker reads it.
    again: bool = False

    def to_wire(self) -> dict[str, Any]:
        entries = {t: e if isinstance(e, bytes) else {"cache_dir": e.cache_dir, "key": e.key}
                   for t, e in self.entries.items()}
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "entries": entries, "inputs": _metas_to_wire(self.inputs),
                "pair": list(self.pair)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> BenchRequest:
        entries = {t: e if isinstance(e, bytes | bytearray) else CachedEntry(**e)
                   for t, e in data["entries"].items()}
        return cls(**{**_known(cls, data), "entries": entries,
                      "inputs": _metas_from_wire(data["inputs"]),
                      "pair": tuple(data.get("pair", ()))})


@dataclass(frozen=True)
class BenchReply:
    benches: list[TierBench]
    kernels: list[KernelBreakdown] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # tier -> why it has no row
    pairs: list[Paired] = field(default_factory=list)     # a request's ``pair``, measured

    def to_wire(self) -> dict[str, Any]:
        return {"benches": [b.to_dict() for b in self.benches],
                "kernels": [k.to_dict() for k in self.kernels], "errors": dict(self.errors),
                "pairs": [p.to_dict() for p in self.pairs]}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> BenchReply:
        return cls([record_from_dict(b) for b in data["benches"]],
                   [record_from_dict(k) for k in data["kernels"]], dict(data["errors"]),
                   [record_from_dict(p) for p in data.get("pairs", [])])
