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
freeze came. ``torch.compiler.reset()`` thaws the heap hotswap froze (``thaw``, from
the reset hook hotswap registers with dynamo), so the next full pass finds such cycles; a heap
the program had frozen before hotswap stays frozen. A program that freezes the heap itself
later (a pre-fork server, once its model is loaded) and resets dynamo after that sets
``HOTSWAP_GC_FREEZE=off``: a reset would thaw its freeze too (the two are one generation, and
telling them apart means counting every frozen object, holding the GIL).
"""

from __future__ import annotations

import gc
import threading

from hotswap import settings

__all__ = ["freeze", "thaw"]

_lock = threading.Lock()
_froze = False           # hotswap froze the heap since the last thaw
_program_froze = False   # the program had frozen it before hotswap did


def freeze() -> None:
    """Move every object tracked now out of the collector's full passes (unless
    ``HOTSWAP_GC_FREEZE=off``). Never raises: a malformed setting freezes nothing (hotswap.compile
    names the variable)."""
    global _froze, _program_froze
    try:
        if not settings.gc_freeze():
            return
    except ValueError:
        return
    with _lock:
        # Counting walks the frozen objects, holding the GIL (40 ms for 400 k of them): only
        # while none are hotswap's, where it counts the program's alone (none, as a rule).
        if not _froze and not _program_froze and gc.get_freeze_count():
            _program_froze = True
        gc.freeze()
        _froze = True


def thaw() -> None:
    """``torch.compiler.reset()``: give what hotswap froze back to the collector, unless the
    program had frozen the heap before (its frozen objects and hotswap's are one generation)."""
    global _froze
    with _lock:
        if _froze and not _program_froze:
            gc.unfreeze()
        _froze = False
