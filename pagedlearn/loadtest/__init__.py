"""Load tests: the seed's request mix against the engine in process, or against any
OpenAI-compatible server over HTTP (``python -m pagedlearn loadtest``).

- ``mix.py`` -- the request mix (prompt and output lengths, shared prefixes, early stops).
- ``in_process.py``, ``driver.py`` -- the mix on an :class:`~pagedlearn.LLM` in this process.
- ``http.py``, ``http_stream.py`` -- the mix over HTTP, streamed, timing each token as it arrives.
- ``report.py``, ``http_report.py``, ``tails.py``, ``verdicts.py``, ``checks.py`` -- what a run
  measured, its tail latencies, what it says about the server, and the checks of its options.
- ``server_metrics.py`` -- a server's ``/metrics`` page before and after, read back.

A first reading of pagedlearn can skip this folder.
"""
