"""The compile job (``wire.COMPILE_JOB``), run inside a worker: a ``CompileRequest``'s graph
rebuilt on inputs made from its metadata, compiled by inductor, its artifact packed with the
files it needs (wire.py says what travels). Also the workers' warm-up steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from hotswap.engine.shipping.wire import CompileRequest, CompileResult, InputMeta
from hotswap.workers import emit_stage, stage

__all__ = ["compile_graph", "compile_op_families", "landed", "past_damaged_libraries",
           "patches_cpp_command_line",
           "real_inputs", "warm_compile", "warm_device", "warm_ops"]

log = logging.getLogger("hotswap")
T = TypeVar("T")


# Ship precompiled headers written after this time with the next result (set by warm_device,
# before any job, and by the job that prepares one: _start_cpp_header).
_files_since_s: float | None = None
# Held while the precompiled header is prepared beside a job (_cpp_header), started once.
_cpp_header_lock = threading.Lock()
_cpp_header_started = False
_start_lock = threading.Lock()
# Whether this worker has compiled a job's graph: warm-up steps a job came before run once no
# job waits (workers/child.py), and those whose work the job did return at once.
_compiled_a_job = False
_ops_warmed = False  # warm_ops ran (once per worker)


def warm_device(_: Any = None) -> None:
    """A worker's first warm-up step, run after it reports ready unless a job is already
    waiting (a job pays what it needs itself): the per-process costs of a first compile on
    this machine's device. CUDA: the context and inductor's compile pool. CPU: inductor's
    vector-ISA probe, which builds and loads a C++ program per ISA (8.4 s for every ISA on our
    2-core box, 3.0 s as far as inductor's pick reads, as here: load_guard.ProbedAsRead).

    On our H200 machine the probe took 53 s with an empty inductor cache, so a GPU machine's
    worker leaves it to its first CPU graph, as an in-process compile would."""
    global _files_since_s
    if _compiled_a_job:
        return
    _files_since_s = time.time() - 1.0  # the first job also ships the headers warming up built
    import torch
    import torch._inductor.codecache
    import torch._inductor.graph
    import torch._inductor.lowering

    from hotswap.engine.loading.load_guard import probe_vec_isa, record_precompiled_headers

    record_precompiled_headers()
    if not torch.cuda.is_available():
        probe_vec_isa()
    else:
        torch.cuda.init()  # type: ignore[no-untyped-call]
        torch.empty(1, device="cuda")
        import torch._inductor.codegen.triton
        import torch._inductor.runtime.triton_heuristics
        from torch._inductor.async_compile import AsyncCompile

        AsyncCompile.warm_pool()


def _start_cpp_header() -> None:
    """A CPU graph's job, once per worker: inductor's precompiled header for CPU kernels
    (``cpp_prefix.h`` under the kernels' command line) prepared in a thread of its own, beside
    the job's lowering, which inductor would build only at the first C++ kernel.

    It is one compiler run of 148 MiB of output: in a job of corpus GPT-2 on the busy 2-core
    box it ran 16.5 s alone after the lowering, every kernel's compile waiting for it. The job's
    first kernel waits on inductor's lock for what is left. Built already (a warm machine):
    the preprocessor alone, as every first kernel of a process runs it. Started by a job, not
    at the worker's start: a worker stopped halfway (every short-lived process's, at its exit)
    leaves a header gcc did not finish, and would start it over at every start."""
    global _cpp_header_started, _files_since_s
    with _start_lock:
        if _cpp_header_started:
            return
        _cpp_header_started = True
    from torch._inductor import config

    if not getattr(config, "cpp_cache_precompile_headers", False) or os.name == "nt":
        return  # a torch that builds no header for its CPU kernels
    if _files_since_s is None:  # a job ships it, this one or (built after its end) the next
        _files_since_s = time.time() - 1.0
    threading.Thread(target=_cpp_header, name="hotswap-cpp-header", daemon=True).start()


def _cpp_header() -> None:
    from torch._inductor import codecache

    from hotswap.workers.child import beside_jobs

    beside_jobs()
    try:
        with _cpp_header_lock:
            # A kernel's load builds the header first; the kernel itself is built where it is
            # called, and this one never is.
            codecache.CppPythonBindingsCodeCache.load_pybinding_async(
                ["float*"], _VECTORIZED_KERNEL)
    except Exception as e:  # the job's own first kernel builds it then, as inductor does
        log.warning("hotswap: could not prepare inductor's precompiled header: %s: %s",
                    type(e).__name__, str(e)[:300])


# Inductor settings a tier may patch that change the C++ kernels' source, never a compiler's
# command line, so not the header either: a profiled run's tiers patch this one (recording.py).
_CODEGEN_ONLY = frozenset({"cpp.enable_kernel_profile"})


def patches_cpp_command_line(config_patches: Mapping[str, Any]) -> bool:
    """Whether a tier's inductor patches may change the C++ compiler's command line (its
    flags, ISA or compiler), and with it the precompiled header's build."""
    return any(key.startswith(("cpp", "aot_inductor")) and key not in _CODEGEN_ONLY
               for key in config_patches)


# A kernel as inductor's vectorized CPU kernels are (the header's command line is theirs).
_VECTORIZED_KERNEL = """
extern "C" void kernel(float* out_ptr0)
{
    at::vec::Vectorized<float>(0.0f).store(out_ptr0);
}
"""


def warm_compile(_: Any = None) -> None:
    """A worker's warm-up step (skipped when a job is waiting): one tiny compile."""
    if _compiled_a_job:
        return
    import torch

    _compile_once("cuda" if torch.cuda.is_available() else "cpu")


def warm_ops(_: Any = None) -> None:
    """A GPU worker's warm-up beyond the tiny compile (a step of its own, once the worker has
    idled ``idle_s``, below): two small graphs in bfloat16 with the op families models are
    made of (embedding, layer norm, linear, causal attention, GELU, softmax, masking;
    convolution, batch norm, pooling). A first compile with an op family pays that family's
    lazy set-up (lowerings, pattern passes, kernel templates) whatever the model; on the H100
    a worker that had compiled only pointwise graphs then compiled GPT-2 (6 layers) in 4.31 s
    the first time and 2.57 s the second; after these two graphs (3.1-3.7 s), 2.69 s the
    first time. ViT: 6.77 s, then 5.99 s after them.

    On the CPU the same lazy set-up cost ViT 0.35 s, against several seconds of the C++
    compiler per graph on cores the caller uses: nothing is done there."""
    global _ops_warmed
    import torch

    if torch.cuda.is_available() and not _ops_warmed:
        _ops_warmed = True
        past_damaged_libraries(lambda: compile_op_families("cuda", torch.bfloat16))


# It runs once its worker has idled this long (workers/child.py): a job that came while it ran
# would wait for it (3.1-3.7 s on the H100), and a process's first job comes seconds after
# its workers are ready, or before. Longer than the 5 s a pool keeps its workers after a
# reset (executors/local.py: RESET_IDLE_EXIT_S), so that they are not reaped mid-step.
warm_ops.idle_s = 10.0  # type: ignore[attr-defined]


def compile_op_families(device: str, dtype: Any) -> list[tuple[Any, Any, Any]]:
    """``warm_ops``'s compiles on ``device`` (nothing is run: the warm-up is the compile);
    returns (compiled, module, example input) per graph."""
    import torch

    from hotswap import compat

    block, conv = _op_families()
    compiled = []
    with torch.no_grad():
        for module, example in ((block, torch.arange(32, device=device).view(2, 16) % 31),
                                (conv, torch.randn(2, 3, 16, 16, device=device, dtype=dtype))):
            module.to(device, dtype).eval()
            fn = compat.standalone_compile(torch.fx.symbolic_trace(module), [example], {})
            compiled.append((fn, module, example))
    return compiled


def _op_families() -> tuple[Any, Any]:
    """The modules ``warm_ops`` compiles."""
    import torch
    from torch import nn
    from torch.nn import functional

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.norm = nn.Embedding(32, 64), nn.LayerNorm(64)
            self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)

        def forward(self, ids: torch.Tensor) -> Any:
            x = self.norm(self.embed(ids))
            q, k, v = self.qkv(x).view(2, 16, 3, 4, 16).permute(2, 0, 3, 1, 4)
            y = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = functional.gelu(self.out(y.transpose(1, 2).reshape(2, 16, 64)))
            mask = torch.ones(16, 16, device=ids.device, dtype=torch.bool).tril()
            scores = torch.where(mask, x @ x.transpose(-1, -2), float("-inf")).softmax(-1)
            return torch.tanh(scores @ y).pow(3) + x

    class Conv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.norm = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.fc = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> Any:
            y = functional.max_pool2d(self.norm(self.conv(x)).relu(), 2)
            return self.fc(functional.adaptive_avg_pool2d(y, 1).flatten(1))

    return Block(), Conv()


