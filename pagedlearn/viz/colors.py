"""Who gets which colour: one assignment per run, shared by every drawing of that run.

Every picture colours a block by the *request* that owns it, so a reader can follow a request
from the live view to the replay to a static figure. That only works if all of them agree, so
one object decides: :class:`Palette`. It watches a run frame by frame (:meth:`Palette.observe`)
and gives a request its colour on the first frame the request is **visible** in: listed as
waiting, running or swapped, or owning blocks (GPU or CPU). The request keeps that colour while
it stays visible; when it leaves, the colour becomes free for a later request.

The rule for a newcomer (a request that had a colour before and finds it free gets it back):

1. an Okabe-Ito colour nobody has used yet, in order (blue, orange, green, vermillion, pink, sky
   blue, yellow: the set chosen to stay apart for the common kinds of colour blindness). Its
   eighth colour, black, is left out (:data:`REQUEST_COLORS`): a black block is easily taken
   for the grey of a block that several requests share, and black is the pictures' ink;
2. else the Okabe-Ito colour freed longest ago -- so a colour that just left the screen is not
   reused at once, and a reader does not take the newcomer for the request that just finished;
3. only when all 7 are held by visible requests: Paul Tol's *muted* scheme (9 more colours
   designed for colour-blind readers, SRON technical note "Colour Schemes"), same order of
   preference;
4. past 16 visible requests at once, generated hues (golden-angle steps around the colour
   wheel). They are still all different, but no longer easy to tell apart: the request list,
   the legend and the block inspector name every block's request.

So **two requests visible at the same time never share a colour**, whatever the run.

Why a run, not a picture: a colour that depends on one frame alone cannot both stay put while
requests come and go and stay distinct (a request 8 arrivals later would have to reuse the first
one's colour while it is still running). So the assignment follows the frames, and every source
of frames carries it:

- :func:`~pagedlearn.viz.state.replay_states` runs one ``Palette`` over a recorded log and puts
  each frame's colours in its :class:`~pagedlearn.viz.state.PoolState` (``state.colors``). The
  replay view and any figure drawn from a replayed state read them: equal by construction.
- :class:`~pagedlearn.viz.live.LiveBlockView` runs the same rule over the frames it sees (one per
  ``step`` event), so a live view created when the recording starts shows what the replay shows.
- A figure of a live manager: pass ``palette=Palette.follow(kv)`` (created when recording
  starts), which observes every ``step`` event of ``kv`` -- the frames a replay will see.
- A plain ``Palette()`` shared between drawings observes what it is asked to draw; a drawing
  without any gets a fresh one (colours in the order of :func:`groups_in_order`).

>>> p = Palette()
>>> p.color("a"), p.color("b"), p.color("a")
('#0072b2', '#e69f00', '#0072b2')
"""

from __future__ import annotations

import colorsys
import copy
from collections.abc import Hashable, Iterable
from dataclasses import replace

from matplotlib.colors import to_hex

from pagedlearn.sim import plots
from pagedlearn.viz.frame import PoolState, groups_in_order
from pagedlearn.viz.sources import LiveFrames

OKABE_ITO = plots.OKABE_ITO
REQUEST_COLORS = [c for c in OKABE_ITO if to_hex(c) != "#000000"]  # black: see rule 1 above
TOL_MUTED = ["#332288", "#88CCEE", "#44AA99", "#117733", "#999933", "#DDCC77", "#CC6677",
             "#882255", "#AA4499"]  # fmt: skip
GOLDEN_ANGLE = 0.381966  # of a turn: successive generated hues stay far apart


def visible_groups(state: PoolState) -> list[Hashable]:
    """The requests a frame shows (in :func:`groups_in_order`): those listed as waiting, running
    or swapped, and the owners of GPU or CPU blocks. Finished requests hold no colour."""
    shown = {r.request_id for r in state.requests if r.status != "finished"}
    shown |= {state.group_of(s) for s in (*state.tables, *state.swapped)}
    return [g for g in groups_in_order(state) if g in shown]


