"""Options of ``hotswap.compile`` / ``hotswap.backend``: validation, tiers and environment defaults.

Every invalid option raises ``ValueError`` here, at ``hotswap.compile``, naming the valid choices.

``options=`` takes inductor config patches, as ``torch.compile(options=...)`` does: torch
applies them to the whole compile, after its ``mode``'s presets
(``_TorchCompileInductorWrapper``: ``apply_mode``, then ``apply_options``). hotswap's tiers
are its modes' presets, so the patches go on top of every tier's config: where both set a
key, ``options`` wins, as it would over ``mode="max-autotune"``'s presets in torch. A tier
of its own config goes in ``tiers=[{"name": ..., "config": {...}}]``.
"""

from __future__ import annotations

import difflib
import math
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from hotswap import settings
from hotswap.executors import registry

__all__ = ["CUDAGRAPHS_KEY", "CUDAGRAPH_PRESETS", "MODES", "ON_FAILURE", "PARTS_KEY", "REGIONS",
           "REGIONS_KEY", "REGIONS_SUFFIX", "TIER_PRESETS", "Options", "Plan", "Tier",
           "apply_options", "parse_tiers", "split_torch_options"]

MODES = ("inprocess", "subprocess", "async", "progressive")
ON_FAILURE = ("stay", "raise")
# Preset tiers: inductor config patches, as torch.compile's modes set them. Inductor loads an
# artifact with CUDA graphs off (CompiledArtifact.load); the tiers named in CUDAGRAPH_PRESETS
# serve through CUDA graphs captured in the serving process after the swap (cudagraphs.py).
TIER_PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "reduce-overhead": {},
    "max-autotune": {"max_autotune": True, "coordinate_descent_tuning": True},
    "max-autotune-no-cudagraphs": {"max_autotune": True, "coordinate_descent_tuning": True},
}
CUDAGRAPH_PRESETS = ("reduce-overhead",)
# The load config key that marks a tier to serve through CUDA graphs (never given to inductor).
CUDAGRAPHS_KEY = "hotswap.cudagraphs"
# The load config key that marks a tier compiled region by region (never given to inductor:
# the entry itself says how it loads; the key keeps its cache entries apart).
REGIONS_KEY = "hotswap.regions"
# ``regions=``: where a ladder starts with its first tier compiled region by region (a rung of
# its own, REGIONS_SUFFIX, for graphs that repeat a region), below the same tier compiled
# whole: "auto" (the default), progressive's, and async's where its jobs go to the compile
# service (compose.py says why); "on", async's always; "off", none.
REGIONS = ("auto", "on", "off")
# The load config key that marks a tier compiled as contiguous parts at once (``Tier.parts``;
# never given to inductor: the entry says how it loads; the key keeps its entries apart).
PARTS_KEY = "hotswap.parts"
REGIONS_SUFFIX = "-regions"
# torch's CUDA graphs switch (reduce-overhead's preset): inductor loads artifacts with CUDA
# graphs off, so in options it marks every tier to serve through graphs captured after the
# swap, as the reduce-overhead preset does, and is not given to inductor.
TORCH_CUDAGRAPHS_KEY = "triton.cudagraphs"
_TIERS_FORM = "tiers=[{'name': ..., 'config': {inductor config patches}}]"
DEFAULT_LADDER = ("default", "max-autotune")


# Default time limits, so that no wait is forever (a stopped worker, a hung compile). The
# slowest compiles measured: a corpus model's default tier on the 2-core box, 80 s (Swin-T's
# 203 s from process start included imports and three graphs); max-autotune on the H200, a few
# minutes. 10 minutes, and 30 for autotuning tiers, leave room for machines several times
# slower. HOTSWAP_TIMEOUT_S / timeout_s replace both.
DEFAULT_LIMIT_S = 600.0
AUTOTUNE_FACTOR = 3
_AUTOTUNE_KEYS = ("max_autotune", "max_autotune_gemm", "max_autotune_pointwise",
                  "coordinate_descent_tuning")


@dataclass(frozen=True)
class Tier:
    """A rung of the ladder: a name, the inductor config patches it compiles under, whether
    it serves through CUDA graphs captured after the swap, whether a worker compiles
    each distinct repeated region of a graph once (``regions``, jobs/regions.py), and in how
    many contiguous parts its graphs compile at once, one per worker (``parts``: the compile
    service splits such a job, service/parts.py; elsewhere it compiles whole)."""

    name: str
    config: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)
    cudagraphs: bool = False
    regions: bool = False
    parts: int = 1

    @property
    def load_config(self) -> dict[str, Any]:
        """What its artifact loads under (cudagraphs.py reads and drops its own key); also
        what its cache key is made of, so that a tier with CUDA graphs, or compiled region
        by region, has entries and verdicts of its own."""
        config = dict(self.config)
        if self.cudagraphs:
            config[CUDAGRAPHS_KEY] = True
        if self.regions:
            config[REGIONS_KEY] = True
        if self.parts > 1:
            config[PARTS_KEY] = self.parts
        return config