def past_damaged_libraries(compile: Callable[[], T]) -> T:
    """``compile()``; where it failed on a kernel library the loader refused as cut short (a
    compile killed while linking it: inductor links in place), that library removed from
    inductor's cache and ``compile()`` once more. Left there, inductor's caches serve it to
    every later compile on the machine: a worker killed while linking its warm-up compile's
    library left every later worker's warm-up failing, and no worker ever warm."""
    from hotswap.engine.loading import kernel_files

    try:
        return compile()
    except Exception as e:
        damaged = kernel_files.damaged_library(e)
        if damaged is None:
            raise
        log.warning("hotswap: removed a damaged kernel library from inductor's cache, "
                    "compiling again: %s", damaged)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(damaged)
    return compile()


def _compile_once(device: str) -> None:
    """One tiny compile end to end (graph -> AOTAutograd -> inductor -> kernels). The first
    compile in a process pays lazy set-up that imports do not (decomposition tables, fake
    tensor and codegen machinery): 0.5 s of AOTAutograd alone in a first real job (CPU and
    H200), now paid before the worker reports ready."""
    import torch

    from hotswap import compat

    def tiny(x: torch.Tensor) -> torch.Tensor:
        return (x * 2 + 1).relu()

    with torch.no_grad():
        past_damaged_libraries(lambda: compat.standalone_compile(
            torch.fx.symbolic_trace(tiny), [torch.randn(64, device=device)], {}))


