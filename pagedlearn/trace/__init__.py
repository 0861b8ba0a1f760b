"""The event trace: every block operation the manager makes, as data.

- ``events.py`` -- :class:`Trace` (who listens), :class:`EventLog` (a recording, saved as JSON),
  the ``step`` frames that replays and live views step through.
- ``block_events.py`` -- what the manager emits for each operation (allocate, cow_copy, evict...).
- ``file.py``, ``limits.py``, ``checks.py`` -- reading a trace file someone else wrote: its
  shape, caps on everything built in proportion to it, and the rules its events must keep.
- ``replay.py`` -- a pool rebuilt from the events, step by step (what the pictures draw).
"""