def _fits(default: Any, value: Any) -> bool:
    """Whether ``value`` may replace an inductor config ``default`` (bools are not ints here)."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        # math.isnan(int) converts, and overflows past 1e308: only a float can be NaN
        return (isinstance(value, int | float) and not isinstance(value, bool)
                and not (isinstance(value, float) and math.isnan(value)))
    if isinstance(default, str):
        return isinstance(value, str)
    return True  # None, lists, callables...: inductor checks those itself


def _check_config_keys(where: str, config: dict[str, Any]) -> None:
    """Keys inductor knows, each with a value of its default's type (where the default is a
    bool, int, float or str: a mistyped value fails here, not in a worker's compile).
    ``where``: what the message names ("tier 'x'", "options")."""
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    unknown = sorted(k for k in config if k not in known)
    if unknown:
        raise ValueError(f"{where}: unknown inductor config key(s) {unknown}; see "
                         "torch._inductor.config for the valid names")
    for key, value in config.items():
        default = known[key]
        if value is not None and not _fits(default, value):
            kind = type(default).__name__
            raise ValueError(f"{where}: inductor config {key!r} takes "
                             f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} (default "
                             f"{default!r}), got {value!r}")


def _hotswap_names() -> list[str]:
    return sorted([*Options.__dataclass_fields__, "options"])


def _closest(key: str, names: list[str]) -> str:
    close = difflib.get_close_matches(key, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_options(options: Any) -> dict[str, Any]:
    """``options=``: inductor config patches (``{"max_autotune": True, "triton.cudagraphs":
    True}``), checked as tier configs are, with a dash read as an underscore (as torch
    does). Returns them under inductor's names."""
    from torch._inductor import config as inductor_config

    if options is None:
        return {}
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ValueError(f"options must be a dict of inductor config patches "
                         f"({{'max_autotune': True}}), got {options!r}")
    known = inductor_config.get_config_copy()
    patches: dict[str, Any] = {}
    for key, value in options.items():
        if key in Options.__dataclass_fields__:
            raise ValueError(f"options={{{key!r}: ...}}: {key!r} is hotswap's own option, not an "
                             f"inductor config key; pass it as {key}=... (torch.compile's "
                             "backend='hotswap' takes both in options)")
        name = key.replace("-", "_")
        if name not in known:
            hint = _closest(name, [*known, *_hotswap_names()])
            raise ValueError(f"unknown option {key!r}{hint}: neither one of hotswap's options nor "
                             f"an inductor config key (torch._inductor.config). Inductor config "
                             f"for one tier only goes in {_TIERS_FORM}")
        patches[name] = value
    _check_config_keys("options", patches)
    return patches