def _make_input(meta: InputMeta) -> Any:
    import torch

    dtype = getattr(torch, meta.dtype)
    t = torch.empty_strided(meta.shape, meta.stride, dtype=dtype, device=meta.device)
    # Values only matter to autotuning benchmarks; integers stay 0 so they are valid indices.
    if dtype.is_floating_point or dtype.is_complex:
        t.normal_()
    else:
        t.zero_()
    return t.requires_grad_(meta.requires_grad)


def real_inputs(metas: tuple[InputMeta, ...]) -> list[Any]:
    """Tensors (and ints) at the example sizes: what autotuning and benchmarks run on."""
    return [_make_input(m) if m.is_tensor else m.hint if m.symbol is not None else m.value
            for m in metas]


def _make_symbolic_inputs(metas: tuple[InputMeta, ...]) -> tuple[list[Any], Any]:
    """Fake inputs whose dynamic dims are the coordinator's symbols, in one fresh ShapeEnv."""
    import torch
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    symbols: dict[str, Any] = {}
    for meta in metas:
        for name, hint in meta.symbols:
            if name not in symbols:
                source = ConstantSource(name)
                expr = shape_env.create_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC)
                symbols[name] = shape_env.create_symintnode(expr, hint=hint, source=source)
    inputs: list[Any] = []
    with mode:
        for meta in metas:
            if meta.symbol is not None:
                inputs.append(symbols[meta.symbol])
                continue
            if not meta.is_tensor:
                inputs.append(meta.value)
                continue
            names = meta.sizes or (None,) * len(meta.shape)
            sizes = [symbols[n] if n else h for n, h in zip(names, meta.shape, strict=True)]
            dtype = getattr(torch, meta.dtype)
            if meta.strides:
                strides = [_evaluate(e, symbols) if e else h
                           for e, h in zip(meta.strides, meta.stride, strict=True)]
                t = torch.empty_strided(sizes, strides, dtype=dtype, device=meta.device)
            else:
                t = torch.empty(sizes, dtype=dtype, device=meta.device)
            inputs.append(t.requires_grad_(meta.requires_grad))
    return inputs, mode


