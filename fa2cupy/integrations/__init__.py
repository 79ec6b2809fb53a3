"""Adapters that plug fa2cupy's kernels into other libraries. Each is a module imported explicitly (nothing here is
imported by ``import fa2cupy``):

* :mod:`fa2cupy.integrations.transformers`: the ``"fa2cupy"`` attention implementation of Hugging Face transformers
  (``attn_implementation="fa2cupy"``); needs ``pip install 'fa2cupy[transformers]'``.
* :mod:`fa2cupy.integrations.torch_sdpa`: fa2cupy as a flash-attention implementation of PyTorch's
  ``scaled_dot_product_attention``, registered on import and active only after
  ``torch.nn.attention.activate_flash_attention_impl("fa2cupy")``; needs a torch with that registry.
"""
