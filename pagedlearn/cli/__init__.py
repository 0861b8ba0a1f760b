"""The commands behind ``python -m pagedlearn`` and the chapters' set-up (a first reading can skip
this folder): ``demo``, ``blocks``, ``figures``, ``check-env``, running the chapters
(``chapters.py``) and preparing a notebook kernel (``notebook.py``'s ``setup``)."""