def _evaluate(expr: str, symbols: dict[str, Any]) -> Any:
    """A stride expression (sympy's text: sums, products, powers of symbols and integers) over
    the worker's SymInts."""
    import sympy

    def walk(node: Any) -> Any:
        if node.is_Integer:
            return int(node)
        if node.is_Symbol:
            return symbols[str(node)]
        parts = [walk(arg) for arg in node.args]
        if node.is_Add:
            return sum(parts[1:], parts[0])
        if node.is_Mul:
            product = parts[0]
            for part in parts[1:]:
                product = product * part
            return product
        if node.is_Pow and node.exp.is_Integer and int(node.exp) > 0:
            return parts[0] ** int(node.exp)
        raise ValueError(f"stride expression {expr!r} has a term hotswap cannot rebuild: {node}")

    return walk(sympy.sympify(expr))


def landed(graph_bytes: bytes, metas: tuple[InputMeta, ...]) -> tuple[Any, list[Any], bool]:
    """The shipped graph rebuilt, with inputs to compile it for (fake ones with the
    coordinator's symbols where it is dynamic), and whether it is."""
    from hotswap import compat
    from hotswap.engine.shipping.transport import land_graph

    dynamic = any(m.symbols for m in metas)
    if dynamic:
        inputs, mode = _make_symbolic_inputs(metas)
    else:
        inputs, mode = real_inputs(metas), None
    gm = land_graph(graph_bytes, inputs, mode)
    # The static inputs dynamo marked (parameters, buffers), marked again: inductor assumes
    # their addresses fixed and aligned, as under torch.compile. Unmarked, every GPU input
    # is checked for alignment at every call, a Python loop in the serving process.
    compat.mark_static_inputs(gm, [m.static for m in metas])
    return gm, inputs, dynamic


def _cpu_graph(metas: tuple[InputMeta, ...]) -> bool:
    devices = {m.device.split(":")[0] for m in metas if m.is_tensor}
    return "cpu" in devices and len(devices) == 1


def compile_graph(wire: dict[str, Any]) -> dict[str, Any]:
    import torch

    from hotswap import compat
    from hotswap.engine.loading import kernel_files, precompiled, source_key
    from hotswap.engine.loading.artifacts import pack_entry
    from hotswap.engine.loading.kernel_files import remove_cut_short_headers
    from hotswap.engine.loading.load_guard import (
        cpp_sources,
        probe_vec_isa,
        probes,
        record_precompiled_headers,
        reprobe_if_cut_short,
    )

    global _compiled_a_job
    _compiled_a_job = True
    request = CompileRequest.from_wire(wire)
    cpp_patched = patches_cpp_command_line(request.config_patches)
    if cpp_patched:
        # A tier that patches inductor's C++ settings patches them for the whole worker: let
        # the header being prepared beside an earlier job (the default settings') be built
        # first, not with this tier's flags under the default's name; and start none here.
        with _cpp_header_lock:
            pass
    record_precompiled_headers()  # where warm_device did not run
    if _cpu_graph(request.inputs):  # a job that came before warm_device did: probe first
        # A header a killed build left (a worker stopped halfway), which inductor would take
        # as built for good
        remove_cut_short_headers()
        with stage("vec_isa_probe", tier=request.tier):
            probe_vec_isa()  # answered from inductor's caches once probed
        if not cpp_patched:
            _start_cpp_header()  # its command line names the ISA the probe picks
    global _files_since_s
    started = time.time() - 1.0  # mtime granularity

    def attempt() -> tuple[Any, ...]:
        with stage("graph_unpickle", tier=request.tier):  # a compile consumes its graph
            gm, inputs, dynamic = landed(request.graph_bytes, request.inputs)
        with (stage("inductor_compile", tier=request.tier),
              compat.inductor_events() as events,
              torch.set_grad_enabled(request.grad_enabled), cpp_sources() as sources,
              compat.intra_op_threads(request.num_threads),
              compat.under_compile_id(request.compile_id),
              precompiled.recording() as codes):
            return (*_compile(gm, inputs, request, dynamic), events, sources, codes)

    data, plan, part, events, sources, codes = past_damaged_libraries(attempt)
    for name, start_s, end_s in events:  # inductor's own stages, nested inside ours
        emit_stage(name, start_s, end_s, tier=request.tier, inductor=True)
    with stage("collect_files", tier=request.tier):
        header_pending = _cpp_header_lock.locked()  # then a later job ships it
        files = kernel_files.compile_outputs(sources, started, _files_since_s)
        reprobe_if_cut_short()  # a tier that read on probed during the compile
        entry = pack_entry(data, files, {**probes(), **source_key.record(),
                                         **precompiled.record(codes)}, plan, part=part)
    if not header_pending:
        _files_since_s = None
    return CompileResult(request.graph_id, request.tier, entry).to_wire()