class Palette:
    """A colour per request, handed out as the module docstring says; one per run.

    ``colors``: the first-choice colours (default Okabe-Ito without black); ``extra``: the next
    tier (default Paul Tol's muted scheme). Without :meth:`observe` nothing ever leaves, so a
    palette used only through :meth:`color` hands out 16 colours, then generated ones, never one
    twice.
    """

    def __init__(self, colors: Iterable[str] = REQUEST_COLORS, extra: Iterable[str] = TOL_MUTED):
        base = [to_hex(c) for c in colors]  # raises ValueError for something not a colour
        if not base:
            raise ValueError("a Palette needs at least one colour")
        self.colors = list(dict.fromkeys(base))
        self.extra = [c for c in dict.fromkeys(to_hex(c) for c in extra) if c not in base]
        self._generated: list[str] = []
        self._assigned: dict[Hashable, str] = {}  # every group seen -> its (last) colour
        self._visible: dict[Hashable, None] = {}  # groups holding their colour now
        self._freed: dict[str, int] = {}  # colour -> the frame its last holder left
        self._frame = 0
        self._unsubscribe = None

    # --- the rule -------------------------------------------------------------------------------
    def color(self, group: Hashable) -> str:
        """The colour of ``group`` (a hex string), which is visible from now on."""
        try:
            if group in self._visible:
                return self._assigned[group]
        except TypeError:
            raise TypeError(
                f"a palette group must be hashable, got {type(group).__name__}"
            ) from None
        held = {self._assigned[g] for g in self._visible}
        old = self._assigned.get(group)
        c = old if old is not None and old not in held else self._newcomer(held)
        self._freed.pop(c, None)
        self._assigned[group] = c
        self._visible[group] = None
        return c

    def _newcomer(self, held: set[str]) -> str:
        used = set(self._assigned.values())
        for tier in (self.colors, self.extra):
            fresh = [c for c in tier if c not in used]
            if fresh:
                return fresh[0]
            freed = [c for c in tier if c not in held]
            if freed:
                return min(freed, key=lambda c: self._freed.get(c, -1))
        for c in self._generated:
            if c not in held:
                return c
        taken = {*self.colors, *self.extra, *self._generated, "#ffffff", "#000000"}
        i = len(self._generated)
        while True:  # a new hue, distinct from every colour this palette knows
            r, g, b = colorsys.hls_to_rgb((i * GOLDEN_ANGLE) % 1.0, 0.45 + 0.15 * (i % 2), 0.7)
            c, i = to_hex((r, g, b)), i + 1
            if c not in taken:
                self._generated.append(c)
                return c

    def observe(self, state: PoolState) -> dict[Hashable, str]:
        """Take in the next frame of the run: requests no longer visible free their colours,
        newcomers get theirs. Returns the frame's colours, request -> colour."""
        if not isinstance(state, PoolState):
            raise TypeError(f"observe needs a PoolState, got {type(state).__name__}")
        self._frame += 1
        visible = visible_groups(state)
        keep = set(visible)
        for g in [g for g in self._visible if g not in keep]:
            del self._visible[g]
            self._freed[self._assigned[g]] = self._frame
        return {g: self.color(g) for g in visible}

    def paint(self, state: PoolState) -> PoolState:
        """``state`` with its colours (``state.colors``). A palette that follows a run
        (:meth:`follow`) only reads: the frames it observes decide. Any other observes
        ``state`` as the next frame."""
        colors = (copy.deepcopy(self) if self.following else self).observe(state)
        return replace(state, colors=colors)

    def assign(self, groups: Iterable[Hashable]) -> None:
        """Give colours to ``groups`` in this order (those already coloured keep theirs)."""
        for g in groups:
            self.color(g)

    # --- following a live run -------------------------------------------------------------------
    @classmethod
    def follow(cls, source, **kwargs) -> Palette:
        """A palette that observes every frame of ``source`` (a ``KVCacheManager``, an
        ``LLMEngine`` or an ``LLM``) from now on -- one per ``step`` event and per prefix-cache
        reset (:class:`~pagedlearn.viz.sources.LiveFrames`): create it when you start
        recording, and the figures you draw with it colour requests as the replay of that
        recording will."""
        engine = getattr(source, "engine", source)
        kv = getattr(engine, "kv", engine)
        if not hasattr(kv, "trace"):
            raise TypeError(
                f"Palette.follow needs a KVCacheManager, an LLMEngine or an LLM, got "
                f"{type(source).__name__}"
            )
        palette, frames = cls(**kwargs), LiveFrames(kv)

        def on_event(e) -> None:
            state = frames.at(e)
            if state is not None:
                palette.observe(state)

        palette._unsubscribe = kv.trace.subscribe(on_event)
        return palette

    @property
    def following(self) -> bool:
        return self._unsubscribe is not None

    def close(self) -> None:
        """Stop following (the colours handed out so far stay)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def __deepcopy__(self, memo):  # a copy to try a frame on: it must not follow anything
        clone = copy.copy(self)
        clone._assigned, clone._visible = dict(self._assigned), dict(self._visible)
        clone._freed, clone._generated = dict(self._freed), list(self._generated)
        clone._unsubscribe = None
        return clone

    # --- reading --------------------------------------------------------------------------------
    @property
    def groups(self) -> list[Hashable]:
        """The groups seen so far, in the order they first got a colour."""
        return list(self._assigned)

    @property
    def visible(self) -> dict[Hashable, str]:
        """The groups visible now (as of the last frame), with their colours."""
        return {g: self._assigned[g] for g in self._visible}

    def __contains__(self, group: Hashable) -> bool:
        return group in self._assigned

    def __len__(self) -> int:
        return len(self._assigned)

    def __repr__(self) -> str:
        return f"Palette({self.visible!r})"
