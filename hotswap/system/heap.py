"""The cycle collector's full passes, kept off the user's calls.

CPython's collector stops the interpreter for a full pass over every object it tracks, and
starts one once the objects that survived its younger generations grew by a quarter since the
last. The load path's warm-up (engine/loading/warmup.py) grows the heap that much: in a GPT-2
process on the 2-core box (349 k objects tracked: torch, dynamo, the model), importing
inductor's compiler set off one full pass of 233-290 ms, holding the GIL while the user's
calls waited. Moving what is alive before the imports into the collector's permanent
generation (``gc.freeze()``) left a pass over the 90 k new objects alone (38-39 ms); moving
those too once imported keeps later passes to what the process allocates from then on.

What a freeze costs: a frozen object that is dropped later is still freed by its reference
count, as nearly everything is (the corpus's models, compiled by dynamo and dropped after
``torch.compiler.reset()``, all were); only a reference cycle among frozen objects outlives
its last user, ``gc.collect()`` included, as does cyclic garbage not yet collected when the
freeze came. ``torch.compiler.reset()`` thaws the heap hotswap froze (``thaw``; the warm-up
registers it with dynamo after each freeze), so the next full pass finds such cycles; a heap
the program froze itself, before hotswap or since, stays frozen. ``HOTSWAP_GC_FREEZE=off``
leaves the collector alone.
"""

from __future__ import annotations

import gc
import threading

from hotswap import settings

__all__ = ["freeze", "thaw"]

_lock = threading.Lock()
_froze = False           # hotswap froze the heap since the last thaw
_program_froze = False   # the program froze it too: before hotswap's first freeze, or since
_after = 0               # the freeze count right after hotswap's last freeze (or thaw)


def freeze() -> None:
    """Move every object tracked now out of the collector's full passes (unless
    ``HOTSWAP_GC_FREEZE=off``). Never raises: a malformed setting freezes nothing (hotswap.compile
    names the variable)."""
    global _froze, _after
    try:
        if not settings.gc_freeze():
            return
    except ValueError:
        return
    with _lock:
        _note_program_freeze()
        gc.freeze()
        _froze, _after = True, gc.get_freeze_count()


def thaw() -> None:
    """``torch.compiler.reset()``: give what hotswap froze back to the collector, unless the
    program froze the heap itself (its frozen objects and hotswap's are one generation)."""
    global _froze, _after
    with _lock:
        _note_program_freeze()
        if _froze and not _program_froze:
            gc.unfreeze()
        _froze, _after = False, gc.get_freeze_count()


def _note_program_freeze() -> None:
    """Frozen objects only leave (their reference counts free them) unless someone freezes:
    more of them than hotswap left means the program froze too. (A freeze of fewer objects
    than have left since goes unseen: a program freezes once it has loaded something.)"""
    global _program_froze
    if gc.get_freeze_count() > _after:
        _program_froze = True
