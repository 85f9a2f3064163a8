"""Tools built on hotswap's public API: ``hotswap bench``, ``stress``, ``profile``, ``corpus``,
and the models they run (``zoo``: ours; ``corpus``: real architectures from transformers)."""
