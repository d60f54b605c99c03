"""The model zoo: a small but real model family trained here, loaded like any checkpoint.

``cosine models build --profile {tiny,default,gpu} --out DIR`` writes a zoo directory: a shared
byte-level BPE tokenizer, a Llama-architecture target trained on four domains (code, prose,
arithmetic, records), one small drafter per domain distilled from the target on that domain,
one generalist drafter, held-out prompts and ``zoo.json`` (parameter counts, training figures,
target perplexity per domain and the drafter x domain acceptance matrix at k = 4).

``cosine_zoo.manifest.load_zoo(DIR)`` validates a zoo and returns a frozen
:class:`~cosine_zoo.manifest.Zoo`; tests get one from the session fixture ``tiny_zoo``.

Tokenizer convention: ``tokenizer(text).input_ids`` starts with BOS and has no EOS; decoding with
``skip_special_tokens=True`` gives the text back byte for byte.
"""