def split_torch_options(options: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile(m, backend="hotswap", options={...})`` as ``Options.create``'s keywords:
    hotswap's own names first (no inductor config key is spelled like one: a test holds
    that), every other key an inductor config patch (checked by ``check_options``)."""
    ours = {k: v for k, v in options.items() if k in Options.__dataclass_fields__}
    patches = {k: v for k, v in options.items() if k not in ours}
    return {**ours, "options": patches} if patches else ours


def apply_options(tiers: tuple[Tier, ...], patches: dict[str, Any]) -> tuple[Tier, ...]:
    """Every tier with ``patches`` on top of its own config (they win where both set a key,
    as torch's options win over its mode's presets); ``triton.cudagraphs`` sets whether the
    tiers serve through CUDA graphs."""
    if not patches:
        return tiers
    config = {k: v for k, v in patches.items() if k != TORCH_CUDAGRAPHS_KEY}
    graphs = patches.get(TORCH_CUDAGRAPHS_KEY)
    return tuple(replace(t, config={**t.config, **config},
                         cudagraphs=t.cudagraphs if graphs is None else bool(graphs))
                 for t in tiers)


def parse_tiers(tiers: Any) -> tuple[Tier, ...]:
    """Tiers from preset names and ``{"name": ..., "config": {...}}`` dicts (or a comma string)."""
    if isinstance(tiers, str):
        tiers = [t.strip() for t in tiers.split(",") if t.strip()]
    if not isinstance(tiers, list | tuple) or not tiers:
        raise ValueError(f"tiers must be a non-empty list of preset names {sorted(TIER_PRESETS)} "
                         f"or {{'name': ..., 'config': {{...}}}} dicts, got {tiers!r}")
    parsed: list[Tier] = []
    for tier in tiers:
        if isinstance(tier, Tier):
            parsed.append(tier)
        elif isinstance(tier, str):
            if tier not in TIER_PRESETS:
                raise ValueError(f"unknown tier {tier!r}; presets are {sorted(TIER_PRESETS)}, or "
                                 "pass {'name': ..., 'config': {inductor config patches}}")
            parsed.append(Tier(tier, dict(TIER_PRESETS[tier]), tier in CUDAGRAPH_PRESETS))
        elif isinstance(tier, dict):
            name, config = tier.get("name"), tier.get("config", {})
            cudagraphs = tier.get("cudagraphs", False)
            extra = set(tier) - {"name", "config", "cudagraphs"}
            if (not isinstance(name, str) or not name or not isinstance(config, dict) or extra
                    or not isinstance(cudagraphs, bool)):
                raise ValueError("a custom tier is {'name': str, 'config': dict, 'cudagraphs': "
                                 f"bool (optional)}}, got {tier!r}")
            _check_config_keys(f"tier {name!r}", config)
            parsed.append(Tier(name, dict(config), cudagraphs))
        else:
            raise ValueError(f"a tier is a preset name or a dict, got {tier!r}")
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"tier names must be unique, got {names}")
    return tuple(parsed)


def _path_option(kwargs: dict[str, Any], name: str, env: str | None) -> str | None:
    value = kwargs.get(name) or env
    if value is not None and not isinstance(value, str | os.PathLike):
        raise ValueError(f"{name} must be a path or None, got {value!r}")
    return os.fspath(value) if value is not None else None


def _worker_devices(value: Any) -> tuple[str, ...]:
    """``worker_devices`` (or HOTSWAP_WORKER_DEVICES, "cuda:1,cuda:1"): the GPU each local
    worker compiles and benchmarks on, cycled over the workers."""
    if value is None:
        value = settings.worker_devices() or ()
    if isinstance(value, str):
        value = [d.strip() for d in value.split(",") if d.strip()]
    if not isinstance(value, list | tuple) or not all(isinstance(d, str) for d in value):
        raise ValueError(f"worker_devices must be a list of 'cuda:N', got {value!r}")
    for device in value:
        kind, _, index = device.partition(":")
        if kind != "cuda" or not index.isdigit():
            raise ValueError(f"worker_devices takes GPUs as 'cuda:N' (one per worker, cycled), "
                             f"got {device!r}")
    return tuple(value)


@dataclass(frozen=True)
class Options:
    mode: str = "progressive"
    tiers: tuple[Tier, ...] = ()
    workers: int | None = None
    cache_dir: str | None = None
    timeout_s: float | None = None
    verify: bool = False
    on_failure: str = "stay"
    dynamic: bool | None = None
    fullgraph: bool = False
    gate: bool = True
    gate_threshold: float = 0.02
    force_tier: str | None = None
    profile_dir: str | None = None
    # Beyond one machine (hotswap/fleet): where compiles run, the fleet's store, and the
    # GPU each local worker compiles and benchmarks on.
    executor: Any = None
    cache_url: str | None = None
    worker_devices: tuple[str, ...] = ()
    regions: str = "auto"

    @classmethod
    def create(cls, **kwargs: Any) -> Options:  # one flat check per option: long on purpose
        """Validate keyword options; unset ones come from HOTSWAP_* variables, then defaults."""
        valid = _hotswap_names()
        unknown = sorted(set(kwargs) - set(valid))
        if unknown:
            raise ValueError(f"unknown option {unknown[0]!r}{_closest(unknown[0], valid)}; "
                             f"hotswap's options are {valid}. Inductor config keys go in "
                             f"options={{...}} (every tier), or in {_TIERS_FORM} (one tier)")
        # An argument given is checked as given (mode="" and tiers=[] are errors, not defaults).
        mode = kwargs["mode"] if kwargs.get("mode") is not None else (
            settings.mode() or "progressive")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; valid modes are {list(MODES)}")
        tiers = kwargs["tiers"] if kwargs.get("tiers") is not None else settings.tiers()
        if tiers is None:
            tiers = DEFAULT_LADDER if mode == "progressive" else ("default",)
        workers = kwargs.get("workers")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                    or workers < 1):
            raise ValueError(f"workers must be an int >= 1 or None, got {workers!r}")
        timeout_s = kwargs.get("timeout_s")
        if timeout_s is None:
            timeout_s = settings.timeout_s()
        if timeout_s is not None and (isinstance(timeout_s, bool)
                                      or not isinstance(timeout_s, int | float)
                                      or not 0 < timeout_s <= sys.float_info.max):
            raise ValueError(f"timeout_s must be a finite number > 0 or None, got {timeout_s!r}")
        on_failure = kwargs.get("on_failure", "stay")
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure must be one of {list(ON_FAILURE)}, got {on_failure!r}")
        for flag in ("verify", "fullgraph", "gate"):
            if not isinstance(kwargs.get(flag, False), bool):
                raise ValueError(f"{flag} must be True or False, got {kwargs[flag]!r}")
        dynamic = kwargs.get("dynamic")
        if dynamic not in (None, True, False):
            raise ValueError(f"dynamic must be None, True or False, got {dynamic!r}")
        cache_dir = _path_option(kwargs, "cache_dir", settings.cache_dir())
        profile_dir = _path_option(kwargs, "profile_dir", settings.profile_dir())
        threshold = kwargs.get("gate_threshold")
        if threshold is None:
            threshold = settings.gate_threshold()
            if threshold is None:
                threshold = 0.02
        if (isinstance(threshold, bool) or not isinstance(threshold, int | float)
                or not -1.0 < threshold < 1.0):
            raise ValueError(f"gate_threshold must be a fraction between -1 and 1 (0.02: a tier "
                             f"must be 2% faster to replace the serving one), got {threshold!r}")
        force_tier = kwargs.get("force_tier")
        regions = kwargs["regions"] if kwargs.get("regions") is not None else (
            settings.regions() or "auto")
        if regions not in REGIONS:
            raise ValueError(f"regions must be one of {list(REGIONS)}, got {regions!r}")
        parsed = apply_options(parse_tiers(tiers), check_options(kwargs.get("options")))
        names = [t.name for t in parsed]
        if force_tier is not None and force_tier not in names:
            raise ValueError(f"force_tier must name a tier of the ladder {names}, got "
                             f"{force_tier!r}")
        executor = (kwargs["executor"] if kwargs.get("executor") is not None
                    else settings.executor())
        executor = registry.check(executor)
        cache_url = kwargs.get("cache_url") or settings.cache_url()
        if cache_url is not None and (not isinstance(cache_url, str) or not cache_url.startswith(
                ("redis://", "rediss://", "unix://"))):
            raise ValueError(f"cache_url must be a Redis URL (redis://host:port/db), got "
                             f"{cache_url!r}")
        worker_devices = _worker_devices(kwargs.get("worker_devices"))
        settings.check_all()
        return cls(
            mode=mode,
            tiers=parsed,
            workers=workers,
            cache_dir=cache_dir,
            timeout_s=float(timeout_s) if timeout_s is not None else None,
            verify=kwargs.get("verify", False),
            on_failure=on_failure,
            dynamic=dynamic,
            fullgraph=kwargs.get("fullgraph", False),
            gate=kwargs.get("gate", True),
            gate_threshold=float(threshold),
            force_tier=force_tier,
            profile_dir=profile_dir,
            executor=executor,
            cache_url=cache_url,
            worker_devices=worker_devices,
            regions=regions,
        )

    def limit_s(self, tier: Tier | None = None) -> float:
        """How long a compile of ``tier`` (or any wait on one: another process's claim on it,
        a benchmark) may take: ``timeout_s`` when set, else ``DEFAULT_LIMIT_S``, times
        ``AUTOTUNE_FACTOR`` for an autotuning tier (or for no tier in particular). A job over
        it is a tier failure (JobTimeout) and its worker is replaced."""
        if self.timeout_s is not None:
            return self.timeout_s
        if tier is None or any(tier.config.get(k) for k in _AUTOTUNE_KEYS):
            return DEFAULT_LIMIT_S * AUTOTUNE_FACTOR
        return DEFAULT_LIMIT_S

    @property
    def plan(self) -> Plan:
        """What the mode composes (the coordinator reads this, never the mode string)."""
        plan = _PLANS[self.mode]
        return plan._replace(gated=plan.gated and self.gate,
                             probation=plan.probation and self.gate)


class Plan(NamedTuple):
    """A mode as a composition: where tiers compile, whether the first call waits for one,
    whether the ladder climbs every tier (else the top one alone) and is gated by benchmarks,
    or its tier serves at once on probation against eager's calls (served.py)."""

    here: bool      # inductor in this process, in the call (else workers, through the cache)
    waits: bool     # the first call waits for its tier (else eager, and swapped in later)
    climbs: bool
    gated: bool
    probation: bool = False


_PLANS = {
    "inprocess": Plan(here=True, waits=True, climbs=False, gated=False),
    "subprocess": Plan(here=False, waits=True, climbs=False, gated=False),
    "async": Plan(here=False, waits=False, climbs=False, gated=False, probation=True),
    "progressive": Plan(here=False, waits=False, climbs=True, gated=True),
}