def _compile(gm: Any, inputs: list[Any], request: CompileRequest,
             dynamic: bool) -> tuple[bytes, dict[str, Any] | None, dict[str, Any] | None]:
    """The artifact, its region plan where the tier compiles region by region and the graph
    repeats one (jobs/regions.py: static inference graphs only), and its part's plan where the
    job is a part (``_compile_part``); else the whole graph.
    ``gm`` is donated to one compile or the other: the pieces are copies of its nodes."""
    from hotswap import compat

    trains = request.grad_enabled and any(m.requires_grad for m in request.inputs)
    if request.part >= 0:
        return _compile_part(gm, inputs, request, dynamic, trains)
    if request.regions and not dynamic and not trains:  # as shipping/request.py labels them
        from hotswap.jobs.regions import compile_regions

        try:
            made = compile_regions(
                gm, inputs, [m.static for m in request.inputs], request.regions,
                lambda piece, args: compat.compile_saveable(piece, args, request.config_patches))
        except Exception as e:
            # A piece inductor keeps nothing of (wav2vec2's feature encoder on the H100), or
            # one it cannot compile alone, where the whole graph may compile: the tier is the
            # whole graph then, as a rung can be.
            log.warning("hotswap: compiled whole, not region by region: %s: %s",
                        type(e).__name__, str(e)[:300])
            made = None
        if made is not None:
            artifacts, plan = made
            return b"".join(artifacts), plan, None
    return compat.compile_saveable(gm, inputs, request.config_patches, dynamic=dynamic), None, None


def _compile_part(gm: Any, inputs: list[Any], request: CompileRequest,
                  dynamic: bool, trains: bool
                  ) -> tuple[bytes, dict[str, Any] | None, dict[str, Any] | None]:
    """Part ``request.part`` of the graph cut into ``request.parts`` (jobs/regions.py), with
    the plan, under ``"part"``, that ``artifacts.merge_parts`` puts the parts together by.
    Where the graph is not cut so (dynamic sizes or training, as for regions; or no place to
    cut: every part's job finds the same), part 0's job compiles the whole graph and the
    others return nothing (b""); where a part does not compile alone, its job compiles the
    whole graph. The merge takes a whole graph as the tier's."""
    from hotswap import compat

    made = None
    if dynamic or trains:
        if request.part > 0:
            return b"", None, None
    else:
        from hotswap.jobs.regions import compile_part

        try:
            made = compile_part(
                gm, inputs, [m.static for m in request.inputs], request.part, request.parts,
                lambda piece, args: compat.compile_saveable(piece, args, request.config_patches))
        except Exception as e:
            log.warning("hotswap: part %d of %d does not compile alone, compiled the whole "
                        "graph: %s: %s", request.part, request.parts, type(e).__name__,
                        str(e)[:300])
        else:
            if made is None and request.part > 0:
                return b"", None, None
    if made is not None:
        return made[0], None, made[1]
    return compat.compile_saveable(gm, inputs, request.config_patches, dynamic=dynamic), None, None
