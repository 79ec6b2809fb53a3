"""Adapters that plug fa2cupy's kernels into other libraries. Each is a module imported explicitly (nothing here is
imported by ``import fa2cupy``):

* :mod:`fa2cupy.integrations.transformers`: the ``"fa2cupy"`` attention implementation of Hugging Face transformers
  (``attn_implementation="fa2cupy"``); needs ``pip install 'fa2cupy[transformers]'``.
"""
